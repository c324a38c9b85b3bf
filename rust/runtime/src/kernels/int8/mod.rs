//! The int8 GEMM: a linear whose input is quantized per tensor (pt2e's static or dynamic
//! activation scale) and whose weight is int8 with a scale per output channel and zero point
//! 0, what `dequantize → linear` computes in a program quantized with torch's flows
//! (`passes::linear_int8`).
//!
//! Each input row is quantized as torch's `quantize_per_tensor` does it; the sums of
//! products are exact in int32, then scaled per column and biased in float32: the products of
//! the quantized graph with none of its float32 rounding along `k`, on the driver the float32
//! GEMM runs on (`gemm::Dot`). Two [`Layout`]s, the weight packed once in the one the CPU's
//! kernel reads:
//! - [`Layout::Quads`] (VNNI's `vpdpbusd`, AVX512-VNNI or AVX-VNNI: four byte products per
//!   lane per instruction): the input's levels as unsigned bytes (`q - qmin`), the weight's as signed
//!   bytes, a quarter of a float32 weight's bytes per call; each column's sums start from
//!   `-(zero_point - qmin) * sum(w)`, so that they equal the sums of `(q - zero_point) * w`.
//!   Without VNNI, AVX2 and AVX-512 read the same layout with `vpmaddubsw` then `vpmaddwd` by
//!   ones ([`Madd`]), whose int16 sums of two products saturate: chosen at packing only where
//!   they can't ([`madd_fits`]: an input of at most 128 levels, torch's `reduce_range`, or
//!   weights of at most 64 in magnitude), where it measured 1.2–1.25× the pairs' speed.
//!   With AMX-INT8, large blocks read it as tiles ([`amx`], `tdpbusd`).
//! - [`Layout::Pairs`] (every family: `vpmaddwd` on AVX2 and AVX-512, two products per lane):
//!   the input's levels less the zero point and the weight both as pairs of int16.

#[cfg(target_arch = "x86_64")]
pub(super) mod amx;
mod conv;
mod expand_depthwise;
pub mod winograd;

pub use conv::{conv, pairs_groups};
pub use expand_depthwise::expand_depthwise;

use super::activation::Epilogue;
use super::gemm::{self, Dense, Shape, Source};
use super::simd::Simd;
use super::{parallel, Declined, Ran, PANEL};

/// The deepest `k` the sums stay exact for: `k * 255 * 128 < 2^31`.
pub const MAX_K: usize = 65_536;

/// Whether `vpmaddubsw`'s int16 sums of two products are exact ([`Madd`]) for an input of
/// levels `0..=levels` (`qmax - qmin`) and weights of at most `peak` in magnitude.
pub fn madd_fits(levels: i64, peak: u8) -> bool {
    levels.checked_mul(2 * i64::from(peak)).is_some_and(|top| (0..=i64::from(i16::MAX)).contains(&top))
}

/// The greatest magnitude among an int8 weight's values (0 for none).
pub fn peak(w: impl IntoIterator<Item = i8>) -> u8 {
    w.into_iter().map(i8::unsigned_abs).max().unwrap_or(0)
}

/// An input's per-tensor quantization, as `quantize_per_tensor(x, scale, zero_point, qmin,
/// qmax, dtype)` takes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quant {
    pub scale: f64,
    pub zero_point: i64,
    pub qmin: i64,
    pub qmax: i64,
}

impl Quant {
    /// Whether the kernel takes it: a finite positive scale (torch refuses the others) and
    /// quantized values within 255 of the zero point (8-bit ones are), so that every sum of
    /// products fits int32.
    pub fn fits(&self) -> bool {
        let near = |q: i64| q.checked_sub(self.zero_point).is_some_and(|d| d.abs() <= 255);
        self.scale.is_finite() && self.scale > 0.0 && self.qmin <= self.qmax && near(self.qmin) && near(self.qmax)
    }

    /// The parameters `choose_qparams.tensor(x, qmin, qmax, eps, dtype)` picks for `x` (dynamic
    /// quantization), computed as `passes::quantized_ops` writes that op out, in float32:
    /// `scale = max((max(hi, 0) - min(lo, 0)) / (qmax - qmin), eps)` and `zero_point =
    /// clamp(qmin - round(min(lo, 0) / scale), qmin, qmax)` over `x`'s least and greatest
    /// values. `None` for an empty `x` or one with a NaN or an infinity (torch's op then
    /// decides).
    pub fn choose(x: &[f32], qmin: i64, qmax: i64, eps: f64) -> Option<Quant> {
        if x.is_empty() || qmax <= qmin {
            return None;
        }
        let (lo, hi) = match super::isa::kernels() {
            // SAFETY: the table's kernel runs on this CPU.
            Some(t) => unsafe { (t.range)(x) },
            None => range_scalar(x),
        }?;
        let scale = ((hi - lo) / (qmax - qmin) as f32).max(eps as f32);
        let steps = (lo / scale).round_ties_even() as i64;
        let zero_point = (qmin - steps).clamp(qmin, qmax);
        Some(Quant { scale: scale as f64, zero_point, qmin, qmax })
    }

    /// The quantization as float32 operands, as the quantize applies them.
    fn levels(&self) -> Levels {
        let f = |v: i64| v as f32;
        Levels {
            inv: (1.0 / self.scale) as f32,
            zero_point: f(self.zero_point),
            qmin: f(self.qmin),
            qmax: f(self.qmax),
        }
    }
}

/// The least and greatest of `x`'s values and 0, `None` where `x` holds a NaN or an
/// infinity: one value at a time, where kwexport's kernels don't run.
fn range_scalar(x: &[f32]) -> Option<(f32, f32)> {
    let (mut lo, mut hi) = (0f32, 0f32);
    for &v in x {
        if !v.is_finite() {
            return None;
        }
        (lo, hi) = (lo.min(v), hi.max(v));
    }
    Some((lo, hi))
}

/// [`range_scalar`] on `S`'s vectors (dynamic quantization reads every input of a linear
/// once more for it): the kernel table's `range`.
///
/// # Safety
/// `S`'s features must be enabled.
#[inline(always)]
pub(super) unsafe fn range<S: Simd>(x: &[f32]) -> Option<(f32, f32)> {
    // SAFETY (all below): the lanes loaded lie in `x` (masked past its end, where they are
    // 0, inside the range anyway).
    unsafe {
        // `v - v` is 0 for a finite `v` and NaN otherwise; a NaN stays in the sum.
        let (mut lo, mut hi, mut finite) = (S::zero(), S::zero(), S::zero());
        let mut c = 0;
        while c < x.len() {
            let v = S::load_masked(S::first(x.len() - c), x.as_ptr().add(c));
            (lo, hi, finite) = (S::min(lo, v), S::max(hi, v), S::add(finite, S::sub(v, v)));
            c += S::LANES;
        }
        if S::any(S::nan(finite)) {
            return None;
        }
        Some((-S::reduce_max(S::sub(S::zero(), lo)), S::reduce_max(hi)))
    }
}

/// A [`Quant`]'s `1.0 / scale` (taken in double, as torch takes it), zero point and range as
/// the float32 operands of the quantize.
#[derive(Clone, Copy)]
pub(super) struct Levels {
    inv: f32,
    zero_point: f32,
    qmin: f32,
    qmax: f32,
}

/// A fake quantization (`dequantize(quantize(y))` per tensor) of results as a GEMM stores
/// them ([`linear`]'s `output`, `passes::linear_int8_output`): the quantize's float32
/// operands and the dequantize's scale.
#[derive(Clone, Copy)]
pub(super) struct Requant {
    levels: Levels,
    scale: f32,
}

impl Requant {
    fn of(quant: &Quant) -> Requant {
        Requant { levels: quant.levels(), scale: quant.scale as f32 }
    }

    /// Each lane's level as [`quantize`] takes it (`clamp(round(y * (1.0 / scale)) +
    /// zero_point, qmin, qmax)`, in float32; a NaN to `qmin`), then `(level - zero_point) *
    /// scale`: exact integers until the scale's one rounding, so the bits of torch's two ops.
    ///
    /// # Safety
    /// `S`'s features must be enabled.
    #[inline(always)]
    pub(super) unsafe fn apply<S: Simd>(&self, y: S::V) -> S::V {
        let q = &self.levels;
        // SAFETY (all below): the caller's.
        unsafe {
            let (inv, zp, lo, hi) = (S::splat(q.inv), S::splat(q.zero_point), S::splat(q.qmin), S::splat(q.qmax));
            // `max` gives its second operand for a NaN: `qmin`.
            let level = S::min(S::max(S::add(S::round(S::mul(y, inv)), zp), lo), hi);
            S::mul(S::sub(level, zp), S::splat(self.scale))
        }
    }

    /// [`Requant::apply`] to each of `y`'s values, in place.
    ///
    /// # Safety
    /// `S`'s features must be enabled.
    #[inline(always)]
    pub(super) unsafe fn apply_slice<S: Simd>(&self, y: &mut [f32]) {
        let mut c = 0;
        // SAFETY: lanes `c..` of `y` exist up to its length, masked past.
        unsafe {
            while c < y.len() {
                let lanes = S::first(y.len() - c);
                let v = S::load_masked(lanes, y.as_ptr().add(c));
                S::store_masked(y.as_mut_ptr().add(c), lanes, self.apply::<S>(v));
                c += S::LANES;
            }
        }
    }
}

/// An input level as a row of the int8 GEMM holds it: an int16 less the zero point (pairs)
/// or an unsigned byte less `qmin` (quads).
pub(super) trait Level: Copy + Default + 'static {
    /// Stores `S::LANES` levels (integers in the type's range, as floats).
    ///
    /// # Safety
    /// `S`'s features must be enabled; `S::LANES` values from `p` are writable.
    unsafe fn store<S: Simd>(p: *mut Self, v: S::V);
    /// [`Level::store`] of four vectors, one after another from `p`.
    ///
    /// # Safety
    /// As [`Level::store`], for `4 * S::LANES` values.
    #[inline(always)]
    unsafe fn store4<S: Simd>(p: *mut Self, v: [S::V; 4]) {
        // SAFETY: the caller's.
        unsafe {
            for (i, v) in v.into_iter().enumerate() {
                Self::store::<S>(p.add(i * S::LANES), v);
            }
        }
    }
    /// What each level is less: the zero point or `qmin`.
    fn base(q: &Levels) -> f32;
}

impl Level for i16 {
    #[inline(always)]
    unsafe fn store<S: Simd>(p: *mut i16, v: S::V) {
        // SAFETY: the caller's.
        unsafe { S::store_i16(p, v) }
    }
    fn base(q: &Levels) -> f32 {
        q.zero_point
    }
}

impl Level for u8 {
    #[inline(always)]
    unsafe fn store<S: Simd>(p: *mut u8, v: S::V) {
        // SAFETY: the caller's.
        unsafe { S::store_u8(p, v) }
    }
    #[inline(always)]
    unsafe fn store4<S: Simd>(p: *mut u8, v: [S::V; 4]) {
        // SAFETY: the caller's.
        unsafe { S::store_u8x4(p, v) }
    }
    fn base(q: &Levels) -> f32 {
        q.qmin
    }
}

/// A quantizer of the int8 GEMM's rows: `x`'s rows of `k` floats, `ld` apart (`[k, ld]`), as
/// rows of words, the kernel table's `quantize_pairs` and `quantize_quads` ([`quantize`]).
pub(super) type Quantize = unsafe fn(&[f32], [usize; 2], &Levels, &mut [u32]);

/// Each of `x`'s rows of `k` floats (rows `ld` apart, as many as `out` holds) quantized as
/// torch's `quantize_per_tensor` computes it (`clamp(round(x * (1.0 / scale)) + zero_point,
/// qmin, qmax)`, in float32), less [`Level::base`], into `out`'s rows of `ceil(k / per word)`
/// words (`L`s in order, little-endian; zero past `k`). A NaN, which torch's cast to 8 bits
/// leaves undefined, is quantized to `qmin`.
///
/// # Safety
/// `S`'s features must be enabled; `k > 0`; `out` holds whole rows of words and `x` as many
/// rows of `k` floats `ld` apart; the levels less the base fit `L`.
#[inline(always)]
pub(super) unsafe fn quantize<S: Simd, L: Level>(x: &[f32], [k, ld]: [usize; 2], q: &Levels, out: &mut [u32]) {
    let width = k.div_ceil(4 / size_of::<L>()) * (4 / size_of::<L>());
    // SAFETY: the same memory as `width` `L`s per row, which `u32`'s alignment covers.
    let out = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<L>(), out.len() * 4 / size_of::<L>()) };
    let rows = out.len() / width;
    debug_assert!(rows == 0 || (rows - 1) * ld + k <= x.len());
    // Dense rows of whole words are one run of levels: no row's tail (24-channel pixels).
    let (rows, k, ld, width) = match ld == k && width == k {
        true => (rows.min(1), rows * k, rows * k, rows * k),
        false => (rows, k, ld, width),
    };
    // SAFETY (all below): row `r`'s `k` floats and `width` levels exist (the caller's); a
    // partial vector's lanes past `k` are not read.
    unsafe {
        let (inv, zp, lo, hi) = (S::splat(q.inv), S::splat(q.zero_point), S::splat(q.qmin), S::splat(q.qmax));
        let at = [inv, zp, lo, hi, S::splat(L::base(q))];
        // Whole vectors unmasked, four at a time, then two, then one: a mask per vector cost
        // a third of the loop.
        let full = k / S::LANES * S::LANES;
        for r in 0..rows {
            let (row, dst) = (x.as_ptr().add(r * ld), out.as_mut_ptr().add(r * width));
            let mut c = 0;
            while c + 4 * S::LANES <= full {
                let v = [S::load(row.add(c)), S::load(row.add(c + S::LANES))];
                let w = [S::load(row.add(c + 2 * S::LANES)), S::load(row.add(c + 3 * S::LANES))];
                let (v0, v1) = (level::<S>(v[0], at), level::<S>(v[1], at));
                let (v2, v3) = (level::<S>(w[0], at), level::<S>(w[1], at));
                L::store4::<S>(dst.add(c), [v0, v1, v2, v3]);
                c += 4 * S::LANES;
            }
            while c + 2 * S::LANES <= full {
                let (v0, v1) = (S::load(row.add(c)), S::load(row.add(c + S::LANES)));
                L::store::<S>(dst.add(c), level::<S>(v0, at));
                L::store::<S>(dst.add(c + S::LANES), level::<S>(v1, at));
                c += 2 * S::LANES;
            }
            if c < full {
                L::store::<S>(dst.add(c), level::<S>(S::load(row.add(c)), at));
                c += S::LANES;
            }
            // The last partial vector, its lanes past `k` zero: stored whole where it ends
            // inside `out` (the rows after this one, which it reaches into, are written after
            // it), through a buffer at the end. Copying every row's tail (a call to `memcpy`,
            // then one to `memset` for the word's padding) took a fifth of a 24-channel 1×1
            // convolution's time.
            if c < k {
                let lanes = S::first(k - c);
                let v = S::select(lanes, level::<S>(S::load_masked(lanes, row.add(c)), at), S::zero());
                if r * width + c + S::LANES <= out.len() {
                    L::store::<S>(dst.add(c), v);
                } else {
                    let mut tail = [L::default(); 16];
                    L::store::<S>(tail.as_mut_ptr(), v);
                    std::ptr::copy_nonoverlapping(tail.as_ptr(), dst.add(c), width - c);
                }
            }
        }
    }
}

/// One vector's levels less the base (`[1 / scale, zero_point, qmin, qmax, base]`, splat):
/// `max` gives its second operand for a NaN, `qmin`.
///
/// # Safety
/// `S`'s features must be enabled.
#[inline(always)]
unsafe fn level<S: Simd>(v: S::V, [inv, zp, lo, hi, base]: [S::V; 5]) -> S::V {
    // SAFETY: the caller's.
    unsafe { S::sub(S::min(S::max(S::add(S::round(S::mul(v, inv)), zp), lo), hi), base) }
}

/// Elements per block of [`fake_quantize_f32`] (whole vectors of every family), and the work
/// per element it counts.
const FAKE_RUN: usize = 4096;
const FAKE_WORK: usize = 6;

/// `dequantize(quantize(x))` per tensor, as torch's two ops compute it (`passes::fake_quantize`):
/// each value's level as [`quantize`] takes it (`clamp(round(x * (1.0 / scale)) + zero_point,
/// qmin, qmax)`, in float32; a NaN to `qmin`), then `(level - zero_point) * scale`, exact
/// integers until the scale's one rounding, so the same bits as the ops. One pass over the
/// values where the ops made eight (a quantized conv net's activations between its
/// convolutions). Declines (writing nothing) where `out` is shorter than `x`, `quant` isn't
/// one the kernels take, or they don't run here.
pub fn fake_quantize_f32(x: &[f32], quant: &Quant, out: &mut [f32]) -> Ran {
    if !quant.fits() {
        return Err(Declined::Values);
    }
    let t = super::table_if(out.len() >= x.len())?;
    let requant = Requant::of(quant);
    let out = &mut out[..x.len()];
    // SAFETY: the table's functions run on this CPU; each block of `out` is as long as its
    // block of `x`.
    super::parallel::blocks(x, out, FAKE_RUN, FAKE_RUN * FAKE_WORK, &|x, out| unsafe {
        (t.fake_quantize)(x, &requant, out)
    });
    Ok(())
}

/// [`fake_quantize_f32`] on `S`'s vectors: the kernel table's `fake_quantize`.
///
/// # Safety
/// `S`'s features must be enabled; `out` is at least as long as `x`.
#[inline(always)]
pub(super) unsafe fn fake_quantize<S: Simd>(x: &[f32], q: &Requant, out: &mut [f32]) {
    // SAFETY (all below): lanes `c..` of `x` and `out` exist up to their lengths, masked past.
    unsafe {
        let mut c = 0;
        while c < x.len() {
            let lanes = S::first(x.len() - c);
            let v = S::load_masked(lanes, x.as_ptr().add(c));
            S::store_masked(out.as_mut_ptr().add(c), lanes, q.apply::<S>(v));
            c += S::LANES;
        }
    }
}

/// How an int8 weight is packed, which fixes the kernel that multiplies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Pairs of bytes, two to a 32-bit word, widened to int16 as the kernel loads them (rows
    /// of int16 pairs, `vpmaddwd`): every family's kernel.
    Pairs,
    /// Four bytes per 32-bit word, then each column's sum of weights: VNNI's kernel
    /// (AVX512-VNNI, AVX-VNNI).
    Quads,
}

impl Layout {
    /// The layout the kernels that run now pack any weight in (`super::isa`), `None` where
    /// kwexport's kernels don't run here.
    pub fn current() -> Option<Layout> {
        super::isa::kernels().map(|t| super::isa::int8_layout(t, false))
    }

    /// The layout to pack a weight of at most `peak` in magnitude in, for an input of
    /// `levels` levels past `qmin`: quads wherever a quads kernel is exact for them (see
    /// [`madd_fits`]), `None` where kwexport's kernels don't run here.
    pub fn choose(levels: i64, peak: u8) -> Option<Layout> {
        super::isa::kernels().map(|t| super::isa::int8_layout(t, madd_fits(levels, peak)))
    }

    /// Input channels per 32-bit word of a row, and per element of a panel row.
    pub(super) fn per_word(self) -> usize {
        match self {
            Layout::Pairs => 2,
            Layout::Quads => 4,
        }
    }

    /// The 32-bit words of the panels of an `[n, k]` weight whose rows are `groups` words
    /// (`ceil(k / per word)`): `ceil(n / 64)` panels of `groups` rows of 64 elements, an
    /// element a word for quads and half a word (two bytes) for pairs. The one place the
    /// int8 panels' size is computed.
    pub(super) fn panel_words(self, n: usize, groups: usize) -> usize {
        let elements = n.div_ceil(PANEL) * groups * PANEL;
        match self {
            Layout::Pairs => elements / 2,
            Layout::Quads => elements,
        }
    }

    /// The words of a packed `[n, k]` weight: [`Layout::panel_words`], then (quads) `64 *
    /// ceil(n / 64)` column sums.
    pub fn packed_len(self, [n, k]: [usize; 2]) -> usize {
        let panels = self.panel_words(n, k.div_ceil(self.per_word()));
        match self {
            Layout::Pairs => panels,
            Layout::Quads => panels + n.div_ceil(PANEL) * PANEL,
        }
    }

    /// An int8 `[n, k]` weight (at element `strides`) as the kernel's panels: per 64 output
    /// columns, for each group of input channels (2 or 4), a row of 64 elements (zero past
    /// `k` and `n`) in the kernels' strips (`gemm::Strips`), each element its group's bytes
    /// in order (first channel first in memory); then, for quads, each column's sum of
    /// weights (an int32). `packed` holds [`Layout::packed_len`]'s words.
    pub fn pack(self, w: &[i8], [n, k]: [usize; 2], strides: [usize; 2], packed: &mut [u32]) {
        let at = |o: usize, c: usize| if o < n && c < k { w[o * strides[0] + c * strides[1]] } else { 0 };
        let per = self.per_word();
        let groups = k.div_ceil(per);
        let (panels, sums) = packed.split_at_mut(self.panel_words(n, groups));
        // The panels' bytes in memory order, then as the words that hold them.
        let mut bytes = vec![0u8; panels.len() * 4];
        let strips = gemm::Strips::current(groups);
        for (p, panel) in bytes.chunks_exact_mut(groups * PANEL * per).enumerate() {
            for q in 0..groups {
                for col in 0..PANEL {
                    let element = strips.at(q, col) * per;
                    for (i, b) in panel[element..element + per].iter_mut().enumerate() {
                        *b = at(p * PANEL + col, per * q + i) as u8;
                    }
                }
            }
        }
        for (word, b) in panels.iter_mut().zip(bytes.chunks_exact(4)) {
            *word = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
        if self == Layout::Quads {
            for (o, sum) in sums.iter_mut().take(n.div_ceil(PANEL) * PANEL).enumerate() {
                *sum = (0..k).map(|c| at(o, c) as i32).sum::<i32>() as u32;
            }
        }
    }
}

/// An int8 weight as [`Layout::pack`] packed it, and its greatest magnitude ([`peak`]).
#[derive(Debug, Clone, Copy)]
pub struct Packed<'a> {
    pub words: &'a [u32],
    pub layout: Layout,
    pub peak: u8,
}

/// `out[m, n] = epilogue(bias[n] + dequantize(quantize(x)) @ (w * w_scale[n]).T)`, `x` being
/// `m` rows of `k` floats quantized by `quant` and `weight` the int8 `[n, k]` weight packed by
/// [`Layout::pack`] (zero point 0); then, with an `output` quantization, each result
/// quantized and dequantized by it as it is stored ([`fake_quantize_f32`]'s bits, with no
/// pass over the output of its own). Declines (writing nothing) where the slices don't fit
/// the shapes, `quant` or `output` isn't one the kernel takes ([`Quant::fits`]; for quads
/// also a range of at most 256 levels for `quant`), or the weight's layout isn't the one the
/// kernels that run here read.
#[allow(clippy::too_many_arguments)]
pub fn linear(
    (x, ld): (&[f32], usize),
    [m, k, n]: [usize; 3],
    quant: &Quant,
    weight: Packed<'_>,
    w_scale: &[f32],
    bias: Option<&[f32]>,
    (epilogue, output): (Epilogue, Option<&Quant>),
    out: &mut [f32],
) -> Ran {
    let fits = gemm::rows_fit(x.len(), [m, k], ld)
        && weight.words.len() >= weight.layout.packed_len([n, k])
        && w_scale.len() >= n
        && gemm::results_fit([m, n], n, bias, None, out.len());
    let kernel = super::isa::int8(super::table_if(fits)?, weight.layout).ok_or(Declined::Values)?;
    let x = &x[..if m == 0 { 0 } else { (m - 1) * ld + k }];
    linear_on(kernel, (x, ld), [m, k, n], quant, weight, w_scale, bias, (epilogue, output), out)
}

/// [`linear`] on `kernel`, the slices checked; declines the values and layouts `linear`
/// does.
#[allow(clippy::too_many_arguments)]
fn linear_on(
    kernel: super::isa::Int8,
    (x, ld): (&[f32], usize),
    [m, k, n]: [usize; 3],
    quant: &Quant,
    weight: Packed<'_>,
    w_scale: &[f32],
    bias: Option<&[f32]>,
    (epilogue, output): (Epilogue, Option<&Quant>),
    out: &mut [f32],
) -> Ran {
    let layout = kernel.layout;
    Products { kernel, quant, weight, w_scale, bias, residual: None, post: (epilogue, output) }.check(k)?;
    let words = k.div_ceil(layout.per_word());
    let products = Products { kernel, quant, weight, w_scale, bias, residual: None, post: (epilogue, output) };
    let fill = |first: usize, band: &mut [u32]| quantize_band(kernel, x, k, quant, RowsAt::Strided(ld), first, band);
    // SAFETY: `fill` writes every word of a band's rows of `x` (whose `m` rows the slice
    // holds, checked); the weight holds its panels for `[n, k]`, `w_scale` and the bias `n`
    // values, `out` `m * n` (the caller's).
    unsafe { products.run_filled(&fill, [m, words, n], out) };
    Ok(())
}

/// The work per value a quantization counts (as the fake quantization's).
pub(super) const QUANTIZE_WORK: usize = 6;

/// Where row `r` of a GEMM's `m` input rows starts in its floats.
#[derive(Clone, Copy)]
pub(super) enum RowsAt<'a> {
    /// At `r * ld`.
    Strided(usize),
    /// At `at(r)` (a strided convolution's sampled pixels).
    Each(&'a (dyn Fn(usize) -> usize + Sync)),
}

thread_local! {
    /// Each calling thread's quantized rows (an int8 GEMM's, a stem's patches, AMX's padded
    /// image), kept between calls: allocating and zeroing them each call cost as much as
    /// quantizing a MobileNet's 1×1 input.
    static ROWS: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The most words [`ROWS`] keeps between calls (32 MB); a larger call's rows are freed.
const KEEP_ROWS: usize = 8 << 20;

/// `f` on the calling thread's buffer of `len` words for quantized rows (what an earlier call
/// left there, or zeros: callers write every word they read).
pub(super) fn with_rows<R>(len: usize, f: impl FnOnce(&mut [u32]) -> R) -> R {
    let mut rows = ROWS.take();
    if rows.len() < len {
        rows.resize(len, 0);
    }
    let result = f(&mut rows[..len]);
    if rows.len() <= KEEP_ROWS {
        ROWS.set(rows);
    } else {
        // Freed: a band's rows with it (`with_band`).
        FILLED.set(None);
    }
    result
}

/// Quantizes `rows.len() / words` rows of `k` floats of `x` (where [`RowsAt`] says) with
/// `quant` for `kernel` into `rows`, `words = ceil(k / per word)` words a row, every word
/// written ([`quantize`]), the rows shared out over the threads.
///
/// Panics if a row lies outside `x` (the callers check their shapes first).
pub(super) fn quantize_rows(
    kernel: super::isa::Int8,
    x: &[f32],
    k: usize,
    quant: &Quant,
    at: RowsAt<'_>,
    rows: &mut [u32],
) {
    let words = k.div_ceil(kernel.layout.per_word());
    // Rows of no words (`k == 0`) have nothing to quantize.
    if words == 0 {
        return;
    }
    parallel::units(rows, words, QUANTIZE_WORK * k, &|first, chunk| {
        quantize_band(kernel, x, k, quant, at, first, chunk)
    });
}

/// [`quantize_rows`] for the rows from `first` that `band` holds, on the calling thread.
///
/// Panics if a row lies outside `x`.
pub(super) fn quantize_band(
    kernel: super::isa::Int8,
    x: &[f32],
    k: usize,
    quant: &Quant,
    at: RowsAt<'_>,
    first: usize,
    band: &mut [u32],
) {
    let (words, levels) = (k.div_ceil(kernel.layout.per_word()), quant.levels());
    if words == 0 {
        return;
    }
    let count = band.len() / words;
    if count == 0 {
        return;
    }
    match at {
        // Rows `ld` apart: one call for the band.
        RowsAt::Strided(ld) => {
            let x = &x[first * ld..][..(count - 1) * ld + k];
            // SAFETY: the kernel's quantizer runs on this CPU; `x` holds the band's `count`
            // rows of `k`, `ld` apart (the slice is checked; `count > 0`: `band` holds whole
            // rows, at least one), `band` as many rows of `words`; quads are used only for a
            // range of 256 levels at most (`Products::check`).
            unsafe { (kernel.quantize)(x, [k, ld], &levels, band) };
        }
        RowsAt::Each(at) => {
            for (r, row) in (first..).zip(band.chunks_exact_mut(words)) {
                let start = at(r);
                // SAFETY: as above, for one row of `k`.
                unsafe { (kernel.quantize)(&x[start..start + k], [k, k], &levels, row) };
            }
        }
    }
}

/// What a product of quantized rows with an int8 weight takes besides its rows: the GEMM's
/// kernel (of the weight's layout), the rows' quantization, the weight and its per-column
/// scales, the bias, and the epilogue and output quantization.
pub(super) struct Products<'a> {
    pub(super) kernel: super::isa::Int8,
    pub(super) quant: &'a Quant,
    pub(super) weight: Packed<'a>,
    pub(super) w_scale: &'a [f32],
    pub(super) bias: Option<&'a [f32]>,
    /// Added to each result before the epilogue (a convolution's residual add), laid out as
    /// the output.
    pub(super) residual: Option<&'a [f32]>,
    pub(super) post: (Epilogue, Option<&'a Quant>),
}

impl Products<'_> {
    /// Declines a quantization the kernel can't take exactly, or a weight of another layout.
    pub(super) fn check(&self, k: usize) -> Ran {
        let layout = self.kernel.layout;
        let levels = self.quant.qmax - self.quant.qmin;
        // Levels less `qmin` fit a byte for a range of 256 levels at most.
        let bytes = layout == Layout::Quads && levels > 255;
        let saturates = self.kernel.saturates && !madd_fits(levels, self.weight.peak);
        let output = self.post.1.is_some_and(|q| !q.fits());
        if !self.quant.fits() || k > MAX_K || bytes || saturates || output || layout != self.weight.layout {
            return Err(Declined::Values);
        }
        Ok(())
    }

    /// Each of `n` columns' factors: the input's scale times its own (the dequantizes'
    /// float32 product), and, for quads, the int32 its sums start from, `-(zero_point - qmin)
    /// * sum(w)` with `sum(w)` its weights' sum `weight_sum(column)` (so that the sums of `(q
    /// - qmin) * w` end as those of `(q - zero_point) * w`: within int32 for `k <= MAX_K`,
    /// `255 * 128 * k < 2^31`); no sums for pairs.
    pub(super) fn columns(&self, n: usize, weight_sum: impl Fn(usize) -> u32) -> (Vec<f32>, Vec<i32>) {
        let scale = self.w_scale[..n].iter().map(|&s| self.quant.scale as f32 * s).collect();
        let offset = (self.quant.zero_point - self.quant.qmin) as i32;
        let sums = match self.kernel.layout {
            Layout::Pairs => Vec::new(),
            Layout::Quads => (0..n).map(|c| (weight_sum(c) as i32).wrapping_mul(-offset)).collect(),
        };
        (scale, sums)
    }

    /// The GEMM's shape for rows of `taps` runs of `words` words and `n` columns whose
    /// results are `ldo` apart, with the column factors of [`Products::columns`].
    pub(super) fn shape(&self, [taps, words, n, ldo]: [usize; 4], (scale, sums): (&[f32], &[i32])) -> Shape {
        let (epilogue, output) = self.post;
        Shape {
            taps,
            cin: words,
            n,
            ldo,
            bias: self.bias.map_or(std::ptr::null(), |b| b.as_ptr()),
            scale: scale.as_ptr(),
            sums: if sums.is_empty() { std::ptr::null() } else { sums.as_ptr() },
            residual: self.residual.map_or(std::ptr::null(), |r| r.as_ptr()),
            epilogue,
            requant: output.map(Requant::of),
        }
    }

    /// `m` rows of `source` (`taps` runs of `words` words each: levels as [`quantize`] writes
    /// them) times the weight's `[n, taps * words * per word]` panels, each column's sum
    /// scaled by the input's scale and its own, plus the bias, then the epilogue and the
    /// output quantization, into `out`'s rows of `n`.
    ///
    /// # Safety
    /// [`Products::check`] passed; the source's rows hold what the shape says, the weight
    /// its panels, `w_scale` and the bias `n` values, `out` `m * n`.
    pub(super) unsafe fn run(&self, source: Source<u32>, [m, taps, words, n]: [usize; 4], out: &mut [f32]) {
        let panels_len = self.kernel.layout.panel_words(n, taps * words);
        let factors = self.columns(n, |c| self.weight.words[panels_len + c]);
        let shape = self.shape([taps, words, n, n], (&factors.0, &factors.1));
        // SAFETY: the block runs on this CPU and reads this layout; the rest is the caller's.
        unsafe { gemm::columns(self.kernel.block, source, m, &shape, &self.weight.words[..panels_len], out) };
    }

    /// [`Products::run`] on rows of one tap that `fill(first, band)` writes: each thread
    /// writes only the rows its blocks read, into its own kept rows ([`with_band`]), in the
    /// GEMM's parallel region. A separate region to quantize every row first cost a node of
    /// 20–30 µs (RegNet's int8 1×1s at two threads) a third of its time.
    ///
    /// # Safety
    /// As [`Products::run`]'s; `fill` writes every word of the `band.len() / words` rows
    /// from `first`.
    pub(super) unsafe fn run_filled(
        &self,
        fill: &(dyn Fn(usize, &mut [u32]) + Sync),
        [m, words, n]: [usize; 3],
        out: &mut [f32],
    ) {
        let panels_len = self.kernel.layout.panel_words(n, words);
        let factors = self.columns(n, |c| self.weight.words[panels_len + c]);
        let shape = self.shape([1, words, n, n], (&factors.0, &factors.1));
        let (block, panels, out) = (self.kernel.block, &self.weight.words[..panels_len], gemm::Out(out.as_mut_ptr()));
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        gemm::each_block(m, &shape, &|range, j| {
            let rows = range.len() * words;
            with_band(
                (call, range.start, rows),
                |band| fill(range.start, band),
                |band| {
                    // The band's rows as rows `0..` of a GEMM whose output (and residual) start at
                    // the band's first row.
                    let shape = shape.rows_from(range.start);
                    let source = Source::Dense(Dense { x: band.as_ptr(), ld: words });
                    // SAFETY: the band holds the range's rows, filled; the output's rows `range`
                    // exist, written by this block alone (`each_block`); the rest the caller's.
                    unsafe { block(source, 0..range.len(), &shape, panels, out.at(range.start * shape.ldo), j, words) };
                },
            );
        });
    }
}

/// Numbers each [`Products::run_filled`], so that a thread's band from an earlier one is
/// never taken for this one's.
static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Which rows the calling thread's kept rows hold: a [`Products::run_filled`]'s number, the
/// first row and the words (`None` when unknown).
type Band = (u64, usize, usize);

thread_local! {
    static FILLED: std::cell::Cell<Option<Band>> = const { std::cell::Cell::new(None) };
}

/// `f` on the calling thread's kept rows ([`with_rows`]) holding the band `key` (its length
/// the key's words): filled by `fill` unless the last band filled on this thread was this one
/// (a thread's blocks read each band for several column blocks in a row).
fn with_band(key: Band, fill: impl FnOnce(&mut [u32]), f: impl FnOnce(&[u32])) {
    with_rows(key.2, |band| {
        if FILLED.replace(None) != Some(key) {
            fill(band);
        }
        f(band);
        FILLED.set(Some(key));
    });
}

/// VNNI's byte products (`vpdpbusd`: AVX512-VNNI on 512 bits, AVX-VNNI on 256) as the GEMM
/// driver's micro-kernel.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Vnni;

/// VNNI's quad layout on a CPU without VNNI: `vpmaddubsw` (pairs of unsigned-byte by
/// signed-byte products, summed to int16 with saturation) then `vpmaddwd` by ones (the pairs
/// of those summed to int32). Exact only where no pair's sum leaves int16, which
/// [`madd_fits`] checks: an input of at most 128 levels (torch's `reduce_range`), or weights
/// of at most 64 in magnitude.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Madd;

/// A quads micro-kernel (`Vnni` or `Madd`) on AVX-512 for a grouped convolution's groups of
/// at most 8 outputs over whole pairs of words (`conv::pairs_groups`): each output's sums in
/// a pair of lanes, the even lane over the first word of each pair of a row's words and the
/// odd over the second, so that one broadcast of two words feeds all 16 lanes where a group
/// of 8 outputs filled half of them (RegNet's groups of 8 channels); the pair is added as the
/// tile finishes, the outputs then in the first 8 lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Paired<Q>(std::marker::PhantomData<Q>);

/// The byte-quad micro-kernels: rows of four unsigned bytes a word, panels of four signed
/// bytes, int32 sums from the columns' starting sums, finished as pairs' are. They differ
/// only in how a lane's four products are added to its sum.
#[cfg(target_arch = "x86_64")]
mod quads {
    use std::arch::x86_64::*;

    use super::super::gemm::{Dot, Pairs};
    use super::super::simd::{avx2::Avx2, avx512::Avx512};
    use super::{Madd, Paired, Vnni};

    macro_rules! quads {
        ($dot:ty, Avx512, |$acc:ident, $a:ident, $w:ident| $madd:expr) => {
            quads!(@ $dot, Avx512, __m512i, __m512, _mm512_setzero_si512, _mm512_castps_si512,
                _mm512_loadu_si512, _mm512_set1_epi32, |$acc, $a, $w| $madd);
        };
        ($dot:ty, Avx2, |$acc:ident, $a:ident, $w:ident| $madd:expr) => {
            quads!(@ $dot, Avx2, __m256i, __m256, _mm256_setzero_si256, _mm256_castps_si256,
                _mm256_loadu_si256, _mm256_set1_epi32, |$acc, $a, $w| $madd);
        };
        (@ $dot:ty, $simd:ty, $vi:ty, $vf:ty, $zero:ident, $cast:ident, $load:ident, $set1:ident,
         |$acc:ident, $a:ident, $w:ident| $madd:expr) => {
            // SAFETY: each method is one of its family's instructions, or (`madd`) of the
            // extension `super::super::isa` compiles this micro-kernel's block with, only
            // where the CPU has it.
            unsafe impl Dot<$simd> for $dot {
                type X = u32;
                type P = u32;
                type Acc = $vi;
                type W = $vi;
                #[inline(always)]
                unsafe fn start(_: Option<$vf>, sums: Option<$vf>) -> $vi {
                    // SAFETY: register operations (the trait's contract); `sums` holds int32
                    // bits. A `match`, not closures: those lose the target features where
                    // they aren't inlined (`gemm::tile`).
                    unsafe {
                        match sums {
                            Some(s) => $cast(s),
                            None => $zero(),
                        }
                    }
                }
                #[inline(always)]
                unsafe fn load(p: *const u32) -> $vi {
                    // SAFETY: the trait's contract.
                    unsafe { $load(p.cast()) }
                }
                #[inline(always)]
                unsafe fn splat(x: u32) -> $vi {
                    // SAFETY: the trait's contract.
                    unsafe { $set1(x as i32) }
                }
                #[inline(always)]
                unsafe fn madd($acc: $vi, $a: $vi, $w: $vi) -> $vi {
                    // SAFETY: register arithmetic (the trait's contract): the row's four
                    // unsigned bytes times the column's four signed bytes, summed into each
                    // lane (for `Madd` exact where the caller checked no pair saturates).
                    unsafe { $madd }
                }
                #[inline(always)]
                unsafe fn finish(acc: $vi, scale: Option<$vf>, bias: Option<$vf>) -> $vf {
                    // SAFETY: the trait's contract.
                    unsafe { <Pairs as Dot<$simd>>::finish(acc, scale, bias) }
                }
            }
        };
    }

    macro_rules! paired {
        ($q:ty, |$acc:ident, $a:ident, $w:ident| $madd:expr) => {
            // SAFETY: each method is AVX-512's (and, for `madd`, the extension's that
            // `super::super::isa` compiles this micro-kernel's block with, only where the CPU
            // has it).
            unsafe impl Dot<Avx512> for Paired<$q> {
                type X = [u32; 2];
                type P = u32;
                type Acc = __m512i;
                type W = __m512i;
                #[inline(always)]
                unsafe fn start(_: Option<__m512>, sums: Option<__m512>) -> __m512i {
                    // SAFETY: register operations; `sums` holds an output's int32 sum in each
                    // of its first 8 lanes, which go to the even lane of each pair (the odd
                    // starting at 0).
                    unsafe {
                        match sums {
                            Some(s) => _mm512_cvtepu32_epi64(_mm512_castsi512_si256(_mm512_castps_si512(s))),
                            None => _mm512_setzero_si512(),
                        }
                    }
                }
                #[inline(always)]
                unsafe fn load(p: *const u32) -> __m512i {
                    // SAFETY: the trait's contract.
                    unsafe { _mm512_loadu_si512(p.cast()) }
                }
                #[inline(always)]
                unsafe fn splat(x: [u32; 2]) -> __m512i {
                    // SAFETY: a register operation.
                    unsafe { _mm512_set1_epi64((x[0] as u64 | (x[1] as u64) << 32) as i64) }
                }
                #[inline(always)]
                unsafe fn madd($acc: __m512i, $a: __m512i, $w: __m512i) -> __m512i {
                    // SAFETY: as the quads' `madd`.
                    unsafe { $madd }
                }
                #[inline(always)]
                unsafe fn finish(acc: __m512i, scale: Option<__m512>, bias: Option<__m512>) -> __m512 {
                    // SAFETY: register operations: each pair's sum in its even lane, the even
                    // lanes into the first 8, then the quads' finish.
                    unsafe {
                        let sums = _mm512_add_epi32(acc, _mm512_srli_epi64::<32>(acc));
                        let outputs = _mm512_zextsi256_si512(_mm512_cvtepi64_epi32(sums));
                        <Pairs as Dot<Avx512>>::finish(outputs, scale, bias)
                    }
                }
            }
        };
    }

    paired!(Vnni, |acc, a, w| _mm512_dpbusd_epi32(acc, a, w));
    paired!(Madd, |acc, a, w| _mm512_add_epi32(
        acc,
        _mm512_madd_epi16(_mm512_maddubs_epi16(a, w), _mm512_set1_epi16(1))
    ));
    quads!(Vnni, Avx512, |acc, a, w| _mm512_dpbusd_epi32(acc, a, w));
    quads!(Vnni, Avx2, |acc, a, w| _mm256_dpbusd_avx_epi32(acc, a, w));
    quads!(Madd, Avx512, |acc, a, w| _mm512_add_epi32(
        acc,
        _mm512_madd_epi16(_mm512_maddubs_epi16(a, w), _mm512_set1_epi16(1))
    ));
    quads!(Madd, Avx2, |acc, a, w| _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(a, w), _mm256_set1_epi16(1))
    ));
}

#[cfg(test)]
mod tests {
    use super::super::{isa, reference};
    use super::*;

    fn cases() -> impl Iterator<Item = ([usize; 3], Quant)> {
        let u8 = |scale, zero_point| Quant { scale, zero_point, qmin: 0, qmax: 255 };
        let i8 = |scale, zero_point| Quant { scale, zero_point, qmin: -128, qmax: 127 };
        [
            ([1, 1, 1], u8(0.05, 128)),
            ([4, 256, 256], u8(0.02, 131)),
            ([5, 7, 20], i8(0.03, 0)),
            ([13, 64, 130], u8(0.011, 0)),
            ([33, 129, 72], i8(0.0071, -5)),
            ([2, 300, 64], u8(0.5, 255)),
            // Enough rows and depth for AMX's tiles (`amx`), each dimension ending inside a
            // tile.
            ([200, 390, 130], u8(0.013, 77)),
            // Rows whose words fill whole tile rows, read in place, a last block of up to 16
            // rows and one of 17-31 (on one thread or the tests' three), columns ending in a
            // panel's second half.
            ([200, 512, 100], u8(0.009, 140)),
            ([250, 384, 40], i8(0.02, 3)),
        ]
        .into_iter()
    }

    /// Every int8 GEMM of every family this CPU runs: int16 pairs on each, and VNNI's quads
    /// on AVX-512 and AVX2 where the CPU has AVX512-VNNI or AVX-VNNI.
    fn variants() -> Vec<(isa::Isa, isa::Int8)> {
        let each = |i: isa::Isa| isa::int8_variants(i.table().unwrap()).into_iter().map(move |v| (i, v));
        isa::supported().into_iter().flat_map(each).collect()
    }

    /// The tests' operands for an `[m, k, n]` linear: rows of values on both sides of 0, an
    /// int8 weight over its whole range, per-column scales and a bias.
    fn operands([m, k, n]: [usize; 3]) -> (Vec<f32>, Vec<i8>, Vec<f32>, Vec<f32>) {
        let x = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect();
        let w = (0..n * k).map(|i| ((i * 53 % 256) as i32 - 128) as i8).collect();
        let w_scale = (0..n).map(|i| 0.001 + i as f32 / 7000.0).collect();
        let bias = (0..n).map(|i| i as f32 / 7.0 - 1.0).collect();
        (x, w, w_scale, bias)
    }

    /// The tests' weight as a kernel sums it exactly: halved (at most 64 in magnitude) for
    /// `vpmaddubsw`'s, whose int16 sums the whole range would saturate beside 256 levels.
    pub(super) fn fit(kernel: isa::Int8, w: Vec<i8>) -> Vec<i8> {
        if kernel.saturates {
            w.into_iter().map(|v| v / 2).collect()
        } else {
            w
        }
    }

    /// `words` packed from `w` in `layout`, as a kernel takes them.
    pub(super) fn weight<'a>(words: &'a [u32], layout: Layout, w: &[i8]) -> Packed<'a> {
        Packed { words, layout, peak: peak(w.iter().copied()) }
    }

    fn packed(w: &[i8], [n, k]: [usize; 2], layout: Layout) -> Vec<u32> {
        let mut words = vec![0u32; layout.packed_len([n, k])];
        layout.pack(w, [n, k], [k, 1], &mut words);
        words
    }

    /// Rows `ld` apart (a slice of a channels-last tensor's channels) give the bits their
    /// dense copy gives, on every family.
    #[test]
    fn strided_rows_compute_what_dense_rows_do() {
        crate::kernels::parallel::tests::install_test_pool();
        for (isa, kernel) in variants() {
            let _forced = isa::force(isa);
            let layout = kernel.layout;
            for ([m, k, n], quant) in cases() {
                let ld = k + 5;
                let strided: Vec<f32> = (0..m * ld).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect();
                let dense: Vec<f32> = strided.chunks(ld).flat_map(|r| r[..k].iter().copied()).collect();
                let w = fit(kernel, (0..n * k).map(|i| ((i * 53 % 256) as i32 - 128) as i8).collect());
                let w_scale: Vec<f32> = (0..n).map(|i| 0.001 + i as f32 / 7000.0).collect();
                let words = packed(&w, [n, k], layout);
                let weight = weight(&words, layout, &w);
                let run = |x: &[f32], ld: usize| {
                    let mut out = vec![f32::NAN; m * n];
                    let ran = linear_on(
                        kernel,
                        (x, ld),
                        [m, k, n],
                        &quant,
                        weight,
                        &w_scale,
                        None,
                        (Epilogue::None, None),
                        &mut out,
                    );
                    assert_eq!(ran, Ok(()), "{isa:?}");
                    out
                };
                let last = (m - 1) * ld + k;
                assert_eq!(run(&strided[..last], ld), run(&dense, k), "{isa:?} {m}x{k}x{n}");
            }
        }
    }

    /// Each family against the quantized graph's definition in double precision: the same
    /// quantized values (the kernel's sums are exact), float32 rounding apart.
    #[test]
    fn each_family_computes_the_quantized_linear() {
        crate::kernels::parallel::tests::install_test_pool();
        for (isa, kernel) in variants() {
            let _forced = isa::force(isa);
            let layout = kernel.layout;
            for ([m, k, n], quant) in cases() {
                let (x, w, w_scale, bias) = operands([m, k, n]);
                let w = fit(kernel, w);
                let words = packed(&w, [n, k], layout);
                let weight = weight(&words, layout, &w);
                for (epilogue, bias) in [(Epilogue::None, Some(&bias[..])), (Epilogue::Gelu, None)] {
                    let mut out = vec![f32::NAN; m * n];
                    let ran = linear_on(
                        kernel,
                        (&x, k),
                        [m, k, n],
                        &quant,
                        weight,
                        &w_scale,
                        bias,
                        (epilogue, None),
                        &mut out,
                    );
                    assert_eq!(ran, Ok(()), "{isa:?}");
                    let want = reference::linear_int8(&x, [m, k, n], &quant, &w, &w_scale, bias, epilogue);
                    for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                        let (got, want) = (*got as f64, *want);
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{isa:?} {layout:?} {m}x{k}x{n} {epilogue:?} [{i}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// An output quantization gives, on every family and for an epilogue applied as the tiles
    /// store (ReLU6) and one applied after them (GELU), the bits of the linear followed by
    /// [`fake_quantize_f32`]; one the kernel can't take declines.
    #[test]
    fn a_call_never_reads_the_rows_an_earlier_one_quantized() {
        // Calls of one shape on one thread (small enough for one) and on the tests' pool,
        // each with its own input: a thread's kept rows from the call before have the same
        // rows and length (`with_band`).
        crate::kernels::parallel::tests::install_test_pool();
        let quant = Quant { scale: 0.02, zero_point: 120, qmin: 0, qmax: 255 };
        for (isa, kernel) in variants() {
            let _forced = isa::force(isa);
            for [m, k, n] in [[3, 16, 8], [96, 64, 64]] {
                let (x, w, w_scale, _) = operands([m, k, n]);
                let w = fit(kernel, w);
                let words = packed(&w, [n, k], kernel.layout);
                let weight = weight(&words, kernel.layout, &w);
                for x in [x.clone(), x.iter().map(|v| -0.5 * v).collect()] {
                    let mut out = vec![f32::NAN; m * n];
                    let post = (Epilogue::None, None);
                    let ran = linear_on(kernel, (&x, k), [m, k, n], &quant, weight, &w_scale, None, post, &mut out);
                    assert_eq!(ran, Ok(()));
                    let want = reference::linear_int8(&x, [m, k, n], &quant, &w, &w_scale, None, Epilogue::None);
                    for (got, want) in out.iter().zip(&want) {
                        assert!((*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "{isa:?} {m}x{k}x{n}");
                    }
                }
            }
        }
    }

    #[test]
    fn an_output_quantization_gives_the_bits_of_a_fake_quantize_after() {
        let output = Quant { scale: 0.0137, zero_point: 3, qmin: 0, qmax: 255 };
        for (isa, kernel) in variants() {
            let _forced = isa::force(isa);
            let layout = kernel.layout;
            for ([m, k, n], quant) in cases() {
                let (mut x, w, w_scale, bias) = operands([m, k, n]);
                x[0] = f32::NAN;
                let w = fit(kernel, w);
                let words = packed(&w, [n, k], layout);
                let weight = weight(&words, layout, &w);
                for epilogue in [Epilogue::Relu6, Epilogue::Gelu] {
                    let run = |output: Option<&Quant>| {
                        let mut out = vec![f32::NAN; m * n];
                        let args = (epilogue, output);
                        let ran = linear_on(
                            kernel,
                            (&x, k),
                            [m, k, n],
                            &quant,
                            weight,
                            &w_scale,
                            Some(&bias),
                            args,
                            &mut out,
                        );
                        assert_eq!(ran, Ok(()), "{isa:?}");
                        out
                    };
                    let mut want = vec![0.0; m * n];
                    assert_eq!(fake_quantize_f32(&run(None), &output, &mut want), Ok(()));
                    let got = run(Some(&output));
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{isa:?} {layout:?} {m}x{k}x{n} {epilogue:?}");
                }
                let bad = Quant { scale: 0.0, ..output };
                let mut out = vec![0.0; m * n];
                let args = (Epilogue::None, Some(&bad));
                let ran = linear_on(kernel, (&x, k), [m, k, n], &quant, weight, &w_scale, None, args, &mut out);
                assert_eq!(ran, Err(Declined::Values), "{isa:?}");
            }
        }
    }

    /// The largest sums the kernels take, exact: `k = MAX_K`, every input's level at the end
    /// of its range farthest from the zero point and every weight -128 or 127 (-64 or 63 for
    /// `vpmaddubsw`'s, [`fit`]), against int64 sums.
    #[test]
    fn each_family_sums_exactly_at_the_deepest_k() {
        let k = MAX_K;
        for (isa, kernel) in variants() {
            let _forced = isa::force(isa);
            let layout = kernel.layout;
            // With scale 1, `x` quantizes to `clamp(x + zero_point, qmin, qmax)`.
            for (quant, level, w) in [
                (Quant { scale: 1.0, zero_point: 0, qmin: 0, qmax: 255 }, 255i64, -128i8),
                (Quant { scale: 1.0, zero_point: 255, qmin: 0, qmax: 255 }, 0, -128),
                (Quant { scale: 1.0, zero_point: 127, qmin: -128, qmax: 127 }, -128, 127),
            ] {
                let x = vec![(level - quant.zero_point) as f32; 2 * k];
                let w = fit(kernel, vec![w])[0];
                let words = packed(&vec![w; k], [1, k], layout);
                let mut out = [f32::NAN; 2];
                let weight = weight(&words, layout, &[w]);
                let ran = linear_on(
                    kernel,
                    (&x, k),
                    [2, k, 1],
                    &quant,
                    weight,
                    &[1.0],
                    None,
                    (Epilogue::None, None),
                    &mut out,
                );
                assert_eq!(ran, Ok(()), "{isa:?}");
                let want = (level - quant.zero_point) * w as i64 * k as i64;
                assert_eq!(out, [want as f32; 2], "{isa:?} {layout:?} {quant:?}");
            }
        }
    }

    /// Each family's two quantizers, every case at every position of rows shorter and longer
    /// than two vectors, dense or apart: torch's levels (ties to even, clamped to the range, NaN to `qmin`),
    /// less the zero point as int16 pairs, less `qmin` as bytes.
    #[test]
    fn each_family_quantizes_as_torch_does() {
        let q = Quant { scale: 0.1, zero_point: 3, qmin: 1, qmax: 255 };
        let cases = [(0.25, 5), (0.37, 7), (-1.0, 1), (1e9, 255), (f32::NEG_INFINITY, 1), (f32::NAN, 1), (0.0, 3)];
        for isa in isa::supported() {
            let table = isa.table().unwrap();
            for (layout, quantize) in [(Layout::Pairs, table.quantize_pairs), (Layout::Quads, table.quantize_quads)] {
                let (per, base) = (layout.per_word(), if layout == Layout::Pairs { q.zero_point } else { q.qmin });
                // The levels of a word, in order.
                let levels = |w: u32| -> Vec<i64> {
                    match layout {
                        Layout::Pairs => vec![w as u16 as i16 as i64, (w >> 16) as u16 as i16 as i64],
                        Layout::Quads => w.to_le_bytes().map(|b| b as i64).to_vec(),
                    }
                };
                // Rows of `k` floats `ld` apart, the last vector's tail inside the output and,
                // in the last row, at its end; dense rows of whole words (one run), and rows of
                // four vectors and more.
                let shapes =
                    [(1usize, 1usize), (3, 3), (3, 8), (37, 37), (37, 40), (24, 29), (24, 24), (70, 70), (130, 133)];
                for (k, ld) in shapes {
                    let words = k.div_ceil(per);
                    for at in 0..k {
                        for (x, level) in cases {
                            // Rows 0 and 2 all zeros (the zero point's level), row 1 the case at
                            // `at`, NaNs between the rows.
                            let mut rows = vec![f32::NAN; 2 * ld + k];
                            for r in 0..3 {
                                rows[r * ld..][..k].fill(0.0);
                            }
                            rows[ld + at] = x;
                            let mut out = vec![0xDEAD_BEEF_u32; 3 * words];
                            // SAFETY: the table's quantizer runs on this CPU; three rows of `k`
                            // `ld` apart into three of `words`; 255 levels.
                            unsafe { quantize(&rows, [k, ld], &q.levels(), &mut out) };
                            let got: Vec<i64> = out.iter().flat_map(|&w| levels(w)).collect();
                            // Zero past `k`.
                            let mut want = vec![0; 3 * per * words];
                            for r in 0..3 {
                                want[r * per * words..][..k].fill(q.zero_point - base);
                            }
                            want[per * words + at] = level - base;
                            assert_eq!(got, want, "{isa:?} {layout:?} k={k} at={at} x={x}");
                        }
                    }
                }
            }
        }
    }

    /// Each family's range against the scalar one, with a NaN or an infinity at every
    /// position of rows shorter and longer than two vectors.
    #[test]
    fn each_family_finds_the_range_or_a_value_it_cannot_quantize() {
        for isa in isa::supported() {
            let table = isa.table().unwrap();
            for len in [1usize, 5, 16, 37] {
                let x: Vec<f32> = (0..len).map(|i| ((i * 37 % 101) as f32 - 30.0) / 7.0).collect();
                // SAFETY: the table's kernel runs on this CPU.
                let range = |x: &[f32]| unsafe { (table.range)(x) };
                assert_eq!(range(&x), range_scalar(&x), "{isa:?} {len}");
                assert_eq!(range(&vec![2.5; len]), Some((0.0, 2.5)), "{isa:?} {len}: the range holds 0");
                for at in 0..len {
                    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                        let mut y = x.clone();
                        y[at] = bad;
                        assert_eq!(range(&y), None, "{isa:?} {len} {at} {bad}");
                    }
                }
            }
        }
    }

    /// Each family's fake quantization against the ops' definition in float32, every case at
    /// every position of runs shorter and longer than two vectors, threaded where long.
    #[test]
    fn each_family_fake_quantizes_as_the_two_ops_do() {
        let q = Quant { scale: 0.1, zero_point: 3, qmin: 1, qmax: 255 };
        let ops = |x: f32| -> f32 {
            let level = ((x * (1.0 / q.scale) as f32).round_ties_even() + 3.0).clamp(1.0, 255.0);
            let level = if x.is_nan() { 1.0 } else { level };
            (level - 3.0) * q.scale as f32
        };
        let cases = [0.25, 0.37, 0.35, -1.0, 1e9, f32::NEG_INFINITY, f32::NAN, 0.0, 12.3456];
        super::super::tests::each_isa(|| {
            for len in [1usize, 5, 16, 37, 3 * FAKE_RUN + 7] {
                for at in (0..len).step_by(len.div_ceil(40)) {
                    for x in cases {
                        let mut input: Vec<f32> = (0..len).map(|i| (i % 97) as f32 / 9.0 - 5.0).collect();
                        input[at] = x;
                        let mut out = vec![f32::NAN; len + 1];
                        assert_eq!(fake_quantize_f32(&input, &q, &mut out), Ok(()));
                        let want: Vec<u32> = input.iter().map(|&v| ops(v).to_bits()).collect();
                        let got: Vec<u32> = out[..len].iter().map(|v| v.to_bits()).collect();
                        assert_eq!(got, want, "len {len} at {at} x {x}");
                        assert!(out[len].is_nan(), "nothing past x's length");
                    }
                }
            }
        });
        let bad = Quant { scale: 0.0, ..q };
        assert_eq!(fake_quantize_f32(&[1.0], &bad, &mut [0.0]), Err(Declined::Values));
    }

    #[test]
    fn chooses_parameters_as_torch_does() {
        // The range always holds 0; the zero point is where 0 falls in it.
        let q = Quant::choose(&[-1.0, 0.5, 3.0], 0, 255, 1e-5).unwrap();
        assert_eq!((q.scale, q.zero_point), ((4.0f32 / 255.0) as f64, 64));
        let q = Quant::choose(&[2.0, 3.0], -128, 127, 1e-5).unwrap();
        assert_eq!((q.scale, q.zero_point), ((3.0f32 / 255.0) as f64, -128));
        // All zeros: the scale is eps.
        assert_eq!(Quant::choose(&[0.0; 4], 0, 255, 1e-5).unwrap().scale, 1e-5f32 as f64);
        for bad in [&[1.0, f32::NAN][..], &[f32::INFINITY], &[]] {
            assert_eq!(Quant::choose(bad, 0, 255, 1e-5), None, "{bad:?}");
        }
    }

    #[test]
    fn declines_what_it_cannot_sum_exactly() {
        let good = Quant { scale: 0.1, zero_point: 0, qmin: -128, qmax: 127 };
        // 301 levels: within 255 of the zero point (pairs take it), too many for a byte.
        let wide = Quant { qmin: -200, qmax: 100, ..good };
        for (isa, kernel) in variants() {
            let _forced = isa::force(isa);
            let run = |q: Quant, layout: Layout| {
                let words = vec![0u32; layout.packed_len([2, 2])];
                let weight = Packed { words: &words, layout, peak: 0 };
                linear_on(
                    kernel,
                    (&[0.0; 4], 2),
                    [2, 2, 2],
                    &q,
                    weight,
                    &[1.0; 2],
                    None,
                    (Epilogue::None, None),
                    &mut [0f32; 4],
                )
            };
            for bad in [
                Quant { scale: 0.0, ..good },
                Quant { scale: f64::NAN, ..good },
                Quant { qmin: -1000, ..good },
                Quant { qmin: 5, qmax: 4, ..good },
            ] {
                assert_eq!(run(bad, kernel.layout), Err(Declined::Values), "{isa:?} {bad:?}");
            }
            assert_eq!(run(good, kernel.layout), Ok(()), "{isa:?}");
            let want = if kernel.layout == Layout::Quads { Err(Declined::Values) } else { Ok(()) };
            assert_eq!(run(wide, kernel.layout), want, "{isa:?} {:?}", kernel.layout);
            // Panels of the other layout.
            let other = if kernel.layout == Layout::Quads { Layout::Pairs } else { Layout::Quads };
            assert_eq!(run(good, other), Err(Declined::Values), "{isa:?}");
        }
        if let Some(layout) = Layout::current() {
            let words = vec![0u32; layout.packed_len([2, 2])];
            let weight = Packed { words: &words, layout, peak: 0 };
            let ran = linear(
                (&[0.0; 4], 2),
                [2, 2, 2],
                &good,
                weight,
                &[1.0; 2],
                None,
                (Epilogue::None, None),
                &mut [0f32; 3],
            );
            assert_eq!(ran, Err(Declined::Shapes));
        }
    }

    /// `vpmaddubsw`'s kernel takes a weight and an input whose pair sums fit int16 (torch's
    /// `reduce_range` input of 128 levels beside the whole weight range, or a weight of at
    /// most 64 in magnitude beside 256 levels), exact against the reference; declines the
    /// others, where it would saturate.
    #[test]
    fn madd_sums_exactly_what_fits_and_declines_the_rest() {
        assert!(madd_fits(127, 128) && madd_fits(255, 64) && madd_fits(0, 128));
        assert!(!madd_fits(128, 128) && !madd_fits(255, 65) && !madd_fits(-1, 1) && !madd_fits(i64::MAX, 2));
        let [m, k, n] = [5, 70, 20];
        let (x, w, w_scale, bias) = operands([m, k, n]);
        let reduced = Quant { scale: 0.04, zero_point: 60, qmin: 0, qmax: 127 };
        let full = Quant { qmax: 255, ..reduced };
        for (isa, kernel) in variants().into_iter().filter(|(_, v)| v.saturates) {
            let _forced = isa::force(isa);
            let words = packed(&w, [n, k], kernel.layout);
            let run = |quant: &Quant| {
                let mut out = vec![f32::NAN; m * n];
                let weight = weight(&words, kernel.layout, &w);
                let post = (Epilogue::None, None);
                linear_on(kernel, (&x, k), [m, k, n], quant, weight, &w_scale, Some(&bias), post, &mut out)
                    .map(|()| out)
            };
            assert_eq!(run(&full).err(), Some(Declined::Values), "{isa:?}");
            let got = run(&reduced).unwrap();
            let want = reference::linear_int8(&x, [m, k, n], &reduced, &w, &w_scale, Some(&bias), Epilogue::None);
            for (i, (got, want)) in got.iter().zip(&want).enumerate() {
                let (got, want) = (*got as f64, *want);
                assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{isa:?} [{i}]: {got} vs {want}");
            }
        }
    }

    #[test]
    fn packed_len_is_what_the_packer_writes() {
        for layout in [Layout::Pairs, Layout::Quads] {
            for (n, k) in [(1usize, 1usize), (64, 2), (65, 3), (130, 257)] {
                let w: Vec<i8> = (0..n * k).map(|i| (i % 200) as i8).collect();
                // Every word is written: a sum of weights or a word with a nonzero weight.
                let mut words = vec![0xDEAD_BEEF_u32; layout.packed_len([n, k]) + 1];
                layout.pack(&w, [n, k], [k, 1], &mut words);
                let written = &words[..words.len() - 1];
                assert!(written.iter().all(|&p| p != 0xDEAD_BEEF), "{layout:?} {n}x{k}");
                assert_eq!(*words.last().unwrap(), 0xDEAD_BEEF, "{layout:?} {n}x{k}: wrote past the size");
            }
        }
    }

    /// Quads hold each weight as a signed byte, four channels per word, and each column's sum.
    #[test]
    fn quads_hold_bytes_and_column_sums() {
        let w: Vec<i8> = vec![1, -2, 3, -128, 127, 5, /* column 1 */ -1, 0, 0, 0, 0, 2];
        let words = packed(&w, [2, 6], Layout::Quads);
        assert_eq!(words[0], u32::from_le_bytes([1, (-2i8) as u8, 3, 0x80]));
        assert_eq!(words[1], u32::from_le_bytes([0xFF, 0, 0, 0]));
        // The second word of each column, where the kernels' strips put it.
        let second = |col| words[super::super::gemm::Strips::current(2).at(1, col)];
        assert_eq!(second(0), u32::from_le_bytes([127, 5, 0, 0]));
        assert_eq!(second(1), u32::from_le_bytes([0, 2, 0, 0]));
        assert_eq!((words[2 * PANEL] as i32, words[2 * PANEL + 1] as i32), (6, 1));
    }

    /// Pairs hold each weight as a signed byte (the kernel widens them as it loads), two
    /// channels per element and two elements per word: a byte a weight, as in the file.
    #[test]
    fn pairs_hold_a_byte_per_weight() {
        let w: Vec<i8> = vec![1, -2, 3, -128, /* column 1 */ 127, 5, -1, 0];
        let words = packed(&w, [2, 4], Layout::Pairs);
        assert_eq!(words.len() * 4, 2 * PANEL * 2, "two rows of 64 two-byte elements");
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let element = |q, col| {
            let at = super::super::gemm::Strips::current(2).at(q, col) * 2;
            [bytes[at] as i8, bytes[at + 1] as i8]
        };
        assert_eq!([element(0, 0), element(1, 0)], [[1, -2], [3, -128]]);
        assert_eq!([element(0, 1), element(1, 1)], [[127, 5], [-1, 0]]);
        assert_eq!(element(1, 2), [0, 0], "zero past n");
    }
}
