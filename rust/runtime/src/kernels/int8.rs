//! The int8 GEMM: a linear whose input is quantized per tensor (pt2e's static or dynamic
//! activation scale) and whose weight is int8 with a scale per output channel and zero point
//! 0, what `dequantize → linear` computes in a program quantized with torch's flows
//! (`passes::linear_int8`).
//!
//! Each input row is quantized as torch's `quantize_per_tensor` does it, its zero point taken
//! out, and held as pairs of int16; the weight is packed once as pairs of int16 too. The sums
//! of products are exact in int32 (`vpmaddwd`, two products per lane per instruction, on
//! AVX2 and AVX-512), then scaled per column and biased in float32: the products of the
//! quantized graph with none of its float32 rounding along `k`, on the driver the float32
//! GEMM runs on (`gemm::Dot`). Half the bytes of a float32 weight stream per call.

use super::activation::Epilogue;
use super::gemm::{self, Dense, Shape, Source};
use super::simd::Simd;
use super::{Declined, Ran, PANEL};

/// The deepest `k` the sums stay exact for: `k * 255 * 128 < 2^31`.
pub const MAX_K: usize = 65_536;

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
        let (mut lo, mut hi) = (0f32, 0f32);
        for &v in x {
            // Every comparison with a NaN is false: a NaN reaches the check below.
            lo = if v < lo { v } else { lo };
            hi = if v > hi { v } else { hi };
            if !v.is_finite() {
                return None;
            }
        }
        if x.is_empty() || qmax <= qmin {
            return None;
        }
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

/// A [`Quant`]'s `1.0 / scale` (taken in double, as torch takes it), zero point and range as
/// the float32 operands of the quantize.
#[derive(Clone, Copy)]
pub(super) struct Levels {
    inv: f32,
    zero_point: f32,
    qmin: f32,
    qmax: f32,
}

/// Each of `x`'s rows of `k` floats quantized as torch's `quantize_per_tensor` computes it
/// (`clamp(round(x * (1.0 / scale)) + zero_point, qmin, qmax)`, in float32), less the zero
/// point, into `out`'s rows of `width` int16s (zero past `k`). A NaN, which torch's cast to
/// 8 bits leaves undefined, is quantized to `qmin`. The kernel table's `quantize`.
///
/// # Safety
/// `S`'s features must be enabled; `x` holds whole rows of `k`, `out` as many of `width`,
/// and `width >= k`.
#[inline(always)]
pub(super) unsafe fn quantize<S: Simd>(x: &[f32], k: usize, q: &Levels, width: usize, out: &mut [i16]) {
    // SAFETY (all below): row `r`'s `k` floats and `width` int16s exist (the caller's); a
    // partial vector's lanes past `k` are neither read nor, from the buffer, copied.
    unsafe {
        let (inv, zp, lo, hi) = (S::splat(q.inv), S::splat(q.zero_point), S::splat(q.qmin), S::splat(q.qmax));
        for (row, dst) in x.chunks_exact(k).zip(out.chunks_exact_mut(width)) {
            let mut c = 0;
            while c < k {
                let v = S::load_masked(S::first(k - c), row.as_ptr().add(c));
                // `max` gives its second operand for a NaN: `qmin`.
                let level = S::min(S::max(S::add(S::round(S::mul(v, inv)), zp), lo), hi);
                let level = S::sub(level, zp);
                if c + S::LANES <= k {
                    S::store_i16(dst.as_mut_ptr().add(c), level);
                } else {
                    let mut tail = [0i16; 16];
                    S::store_i16(tail.as_mut_ptr(), level);
                    dst[c..k].copy_from_slice(&tail[..k - c]);
                }
                c += S::LANES;
            }
            dst[k..].fill(0);
        }
    }
}

/// The panels [`pack_panels`] makes of an `[n, k]` weight: `ceil(n / 64)` panels of
/// `[ceil(k / 2), 64]` pairs. The one place the int8 panels' size is computed.
pub fn pack_size([n, k]: [usize; 2]) -> [usize; 3] {
    [n.div_ceil(PANEL), k.div_ceil(2), PANEL]
}

/// An int8 `[n, k]` weight (at element `strides`) as the kernel's panels: per 64 output
/// columns, for each pair of input channels `(2q, 2q + 1)`, a row of 64 pairs of int16 (low
/// half first; zero past `k` and `n`). `panels` holds [`pack_size`]'s pairs.
pub fn pack_panels(w: &[i8], [n, k]: [usize; 2], strides: [usize; 2], panels: &mut [u32]) {
    let at =
        |o: usize, c: usize| if o < n && c < k { w[o * strides[0] + c * strides[1]] as i16 as u16 as u32 } else { 0 };
    let pairs = k.div_ceil(2);
    for (p, panel) in panels.chunks_exact_mut(pairs * PANEL).take(n.div_ceil(PANEL)).enumerate() {
        for (q, row) in panel.chunks_exact_mut(PANEL).enumerate() {
            for (col, v) in row.iter_mut().enumerate() {
                let o = p * PANEL + col;
                *v = at(o, 2 * q) | (at(o, 2 * q + 1) << 16);
            }
        }
    }
}

/// `m` rows of `k` floats quantized by `quant` (less its zero point) on `table`'s kernel, as
/// rows of `ceil(k / 2)` pairs of int16 (low half first: the int16s in order, little-endian),
/// the last pair's high half zero for an odd `k`.
fn quantize_rows(table: &super::isa::Table, x: &[f32], m: usize, k: usize, quant: &Quant) -> Vec<u32> {
    let pairs = k.div_ceil(2);
    let mut rows = vec![0u32; m * pairs];
    // SAFETY: the same memory as `2 * pairs` int16s per row, which `u32`'s alignment covers.
    let levels = unsafe { std::slice::from_raw_parts_mut(rows.as_mut_ptr().cast::<i16>(), 2 * m * pairs) };
    // SAFETY: the table's kernel runs on this CPU; `x` holds `m` rows of `k`, `levels` as
    // many of `2 * pairs >= k`.
    unsafe { (table.quantize)(&x[..m * k], k, &quant.levels(), 2 * pairs, levels) };
    rows
}

/// `out[m, n] = epilogue(bias[n] + dequantize(quantize(x)) @ (w * w_scale[n]).T)`, `x` being
/// `m` rows of `k` floats quantized by `quant` and `panels` the int8 `[n, k]` weight packed by
/// [`pack_panels`] (zero point 0). Declines (writing nothing) where the slices don't fit the
/// shapes, `quant` isn't one the kernel takes ([`Quant::fits`]), or kwexport's kernels
/// don't run on this CPU.
#[allow(clippy::too_many_arguments)]
pub fn linear(
    x: &[f32],
    [m, k, n]: [usize; 3],
    quant: &Quant,
    panels: &[u32],
    w_scale: &[f32],
    bias: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> Ran {
    if !quant.fits() || k > MAX_K {
        return Err(Declined::Values);
    }
    let fits = x.len() >= m * k
        && panels.len() >= pack_size([n, k]).iter().product()
        && w_scale.len() >= n
        && gemm::results_fit(m, n, bias, None, out.len());
    let t = super::table_if(fits)?;
    let rows = quantize_rows(t, x, m, k, quant);
    // The input's scale as the dequantize applies it (a float32 operand), times each column's.
    let scale: Vec<f32> = w_scale[..n].iter().map(|&s| quant.scale as f32 * s).collect();
    let shape = Shape {
        taps: 1,
        cin: k.div_ceil(2),
        n,
        ldo: n,
        bias: bias.map_or(std::ptr::null(), |b| b.as_ptr()),
        scale: scale.as_ptr(),
        residual: std::ptr::null(),
        epilogue,
    };
    let source = Source::Dense(Dense { x: rows.as_ptr(), k: shape.cin });
    // SAFETY: the table's functions run on this CPU; `rows` holds `m` rows of `cin` pairs,
    // `panels` the weight's, `scale` and the bias `n` values, `out` `m * n` (checked).
    unsafe { gemm::columns(t.gemm_pairs, source, m, &shape, panels, out) };
    Ok(())
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
        ]
        .into_iter()
    }

    /// Each family against the quantized graph's definition in double precision: the same
    /// quantized values (the kernel's sums are exact), float32 rounding apart.
    #[test]
    fn each_family_computes_the_quantized_linear() {
        for isa in isa::supported() {
            for ([m, k, n], quant) in cases() {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect();
                let w: Vec<i8> = (0..n * k).map(|i| ((i * 53 % 256) as i32 - 128) as i8).collect();
                let w_scale: Vec<f32> = (0..n).map(|i| 0.001 + i as f32 / 7000.0).collect();
                let bias: Vec<f32> = (0..n).map(|i| i as f32 / 7.0 - 1.0).collect();
                let mut panels = vec![0u32; pack_size([n, k]).iter().product()];
                pack_panels(&w, [n, k], [k, 1], &mut panels);
                for (epilogue, bias) in [(Epilogue::None, Some(&bias[..])), (Epilogue::Gelu, None)] {
                    let mut out = vec![f32::NAN; m * n];
                    let ran =
                        isa::with(isa, || linear(&x, [m, k, n], &quant, &panels, &w_scale, bias, epilogue, &mut out));
                    assert_eq!(ran, Ok(()), "{isa:?}");
                    let want = reference::linear_int8(&x, [m, k, n], &quant, &w, &w_scale, bias, epilogue);
                    for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                        let (got, want) = (*got as f64, *want);
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{isa:?} {m}x{k}x{n} {epilogue:?} [{i}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn each_family_quantizes_as_torch_does() {
        let q = Quant { scale: 0.1, zero_point: 3, qmin: 1, qmax: 255 };
        // Ties to even, clamped to the range, NaN to `qmin`; less the zero point.
        let cases = [(0.25, 2), (0.37, 4), (-1.0, -2), (1e9, 252), (f32::NEG_INFINITY, -2), (f32::NAN, -2)];
        for isa in isa::supported() {
            let table = isa.table().unwrap();
            // Each case at every position of a row longer than two vectors, and in a short one.
            for k in [1, 3, 37] {
                for at in 0..k {
                    for (x, want) in cases {
                        let mut row = vec![0.0f32; 2 * k];
                        row[k + at] = x;
                        let rows = quantize_rows(table, &row, 2, k, &q);
                        let levels: Vec<i16> =
                            rows.iter().flat_map(|p| [*p as u16 as i16, (*p >> 16) as u16 as i16]).collect();
                        let pairs = k.div_ceil(2);
                        // 0.0 quantizes to the zero point: level 0.
                        let mut want_row = vec![0i16; 2 * pairs];
                        want_row[at] = want;
                        assert_eq!(&levels[..2 * pairs], &vec![0i16; 2 * pairs][..], "{isa:?} k={k} row 0");
                        assert_eq!(&levels[2 * pairs..], &want_row[..], "{isa:?} k={k} at={at} x={x}");
                    }
                }
            }
        }
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
        let out = &mut [0f32; 4];
        let panels = vec![0u32; pack_size([2, 2]).iter().product()];
        let run =
            |q: Quant, out: &mut [f32]| linear(&[0.0; 4], [2, 2, 2], &q, &panels, &[1.0; 2], None, Epilogue::None, out);
        let good = Quant { scale: 0.1, zero_point: 0, qmin: -128, qmax: 127 };
        for bad in [
            Quant { scale: 0.0, ..good },
            Quant { scale: f64::NAN, ..good },
            Quant { qmin: -1000, ..good },
            Quant { qmin: 5, qmax: 4, ..good },
        ] {
            assert_eq!(run(bad, out), Err(Declined::Values), "{bad:?}");
        }
        if super::super::available() {
            assert_eq!(run(good, &mut [0f32; 3]), Err(Declined::Shapes));
        }
    }

    #[test]
    fn pack_size_is_what_the_packer_writes() {
        for (n, k) in [(1usize, 1usize), (64, 2), (65, 3), (130, 257)] {
            let w: Vec<i8> = (0..n * k).map(|i| (i % 200) as i8).collect();
            let mut panels = vec![0xDEAD_BEEF_u32; pack_size([n, k]).iter().product::<usize>() + 1];
            pack_panels(&w, [n, k], [k, 1], &mut panels);
            assert!(panels[..panels.len() - 1].iter().all(|&p| p != 0xDEAD_BEEF), "{n}x{k}");
            assert_eq!(*panels.last().unwrap(), 0xDEAD_BEEF, "{n}x{k}: wrote past the size");
        }
    }
}
