//! kwexport's own kernels, for fused chains torch has no CPU kernel for at these sizes. Each
//! runs on plain slices (contiguous float32 memory the caller checked); the plan gives a node
//! one only at `optimize="fast"`, where a pass fused the chain, and runs torch's op for the
//! node wherever the tensors don't qualify.

/// RMS normalization over rows of `n = w.len()` values: `w * (x * rsqrt(mean(x^2) + eps))`,
/// as the decomposed pattern computes it (the mean of squares, plus `eps`, its reciprocal
/// square root, times `x`, then the weight), in float32 with the sum of squares taken in
/// sixteen lanes (the order differs from torch's reduction by rounding: `docs/optimize.md`).
pub fn rms_norm_f32(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    if n == 0 {
        return;
    }
    for (row, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for (l, v) in lanes.iter_mut().zip(c) {
                *l += v * v;
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        let sum = lanes.iter().sum::<f32>() + tail;
        let scale = 1.0 / (sum / n as f32 + eps).sqrt();
        for ((d, &v), &g) in dst.iter_mut().zip(row).zip(w) {
            *d = g * (v * scale);
        }
    }
}

/// The width of a weight panel: the columns one pass of the linear kernel computes.
pub const PANEL: usize = 64;

/// `out[m, n] = bias[n] + x[m, k] @ w[k, n]` for small `m` (a few rows of activations: a
/// decode step, a small batch), where torch's GEMM spends more on setup than on arithmetic.
/// `panels` is the weight packed once at load ([`pack_panels`]): `ceil(n / 64)` contiguous
/// `[k, 64]` panels, so the kernel streams each panel from memory in order (a row of a plain
/// `[k, n]` weight is a new page every few rows, which the prefetchers don't follow). Returns
/// `false` (writing nothing) where this CPU lacks AVX-512; the plan measures it against
/// torch's kernel per shape and keeps the faster (`exec`).
pub fn linear_f32(
    x: &[f32],
    m: usize,
    k: usize,
    panels: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> bool {
    let fits = x.len() >= m * k
        && panels.len() >= k * n.div_ceil(PANEL) * PANEL
        && out.len() >= m * n
        && bias.is_none_or(|b| b.len() >= n);
    #[cfg(target_arch = "x86_64")]
    if fits && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present, and every slice holds what the shapes say (checked).
        unsafe { avx512::linear(x, m, k, panels, n, bias, out) };
        return true;
    }
    let _ = (fits, x, m, k, panels, n, bias, out);
    false
}

/// A `[k, n]` weight (row-major, `w[r * n + c]`) as the linear kernel's panels: panel `p`
/// holds columns `[64 p, 64 p + 64)` as a contiguous `[k, 64]` block, zero past `n`.
pub fn pack_panels(w: &[f32], k: usize, n: usize, panels: &mut [f32]) {
    if k == 0 {
        return;
    }
    for (p, panel) in panels.chunks_exact_mut(k * PANEL).take(n.div_ceil(PANEL)).enumerate() {
        let (c0, width) = (p * PANEL, (n - p * PANEL).min(PANEL));
        for (r, row) in panel.chunks_exact_mut(PANEL).enumerate() {
            row[..width].copy_from_slice(&w[r * n + c0..r * n + c0 + width]);
            row[width..].fill(0.0);
        }
    }
}

/// GELU of each element: `0.5 x (1 + erf(x / sqrt 2))`, or with `tanh`, the tanh
/// approximation `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, computed as
/// `x / (1 + exp(-2 u))`. erf is Abramowitz and Stegun's 7.1.26 (absolute error under 1.5e-7,
/// the rational form torch's vectorized erf uses too), exp a degree-7 polynomial after range
/// reduction. Returns `false` (writing nothing) where this CPU lacks AVX-512: torch's op then
/// runs.
pub fn gelu_f32(x: &[f32], tanh: bool, out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if out.len() >= x.len() && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present, and `out` holds at least `x.len()` elements.
        unsafe { avx512::gelu(x, tanh, out) };
        return true;
    }
    let _ = (x, tanh, out);
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// `e^x` in each lane, for `x` clamped to [-87, 88] (float32's normal range): `2^n e^r`
    /// with `r = x - n ln 2` in [-ln2/2, ln2/2], `e^r` by its Taylor series to `r^7`
    /// (relative error ~1e-8, below float32's rounding).
    #[inline(always)]
    unsafe fn exp(x: __m512) -> __m512 {
        // SAFETY (all below): register arithmetic; the caller enabled AVX-512F.
        unsafe {
            let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0)), _mm512_set1_ps(88.0));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
                x,
                _mm512_set1_ps(std::f32::consts::LOG2_E),
            ));
            // ln 2 in two parts, so that n * hi is exact.
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
            let mut p = _mm512_set1_ps(1.0 / 5040.0);
            for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
            }
            _mm512_scalef_ps(p, n)
        }
    }

    /// GELU of 16 lanes (see `super::gelu_f32`).
    #[inline(always)]
    unsafe fn gelu16(x: __m512, tanh: bool) -> __m512 {
        // SAFETY (all below): register arithmetic; the caller enabled AVX-512F.
        unsafe {
            let one = _mm512_set1_ps(1.0);
            if tanh {
                let x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
                let u = _mm512_mul_ps(_mm512_fmadd_ps(x3, _mm512_set1_ps(0.044715), x), _mm512_set1_ps(0.797_884_6));
                let e = exp(_mm512_mul_ps(u, _mm512_set1_ps(-2.0)));
                return _mm512_div_ps(x, _mm512_add_ps(one, e));
            }
            // q = 1 - erf(|x| / sqrt 2), so that 1 + erf(x / sqrt 2) is 2 - q, or q itself for
            // negative x (no cancellation in the tail).
            let z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(std::f32::consts::FRAC_1_SQRT_2));
            let t = _mm512_div_ps(one, _mm512_fmadd_ps(z, _mm512_set1_ps(0.327_591_1), one));
            let mut poly = _mm512_set1_ps(1.061_405_4);
            for c in [-1.453_152_1, 1.421_413_8, -0.284_496_72, 0.254_829_6] {
                poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(c));
            }
            poly = _mm512_mul_ps(poly, t);
            let q = _mm512_mul_ps(poly, exp(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, z))));
            let negative = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_setzero_ps());
            let one_plus_erf = _mm512_mask_blend_ps(negative, _mm512_sub_ps(_mm512_set1_ps(2.0), q), q);
            _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5)), one_plus_erf)
        }
    }

    /// See `super::gelu_f32`.
    ///
    /// # Safety
    /// AVX-512F must be present; `out` must hold at least `x.len()` elements.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn gelu(x: &[f32], tanh: bool, out: &mut [f32]) {
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        while i < x.len() {
            let left = (x.len() - i).min(16);
            let mask = ((1u32 << left) - 1) as u16;
            // SAFETY: lanes [i, i + left) of both slices exist; masked lanes aren't touched.
            unsafe {
                let v = _mm512_maskz_loadu_ps(mask, xp.add(i));
                _mm512_mask_storeu_ps(op.add(i), mask, gelu16(v, tanh));
            }
            i += 16;
        }
    }

    /// Rows `[0, R)` of `x` (row stride `k`) times the `[k, 64]` panel of columns
    /// `[j0, j0 + 16 V)` (zero past `n`), plus the bias, into `out` (row stride `n`, masked past
    /// `n`): `R * V` accumulators held in registers across the whole `k` loop, each weight
    /// vector loaded once per `k`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const V: usize>(
        x: *const f32,
        k: usize,
        panel: *const f32,
        n: usize,
        bias: *const f32,
        out: *mut f32,
        j0: usize,
    ) {
        let mut masks = [0u16; V];
        for (v, mask) in masks.iter_mut().enumerate() {
            let left = n.saturating_sub(j0 + v * 16).min(16);
            *mask = ((1u32 << left) - 1) as u16;
        }
        // SAFETY (all below): the caller guarantees R rows of `x`, a `[k, 64]` panel and R rows
        // of `out` of their strides; masked lanes past `n` are neither read nor written.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); V]; R];
            if !bias.is_null() {
                for v in 0..V {
                    let b = _mm512_maskz_loadu_ps(masks[v], bias.add(j0 + v * 16));
                    acc.iter_mut().for_each(|row| row[v] = b);
                }
            }
            for kk in 0..k {
                let w: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(panel.add(kk * super::PANEL + v * 16)));
                for (r, row) in acc.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*x.add(r * k + kk));
                    for v in 0..V {
                        row[v] = _mm512_fmadd_ps(a, w[v], row[v]);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for v in 0..V {
                    _mm512_mask_storeu_ps(out.add(r * n + j0 + v * 16), masks[v], row[v]);
                }
            }
        }
    }

    /// See `super::linear_f32`.
    ///
    /// # Safety
    /// AVX-512F must be present; the slices must hold `m * k`, `ceil(n / 64) * k * 64`, `n`
    /// and `m * n` elements.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn linear(
        x: &[f32],
        m: usize,
        k: usize,
        panels: &[f32],
        n: usize,
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        let b = bias.map_or(std::ptr::null(), |b| b.as_ptr());
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        // Column blocks outermost: a block's `k x 64` panel of the weight stays in cache while
        // every group of rows reads it, so the weight streams from memory once per call.
        let mut j = 0;
        while j < n {
            let mut i = 0;
            while i < m {
                let rows = (m - i).min(4);
                // SAFETY: rows [i, i + rows), columns from j and their panel exist (see the
                // caller).
                unsafe {
                    let (xr, orow, wp) = (xp.add(i * k), op.add(i * n), panels.as_ptr().add(j / 64 * k * 64));
                    match rows {
                        4 => tile::<4, 4>(xr, k, wp, n, b, orow, j),
                        3 => tile::<3, 4>(xr, k, wp, n, b, orow, j),
                        2 => tile::<2, 4>(xr, k, wp, n, b, orow, j),
                        _ => tile::<1, 4>(xr, k, wp, n, b, orow, j),
                    }
                }
                i += rows;
            }
            j += 64;
        }
    }
}

/// `a + b` over int64 values, where each operand has `out.len()` elements or one (broadcast):
/// integer addition, exact, wrapping on overflow as torch's kernel does.
pub fn add_i64(a: &[i64], b: &[i64], out: &mut [i64]) {
    let at = |x: &[i64], i: usize| if x.len() == 1 { x[0] } else { x[i] };
    for (i, o) in out.iter_mut().enumerate() {
        *o = at(a, i).wrapping_add(at(b, i));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_i64_broadcasts_one_element() {
        let mut out = [0; 3];
        add_i64(&[1, 2, 3], &[10], &mut out);
        assert_eq!(out, [11, 12, 13]);
        add_i64(&[i64::MAX], &[1, 2, 3], &mut out);
        assert_eq!(out, [i64::MIN, i64::MIN + 1, i64::MIN + 2]);
    }

    #[test]
    fn linear_matches_a_double_precision_reference() {
        for (m, k, n) in
            [(1usize, 64usize, 128usize), (3, 100, 70), (4, 256, 256), (9, 17, 5), (2, 1, 1), (33, 40, 200)]
        {
            let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.01).sin()).collect();
            let wt: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.013).cos()).collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.001).collect();
            let mut panels = vec![f32::NAN; k * n.div_ceil(PANEL) * PANEL];
            pack_panels(&wt, k, n, &mut panels);
            for bias in [Some(&b[..]), None] {
                let mut out = vec![f32::NAN; m * n];
                if !linear_f32(&x, m, k, &panels, n, bias, &mut out) {
                    return; // no AVX-512 here: the plan keeps torch's kernel
                }
                for r in 0..m {
                    for j in 0..n {
                        let dot: f64 = (0..k).map(|kk| x[r * k + kk] as f64 * wt[kk * n + j] as f64).sum();
                        let want = dot + bias.map_or(0.0, |b| b[j] as f64);
                        assert!((out[r * n + j] as f64 - want).abs() < 1e-5 * (k as f64).sqrt(), "{m}x{k}x{n} {r} {j}");
                    }
                }
            }
        }
    }

    /// erf in double: its Taylor series below 2.5, else 1 - erfc by erfc's continued fraction.
    fn erf(z: f64) -> f64 {
        if z.abs() >= 2.5 {
            let a = z.abs();
            let f = (1..80).rev().fold(a, |f, n| a + (n as f64 / 2.0) / f);
            return z.signum() * (1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * f));
        }
        let (mut term, mut sum) = (z, z);
        for n in 1..200 {
            term *= -z * z / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn gelu_matches_a_double_precision_reference() {
        let x: Vec<f32> = (0..301).map(|i| (i as f32 - 150.0) * 0.07).chain([-90.0, 90.0, 0.0]).collect();
        for tanh in [false, true] {
            let mut out = vec![f32::NAN; x.len()];
            if !gelu_f32(&x, tanh, &mut out) {
                return; // no AVX-512 here: torch's op runs
            }
            for (&v, &got) in x.iter().zip(&out) {
                let v = v as f64;
                let want = if tanh {
                    0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
                } else {
                    0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2))
                };
                assert!((got as f64 - want).abs() <= 2e-7 * v.abs().max(1.0), "tanh={tanh} x={v}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn rms_norm_normalizes_each_row() {
        let x: Vec<f32> = (0..70).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let w: Vec<f32> = (0..35).map(|i| 0.5 + i as f32 * 0.01).collect();
        let mut out = vec![0.0; 70];
        rms_norm_f32(&x, &w, 1e-6, &mut out);
        for r in 0..2 {
            let row = &x[r * 35..(r + 1) * 35];
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 35.0;
            for i in 0..35 {
                let want = w[i] as f64 * row[i] as f64 / (ms + 1e-6).sqrt();
                assert!((out[r * 35 + i] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0), "{r} {i}");
            }
        }
    }
}
