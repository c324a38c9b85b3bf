//! The GEMM in bfloat16 (`precision="bf16"`): the float32 GEMM's driver (`gemm`) on the
//! weight packed once as bfloat16 pairs and each activation row rounded to bfloat16 as the
//! call starts, the products summed in float32 by AVX512-BF16's `vdpbf16ps` ([`Native`]: two
//! products per lane per instruction, twice float32 FMA's rate, and half the weight's bytes to
//! stream). Inputs and outputs stay float32, so no cast runs around the node, as oneDNN's
//! bfloat16 linear would need. On other instruction sets the same kernels run each pair as two
//! FMAs (`gemm::Bf16`: correct everywhere, for tests; the plan packs bfloat16 weights only
//! where [`available`]).

use super::gemm::{self, Dense, Shape, Source, Table};
use super::{Declined, Epilogue, Ran, PANEL};

/// Whether the bfloat16 kernels run at their speed here, so that the plan packs bfloat16
/// weights: the AVX-512 family runs (`super::isa`: a forced AVX2 or portable family runs
/// torch's bfloat16 path instead) and the CPU has AVX512-BF16.
pub fn available() -> bool {
    super::isa::kernels().is_some_and(|t| t.isa == super::isa::Isa::Avx512) && super::isa::has_avx512_bf16()
}

/// `x` rounded to bfloat16's bits as torch rounds it (c10's `round_to_nearest_even`: to
/// nearest, ties to even; NaN to a quiet NaN).
pub fn round(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    let u = x.to_bits();
    (u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16) as u16
}

/// The panels [`pack_panels`] makes of a `[n, cin, kh, kw]` weight: `ceil(n / 64)` panels of
/// `[kh * kw * ceil(cin / 2), 64]` pairs. The one place the bfloat16 panels' size is computed.
pub fn pack_size([n, cin, kh, kw]: [usize; 4]) -> [usize; 3] {
    [n.div_ceil(PANEL), kh * kw * cin.div_ceil(2), PANEL]
}

/// A `[n, cin, kh, kw]` weight (at element `strides`; a matrix is `[n, k, 1, 1]`) as the
/// kernel's panels: per 64 output columns, for each tap `(i, j)` then each pair of input
/// channels `(2q, 2q + 1)`, a row of 64 pairs of bfloat16 weights (low half first; zero past
/// `cin` and `n`), in the kernels' strips (`gemm::Strips`). `panels` holds [`pack_size`]'s
/// pairs.
pub fn pack_panels(w: &[f32], shape: [usize; 4], strides: [usize; 4], panels: &mut [u32]) {
    let [n, cin, kh, kw] = shape;
    let pairs = cin.div_ceil(2);
    let at = |o: usize, c: usize, tap: usize| {
        if o >= n || c >= cin {
            return 0;
        }
        round(w[o * strides[0] + c * strides[1] + tap / kw * strides[2] + tap % kw * strides[3]]) as u32
    };
    let depth = kh * kw * pairs;
    let strips = super::gemm::Strips::current(depth);
    for (p, panel) in panels.chunks_exact_mut(depth * PANEL).take(n.div_ceil(PANEL)).enumerate() {
        for r in 0..depth {
            let (tap, q) = (r / pairs, r % pairs);
            for col in 0..PANEL {
                let o = p * PANEL + col;
                panel[strips.at(r, col)] = at(o, 2 * q, tap) | (at(o, 2 * q + 1, tap) << 16);
            }
        }
    }
}

/// `out[m, n] = epilogue(bias[n] + x[m, k] @ w[k, n] + residual[m, n])` with `x` and `w`
/// rounded to bfloat16 and the sums in float32; `panels` from [`pack_panels`] of the `[n, k,
/// 1, 1]` weight. Declines (writing nothing) where the slices don't fit the shapes or
/// kwexport's kernels don't run here.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    x: &[f32],
    m: usize,
    k: usize,
    panels: &[u32],
    n: usize,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> Ran {
    let fits = x.len() >= m * k
        && panels.len() >= pack_size([n, k, 1, 1]).iter().product()
        && gemm::results_fit([m, n], n, bias, residual, out.len());
    let t = super::table_if(fits)?;
    let (block, native) = super::isa::bf16_block(t);
    let xb = pairs_of_rows(&x[..m * k], k, native);
    let pairs = k.div_ceil(2);
    let shape = shape(1, pairs, n, bias, residual, epilogue);
    // SAFETY: the block runs on this CPU; `xb` holds `m` rows of `pairs`, and the other slices
    // what the shapes say (checked).
    unsafe { gemm::columns(block, Source::Dense(Dense { x: xb.as_ptr(), ld: pairs }), m, &shape, panels, out) };
    Ok(())
}

/// [`super::indirect_f32`] in bfloat16: the convolution of channels-last images (`x`:
/// `[batch, h, w, cin]`) as an indirect GEMM over each pixel's taps, with the input rounded to
/// bfloat16 once (each pixel's channels as pairs) and `panels` from [`pack_panels`] of the
/// `[cout, cin, kh, kw]` weight; `residual`, if any, added before the epilogue. Declines
/// (writing nothing) where the slices don't fit the shapes or kwexport's kernels don't run
/// here.
#[allow(clippy::too_many_arguments)]
pub fn indirect(
    x: &[f32],
    [batch, h, w]: [usize; 3],
    panels: &[u32],
    g: &super::Conv2d,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> Ran {
    let (cin, n, taps) = (g.in_channels, g.out_channels, g.kernel[0] * g.kernel[1]);
    let Some([ho, wo]) = g.output(h, w).filter(|_| g.groups == 1) else { return Err(Declined::Shapes) };
    let (m, pairs) = (batch * ho * wo, cin.div_ceil(2));
    let fits = x.len() >= batch * h * w * cin
        && panels.len() >= pack_size([n, cin, g.kernel[0], g.kernel[1]]).iter().product()
        && gemm::results_fit([m, n], n, bias, residual, out.len());
    let t = super::table_if(fits)?;
    let (block, native) = super::isa::bf16_block(t);
    let xb = pairs_of_rows(&x[..batch * h * w * cin], cin, native);
    let zeros = vec![0u32; pairs];
    let table = gemm::tap_table(m, [h, w], [ho, wo], g, (xb.as_ptr(), pairs, zeros.as_ptr()));
    let shape = shape(taps, pairs, n, bias, residual, epilogue);
    // SAFETY: the block runs on this CPU; every pointer of the table starts `pairs` readable
    // pairs (of `xb`, or of `zeros`, alive until the end of this function), and the other
    // slices hold what the shapes say (checked).
    unsafe {
        gemm::columns(block, Source::Table(Table { table: table.as_ptr(), taps, offset: 0 }), m, &shape, panels, out)
    };
    Ok(())
}

/// The driver's shape of a bfloat16 GEMM: `taps` runs of `pairs` pairs per row.
fn shape(
    taps: usize,
    pairs: usize,
    n: usize,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    epilogue: Epilogue,
) -> Shape {
    let at = |s: Option<&[f32]>| s.map_or(std::ptr::null(), |s| s.as_ptr());
    let (scale, sums) = (std::ptr::null(), std::ptr::null());
    Shape { taps, cin: pairs, n, ldo: n, bias: at(bias), scale, sums, residual: at(residual), epilogue, requant: None }
}

/// Rows of `k` floats as rows of `ceil(k / 2)` pairs of bfloat16 (low half first; the last
/// pair's high half zero for an odd `k`), rounded as torch rounds: 32 values per instruction
/// where the `native` kernel runs (AVX512-BF16's conversion), else [`round`] per value.
fn pairs_of_rows(x: &[f32], k: usize, native: bool) -> Vec<u32> {
    #[cfg(target_arch = "x86_64")]
    if native {
        // SAFETY: `native` is AVX512-BF16's kernel, chosen only where the CPU has it; `x`
        // holds whole rows of `k`.
        return unsafe { avx512bf16::pairs_of_rows(x, x.len() / k, k) };
    }
    let _ = native;
    let pairs = k.div_ceil(2);
    let mut xb = vec![0u32; x.len() / k * pairs];
    for (row, dst) in x.chunks_exact(k).zip(xb.chunks_exact_mut(pairs)) {
        for (two, d) in row.chunks(2).zip(dst.iter_mut()) {
            *d = round(two[0]) as u32 | (two.get(1).map_or(0, |&v| round(v)) as u32) << 16;
        }
    }
    xb
}

/// AVX512-BF16's pair products (`vdpbf16ps`) as the GEMM driver's micro-kernel.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Native;

#[cfg(target_arch = "x86_64")]
mod avx512bf16 {
    use std::arch::x86_64::*;

    use super::super::gemm::Dot;
    use super::super::simd::avx512::Avx512;
    use super::super::simd::Simd;
    use super::Native;

    // SAFETY: each method is an AVX-512F or AVX512-BF16 instruction; `super::super::isa` runs
    // this micro-kernel only in a block compiled with both enabled, where the CPU has them.
    unsafe impl Dot<Avx512> for Native {
        type X = u32;
        type P = u32;
        type Acc = __m512;
        type W = __m512i;
        #[inline(always)]
        unsafe fn start(bias: Option<__m512>, _: Option<__m512>) -> __m512 {
            // SAFETY: the trait's contract.
            bias.unwrap_or_else(|| unsafe { Avx512::zero() })
        }
        #[inline(always)]
        unsafe fn load(p: *const u32) -> __m512i {
            // SAFETY: the trait's contract.
            unsafe { Avx512::load_pairs(p) }
        }
        #[inline(always)]
        unsafe fn splat(x: u32) -> __m512i {
            // SAFETY: the trait's contract.
            unsafe { Avx512::splat_pair(x) }
        }
        #[inline(always)]
        unsafe fn madd(acc: __m512, a: __m512i, w: __m512i) -> __m512 {
            // SAFETY: register arithmetic (the trait's contract); the vectors' bits are pairs of
            // bfloat16, which is what `__m512bh` holds.
            unsafe {
                let pairs = |v: __m512i| std::mem::transmute::<__m512i, __m512bh>(v);
                _mm512_dpbf16_ps(acc, pairs(a), pairs(w))
            }
        }
        #[inline(always)]
        unsafe fn finish(acc: __m512, _: Option<__m512>, _: Option<__m512>) -> __m512 {
            acc
        }
    }

    /// A mask of the first `left` of 16 lanes (all of them from 16 on).
    #[inline(always)]
    fn lanes(left: usize) -> u16 {
        ((1u32 << left.min(16)) - 1) as u16
    }

    /// `rows` rows of `k` floats as rows of `ceil(k / 2)` pairs of bfloat16 (the last pair's
    /// high half zero for an odd `k`), rounded 32 values per instruction.
    ///
    /// # Safety
    /// AVX-512F and AVX512-BF16 must be present; `x` must hold `rows * k` floats.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn pairs_of_rows(x: &[f32], rows: usize, k: usize) -> Vec<u32> {
        let pairs = k.div_ceil(2);
        let mut xb = vec![0u32; rows * pairs];
        // SAFETY (all below): rows of `k` floats in `x` and `pairs` pairs in `xb`; past `k`,
        // addresses are formed but never used (masked lanes).
        unsafe {
            for r in 0..rows {
                let (src, dst) = (x.as_ptr().add(r * k), xb.as_mut_ptr().add(r * pairs));
                let mut c = 0;
                while c < k {
                    let lo = _mm512_maskz_loadu_ps(lanes(k - c), src.add(c));
                    let hi = _mm512_maskz_loadu_ps(lanes((k - c).saturating_sub(16)), src.wrapping_add(c + 16));
                    let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                    _mm512_mask_storeu_epi32(dst.add(c / 2).cast(), lanes((k - c).div_ceil(2)), both);
                    c += 32;
                }
            }
        }
        xb
    }
}

#[cfg(test)]
mod tests {
    use super::super::{isa, reference};
    use super::*;

    #[test]
    fn rounds_as_torch_does() {
        assert_eq!(round(1.0), 0x3F80);
        // Halfway cases go to even: 1 + 2^-8 down to 1, 1 + 3·2^-8 up to 1 + 2^-6.
        assert_eq!(round(f32::from_bits(0x3F80_8000)), 0x3F80);
        assert_eq!(round(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(round(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(round(f32::NAN), 0x7FC0);
        assert_eq!(round(f32::INFINITY), 0x7F80);
        assert_eq!(round(f32::MAX), 0x7F80); // rounds up to infinity, as torch's does
    }

    /// The values as bfloat16 rounds them, widened back.
    fn rounded(v: &[f32]) -> Vec<f32> {
        v.iter().map(|&v| f32::from_bits((round(v) as u32) << 16)).collect()
    }

    /// Each family (and AVX512-BF16's kernel where the CPU has it) against the double-precision
    /// GEMM of the bfloat16-rounded values, at shapes that leave every kind of remainder (odd
    /// `k`, partial tiles and column blocks).
    #[test]
    fn each_family_sums_bfloat16_products() {
        for isa in isa::supported() {
            // Packed in the strips of the family that reads them.
            let _forced = isa::force(isa);
            for (m, k, n) in [(1usize, 1usize, 1usize), (5, 7, 20), (13, 64, 64), (7, 33, 130), (32, 256, 72)] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
                let w: Vec<f32> = (0..n * k).map(|i| ((i * 53 % 89) as f32 - 44.0) / 23.0).collect();
                let bias: Vec<f32> = (0..n).map(|i| i as f32 / 7.0 - 1.0).collect();
                let mut panels = vec![0u32; pack_size([n, k, 1, 1]).iter().product()];
                pack_panels(&w, [n, k, 1, 1], [k, 1, 0, 0], &mut panels);
                // The reference takes the weight as `[k, n]`.
                let wr = rounded(&w);
                let wt: Vec<f32> = (0..k * n).map(|i| wr[i % n * k + i / n]).collect();
                for epilogue in [Epilogue::None, Epilogue::Relu, Epilogue::Gelu] {
                    let mut out = vec![f32::NAN; m * n];
                    // A residual with the ReLU: the order a ResNet block's add and ReLU take.
                    let residual: Vec<f32> = (0..m * n).map(|i| ((i * 29 % 31) as f32 - 15.0) / 9.0).collect();
                    let residual = (epilogue == Epilogue::Relu).then_some(residual.as_slice());
                    let ran = isa::with(isa, || gemm(&x, m, k, &panels, n, Some(&bias), residual, epilogue, &mut out));
                    assert_eq!(ran, Ok(()), "{isa:?}");
                    let want = reference::gemm(&rounded(&x), [m, k, n], &wt, Some(&bias), residual, epilogue);
                    for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                            "{isa:?} {m}x{k}x{n} {epilogue:?} [{i}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The convolution against the double-precision one on the bfloat16-rounded values, with
    /// odd channel counts (each tap's channels are padded to whole pairs), padding and stride.
    #[test]
    fn each_family_convolves_bfloat16_values() {
        for isa in isa::supported() {
            // Packed in the strips of the family that reads them.
            let _forced = isa::force(isa);
            for (cin, cout, [kh, kw], stride, padding, [h, w]) in [
                (3usize, 5usize, [3usize, 3usize], 1usize, 1usize, [5usize, 6usize]),
                (8, 70, [3, 3], 2, 1, [7, 7]),
                (33, 16, [1, 3], 1, 0, [4, 5]),
            ] {
                let g = super::super::Conv2d::new(
                    [cout as i64, cin as i64, kh as i64, kw as i64],
                    [stride as i64; 2],
                    [padding as i64; 2],
                )
                .unwrap();
                let [ho, wo] = g.output(h, w).unwrap();
                let x: Vec<f32> = (0..2 * h * w * cin).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
                let wt: Vec<f32> = (0..cout * cin * kh * kw).map(|i| ((i * 53 % 89) as f32 - 44.0) / 23.0).collect();
                let bias: Vec<f32> = (0..cout).map(|i| i as f32 / 7.0 - 1.0).collect();
                let strides = [cin * kh * kw, kh * kw, kw, 1];
                let mut panels = vec![0u32; pack_size([cout, cin, kh, kw]).iter().product()];
                pack_panels(&wt, [cout, cin, kh, kw], strides, &mut panels);
                let residual: Vec<f32> = (0..2 * ho * wo * cout).map(|i| ((i * 29 % 31) as f32 - 15.0) / 9.0).collect();
                let mut out = vec![f32::NAN; 2 * ho * wo * cout];
                let ran = isa::with(isa, || {
                    indirect(&x, [2, h, w], &panels, &g, Some(&bias), Some(&residual), Epilogue::Relu, &mut out)
                });
                assert_eq!(ran, Ok(()), "{isa:?}");
                let (xr, wr) = (rounded(&x), rounded(&wt));
                let want = reference::conv2d(&xr, [2, h, w], &wr, &g, (Some(&bias), Some(&residual)), Epilogue::Relu);
                for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()) * (g.taps() as f64).sqrt(),
                        "{isa:?} {cin}->{cout} [{i}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}
