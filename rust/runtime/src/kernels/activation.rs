//! Activations on vectors: the GEMM's and convolutions' epilogues, GELU, and `exp`, which
//! softmax shares. Generic over [`Simd`]; `super::isa` instantiates the slice kernels.

use super::simd::Simd;
use super::Ran;

/// What a kernel applies to each result before storing it: the activation a linear or
/// convolution absorbed (`passes::conv_pointwise`), computed as torch's CPU kernels do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    None,
    Relu,
    /// `min(max(x, 0), 6)` (`hardtanh(x, 0, 6)`).
    Relu6,
    /// `x * min(max(x + 3, 0), 6) / 6`.
    Hardswish,
    /// `min(max(x + 3, 0), 6) / 6`.
    Hardsigmoid,
    /// `1 / (1 + e^-x)`.
    Sigmoid,
    /// `x / (1 + e^-x)` (SiLU).
    Swish,
    /// GELU, `0.5 x (1 + erf(x / sqrt 2))` (see [`gelu_f32`]).
    Gelu,
    /// GELU's tanh approximation (see [`gelu_f32`]).
    GeluTanh,
}

/// `epilogue` applied to each element of `x`, in place: a fused linear's activation on the
/// result of torch's GEMM. Declines (writing nothing) where kwexport's kernels don't
/// run on this CPU (`super::isa`).
pub fn epilogue_f32(epilogue: Epilogue, x: &mut [f32]) -> Ran {
    let t = super::table_if(true)?;
    // SAFETY: the table's functions run on this CPU.
    super::parallel::blocks(&[], x, RUN, RUN * WORK, &|_, x| unsafe { (t.epilogue)(epilogue, x) });
    Ok(())
}

/// Elements per unit where an activation splits across threads (a multiple of every
/// family's lanes), and the floating-point work per element it counts (GELU's erf and exp).
const RUN: usize = 1024;
const WORK: usize = 30;

/// GELU's `erf(x / sqrt 2)` as `x P(x^2) / Q(x^2)`, coefficients from the lowest power: a
/// rational least-squares fit over [0, 5.6], refitted as each coefficient was rounded to
/// float32. Evaluated in float32 its absolute error is under 3e-7 (torch's vectorized erf,
/// Abramowitz and Stegun's 7.1.26 with an exponential, measured 5e-7 the same way). Past 5.6
/// the fit rises above 1 (by 8.5e-7 at [`ERF_CLAMP`], many roundings, so with or without
/// fused multiply-adds), and the kernel clamps it to [-1, 1]: GELU is then exactly `x` above
/// and exactly 0 below (`-inf` giving NaN, as eager's `-inf * 0`).
const ERF_P: [f32; 6] = [0.797_884_46, 0.068_752_21, 0.009_414_516, 0.000_347_701_1, 1.271_306e-5, 4.429_064e-8];
const ERF_Q: [f32; 6] = [1.0, 0.252_833_84, 0.028_940_083, 0.001_912_977, 7.510_187e-5, 1.180_212e-6];
/// Inputs are clamped to [-ERF_CLAMP, ERF_CLAMP] first, so that `x^2`'s powers stay finite.
const ERF_CLAMP: f32 = 5.9;

/// GELU of each element: `0.5 x (1 + erf(x / sqrt 2))` (at +inf, NaN where torch's vectorized
/// kernels run their AVX-512 variant and +inf where they run their AVX2 one, as eager gives;
/// NaN at -inf), or with `tanh`, the tanh approximation `0.5 x (1 + tanh(sqrt(2 / pi) (x +
/// 0.044715 x^3)))`, computed as `x / (1 + exp(-2 u))`. erf is a rational function (see
/// [`ERF_P`]: a division and eleven multiply-adds, where torch's vectorized erf also takes an
/// exponential), exp a degree-7 polynomial after range reduction. Declines (writing nothing) where `out`
/// is shorter than `x` or kwexport's kernels don't run on this CPU: torch's op then runs.
pub fn gelu_f32(x: &[f32], tanh: bool, out: &mut [f32]) -> Ran {
    let t = super::table_if(out.len() >= x.len())?;
    // SAFETY: the table's functions run on this CPU; each block of `out` is as long as its
    // block of `x`.
    super::parallel::blocks(x, &mut out[..x.len()], RUN, RUN * WORK, &|x, out| unsafe { (t.gelu)(x, tanh, out) });
    Ok(())
}

/// `e^x` in each lane: `2^n e^r` with `r = x - n ln 2` in [-ln2/2, ln2/2], `e^r` by its
/// Taylor series to `r^7` (relative error ~1e-8, below float32's rounding). `x` is first
/// clamped to [-104, 89], past which `2^n e^r` rounds to 0 and +inf as `e^x` does, so ±inf
/// give 0 and +inf; NaN stays NaN.
#[inline(always)]
pub(super) unsafe fn exp<S: Simd>(x: S::V) -> S::V {
    // SAFETY (all below): register arithmetic; the caller enabled `S`'s features.
    unsafe {
        let x = S::min(S::splat(89.0), S::max(S::splat(-104.0), x));
        let n = S::round(S::mul(x, S::splat(std::f32::consts::LOG2_E)));
        // ln 2 in two parts, so that n * hi is exact.
        let r = S::fnma(n, S::splat(0.693_145_75), x);
        let r = S::fnma(n, S::splat(1.428_606_8e-6), r);
        let mut p = S::splat(1.0 / 5040.0);
        for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = S::fma(p, r, S::splat(c));
        }
        S::scale2(p, n)
    }
}

/// `epilogue` on one vector, as torch's vectorized CPU kernels compute it, NaN included: the
/// value clamped goes second to `max` and `min`, so a NaN passes through a clamp as through
/// torch's `clamp`. GELU is left to [`apply_any`].
#[inline(always)]
pub(super) unsafe fn apply<S: Simd>(epilogue: Epilogue, x: S::V) -> S::V {
    // SAFETY (all below): register arithmetic; the caller enabled `S`'s features.
    unsafe {
        let (zero, one) = (S::zero(), S::splat(1.0));
        let relu6_of_x_plus_3 = || S::min(S::splat(6.0), S::max(zero, S::add(x, S::splat(3.0))));
        match epilogue {
            Epilogue::None => x,
            Epilogue::Relu => S::max(zero, x),
            Epilogue::Relu6 => S::min(S::splat(6.0), S::max(zero, x)),
            Epilogue::Hardswish => S::div(S::mul(x, relu6_of_x_plus_3()), S::splat(6.0)),
            Epilogue::Hardsigmoid => S::div(relu6_of_x_plus_3(), S::splat(6.0)),
            Epilogue::Sigmoid => S::div(one, S::add(one, exp::<S>(S::sub(zero, x)))),
            Epilogue::Swish => S::div(x, S::add(one, exp::<S>(S::sub(zero, x)))),
            // Too long to inline into the GEMM's tile, whose registers it would take: the
            // GEMM applies them in a pass of their own (`apply_any`).
            Epilogue::Gelu | Epilogue::GeluTanh => x,
        }
    }
}

/// `epilogue` on one vector, GELU included (see [`apply`]), GELU giving `inf` at +inf.
#[inline(always)]
pub(super) unsafe fn apply_any<S: Simd>(epilogue: Epilogue, x: S::V, inf: S::V) -> S::V {
    // SAFETY: register arithmetic; the caller enabled `S`'s features.
    unsafe {
        match epilogue {
            Epilogue::Gelu => gelu::<S>(x, false, inf),
            Epilogue::GeluTanh => gelu::<S>(x, true, inf),
            _ => apply::<S>(epilogue, x),
        }
    }
}

/// GELU of one vector (see [`gelu_f32`]), `inf` at +inf (erf's form only: the tanh form
/// gives torch's NaN or +inf on its own).
#[inline(always)]
unsafe fn gelu<S: Simd>(x: S::V, tanh: bool, inf: S::V) -> S::V {
    // SAFETY (all below): register arithmetic; the caller enabled `S`'s features.
    unsafe {
        let one = S::splat(1.0);
        if tanh {
            let x3 = S::mul(S::mul(x, x), x);
            let u = S::mul(S::fma(x3, S::splat(0.044715), x), S::splat(0.797_884_6));
            let e = exp::<S>(S::mul(u, S::splat(-2.0)));
            return S::div(x, S::add(one, e));
        }
        // erf(x / sqrt 2) = c P(c^2) / Q(c^2) clamped to [-1, 1], c = x clamped to
        // [-ERF_CLAMP, ERF_CLAMP]: odd over even, so one division and no exponential.
        let c = S::min(S::splat(ERF_CLAMP), S::max(S::splat(-ERF_CLAMP), x));
        let c2 = S::mul(c, c);
        let mut p = S::splat(ERF_P[5]);
        for &a in ERF_P[..5].iter().rev() {
            p = S::fma(p, c2, S::splat(a));
        }
        let mut q = S::splat(ERF_Q[5]);
        for &b in ERF_Q[..5].iter().rev() {
            q = S::fma(q, c2, S::splat(b));
        }
        let erf = S::min(one, S::max(S::splat(-1.0), S::div(S::mul(c, p), q)));
        let y = S::mul(S::mul(x, S::splat(0.5)), S::add(one, erf));
        S::select(S::eq(x, S::splat(f32::INFINITY)), inf, y)
    }
}

/// What eager's GELU gives at +inf here (`super::isa::torch_uses_avx512`), in every lane.
///
/// # Safety
/// `S`'s features must be enabled.
#[inline(always)]
unsafe fn gelu_at_inf<S: Simd>() -> S::V {
    let inf = if super::isa::torch_uses_avx512() { f32::NAN } else { f32::INFINITY };
    // SAFETY: as the caller guarantees.
    unsafe { S::splat(inf) }
}

/// See [`epilogue_f32`].
///
/// # Safety
/// `S`'s features must be enabled.
#[inline(always)]
pub(super) unsafe fn epilogue_slice<S: Simd>(epilogue: Epilogue, x: &mut [f32]) {
    let (n, p) = (x.len(), x.as_mut_ptr());
    // SAFETY: register arithmetic; the caller enabled `S`'s features.
    let inf = unsafe { gelu_at_inf::<S>() };
    let mut i = 0;
    while i < n {
        // SAFETY: lanes [i, min(i + LANES, n)) exist; masked lanes aren't touched.
        unsafe {
            let mask = S::first(n - i);
            S::store_masked(p.add(i), mask, apply_any::<S>(epilogue, S::load_masked(mask, p.add(i)), inf));
        }
        i += S::LANES;
    }
}

/// See [`gelu_f32`].
///
/// # Safety
/// `S`'s features must be enabled; `out` must hold at least `x.len()` elements.
#[inline(always)]
pub(super) unsafe fn gelu_slice<S: Simd>(x: &[f32], tanh: bool, out: &mut [f32]) {
    let (n, xp, op) = (x.len(), x.as_ptr(), out.as_mut_ptr());
    // SAFETY: register arithmetic; the caller enabled `S`'s features.
    let inf = unsafe { gelu_at_inf::<S>() };
    let mut i = 0;
    // Two vectors a step, so that their chains (a division, then a polynomial) overlap.
    while i + 2 * S::LANES <= n {
        // SAFETY: lanes [i, i + 2 LANES) of both slices exist.
        unsafe {
            let (a, b) = (S::load(xp.add(i)), S::load(xp.add(i + S::LANES)));
            let (a, b) = (gelu::<S>(a, tanh, inf), gelu::<S>(b, tanh, inf));
            S::store(op.add(i), a);
            S::store(op.add(i + S::LANES), b);
        }
        i += 2 * S::LANES;
    }
    while i < n {
        // SAFETY: lanes [i, min(i + LANES, len)) of both slices exist; masked lanes aren't
        // touched.
        unsafe {
            let mask = S::first(n - i);
            S::store_masked(op.add(i), mask, gelu::<S>(S::load_masked(mask, xp.add(i)), tanh, inf));
        }
        i += S::LANES;
    }
}
