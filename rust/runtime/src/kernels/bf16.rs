//! The GEMM in bfloat16 (`precision="bf16"`): [`super::gemm_f32`]'s tiles with the weight
//! packed once as bfloat16 pairs and each activation row rounded to bfloat16 as the call
//! starts, the products summed in float32 by AVX512-BF16's `vdpbf16ps` (two products per lane
//! per instruction: twice float32 FMA's rate, and half the weight's bytes to stream). Inputs
//! and outputs stay float32, so no cast runs around the node, as oneDNN's bfloat16 linear
//! would need.

use super::{Declined, Epilogue, Ran, PANEL};

/// Whether the bfloat16 kernels run here: the AVX-512 family runs (`super::isa`: a forced
/// AVX2 or portable family runs torch's bfloat16 path instead) and the CPU has AVX512-BF16.
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
/// `cin` and `n`). `panels` holds [`pack_size`]'s pairs.
pub fn pack_panels(w: &[f32], shape: [usize; 4], strides: [usize; 4], panels: &mut [u32]) {
    let [n, cin, kh, kw] = shape;
    let pairs = cin.div_ceil(2);
    let at = |o: usize, c: usize, tap: usize| {
        if o >= n || c >= cin {
            return 0;
        }
        round(w[o * strides[0] + c * strides[1] + tap / kw * strides[2] + tap % kw * strides[3]]) as u32
    };
    for (p, panel) in panels.chunks_exact_mut(kh * kw * pairs * PANEL).take(n.div_ceil(PANEL)).enumerate() {
        for (r, row) in panel.chunks_exact_mut(PANEL).enumerate() {
            let (tap, q) = (r / pairs, r % pairs);
            for (col, v) in row.iter_mut().enumerate() {
                let o = p * PANEL + col;
                *v = at(o, 2 * q, tap) | (at(o, 2 * q + 1, tap) << 16);
            }
        }
    }
}

/// `out[m, n] = epilogue(bias[n] + x[m, k] @ w[k, n] + residual[m, n])` with `x` and `w`
/// rounded to bfloat16 and the sums in float32; `panels` from [`pack_panels`] of the `[n, k,
/// 1, 1]` weight. Declines (writing nothing) where the slices don't fit the shapes or
/// this CPU lacks AVX512-BF16.
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
        && super::gemm::results_fit(m, n, bias, residual, out.len());
    #[cfg(target_arch = "x86_64")]
    if fits && available() {
        // SAFETY: AVX-512F and AVX512-BF16 are present, and every slice holds what the shapes
        // say (checked).
        unsafe {
            let xb = avx512bf16::pairs_of_rows(x, m, k);
            let s = avx512bf16::Shape { taps: 1, pairs: k.div_ceil(2), n, bias, residual, epilogue };
            avx512bf16::columns(avx512bf16::Dense { x: xb.as_ptr(), pairs: s.pairs }, m, &s, panels, out);
        }
        return Ok(());
    }
    let _ = (x, m, k, panels, n, bias, residual, epilogue, out);
    Err(if fits { Declined::NoKernels } else { Declined::Shapes })
}

/// [`super::indirect_f32`] in bfloat16: the convolution of channels-last images (`x`:
/// `[batch, h, w, cin]`) as an indirect GEMM over each pixel's taps, with the input rounded to
/// bfloat16 once (each pixel's channels as pairs) and `panels` from [`pack_panels`] of the
/// `[cout, cin, kh, kw]` weight; `residual`, if any, added before the epilogue. Declines
/// (writing nothing) where the slices don't fit the shapes or this CPU lacks AVX512-BF16.
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
    let Some([ho, wo]) = g.output(h, w) else { return Err(Declined::Shapes) };
    let (m, pairs) = (batch * ho * wo, cin.div_ceil(2));
    let fits = x.len() >= batch * h * w * cin
        && panels.len() >= pack_size([n, cin, g.kernel[0], g.kernel[1]]).iter().product()
        && super::gemm::results_fit(m, n, bias, residual, out.len());
    #[cfg(target_arch = "x86_64")]
    if fits && available() {
        // SAFETY: AVX-512F and AVX512-BF16 are present; the slices hold what the shapes say
        // (checked), and every pointer of the table starts `pairs` readable pairs (of `xb`, or
        // of `zeros`, alive until the end of this block).
        unsafe {
            let xb = avx512bf16::pairs_of_rows(x, batch * h * w, cin);
            let zeros = vec![0u32; pairs];
            let table = super::gemm::tap_table(m, [h, w], [ho, wo], g, |pixel| match pixel {
                Some(p) => xb.as_ptr().add(p * pairs),
                None => zeros.as_ptr(),
            });
            let s = avx512bf16::Shape { taps, pairs, n, bias, residual, epilogue };
            avx512bf16::columns(avx512bf16::Table { table: table.as_ptr(), taps }, m, &s, panels, out);
        }
        return Ok(());
    }
    let _ = (x, batch, h, w, panels, g, bias, residual, epilogue, out, m, pairs);
    Err(if fits { Declined::NoKernels } else { Declined::Shapes })
}

#[cfg(target_arch = "x86_64")]
mod avx512bf16 {
    use std::arch::x86_64::*;

    use super::super::activation::{apply as apply_any_isa, epilogue_slice};
    use super::super::simd::avx512::Avx512;
    use super::{Epilogue, PANEL};

    /// A mask of the first `left` of 16 lanes (all of them from 16 on).
    #[inline(always)]
    fn lanes(left: usize) -> u16 {
        ((1u32 << left.min(16)) - 1) as u16
    }

    /// The float32 epilogue on 16 lanes (the caller enabled AVX-512F).
    #[inline(always)]
    unsafe fn apply(epilogue: Epilogue, x: __m512) -> __m512 {
        // SAFETY: register arithmetic; the caller enabled AVX-512F.
        unsafe { apply_any_isa::<Avx512>(epilogue, x) }
    }

    /// The float32 epilogue over a slice, GELU included (the caller enabled AVX-512F).
    #[inline(always)]
    unsafe fn apply_slice(epilogue: Epilogue, x: &mut [f32]) {
        // SAFETY: as the caller guarantees.
        unsafe { epilogue_slice::<Avx512>(epilogue, x) }
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

    /// Where a GEMM's rows are: the first pair of row `r`'s tap `t`.
    pub trait Rows: Copy {
        /// # Safety
        /// Row `r` and tap `t` must exist.
        unsafe fn at(self, r: usize, t: usize) -> *const u32;
    }

    /// The rows of a dense matrix of pairs: one tap each.
    #[derive(Clone, Copy)]
    pub struct Dense {
        pub x: *const u32,
        pub pairs: usize,
    }

    impl Rows for Dense {
        #[inline(always)]
        unsafe fn at(self, r: usize, _: usize) -> *const u32 {
            // SAFETY: row `r` exists (the caller's).
            unsafe { self.x.add(r * self.pairs) }
        }
    }

    /// Rows read through a table of pointers, `taps` per row (`super::indirect`).
    #[derive(Clone, Copy)]
    pub struct Table {
        pub table: *const *const u32,
        pub taps: usize,
    }

    impl Rows for Table {
        #[inline(always)]
        unsafe fn at(self, r: usize, t: usize) -> *const u32 {
            // SAFETY: entry `(r, t)` exists (the caller's).
            unsafe { *self.table.add(r * self.taps + t) }
        }
    }

    /// A GEMM's shape besides its rows: taps per row and pairs per tap, the output's width,
    /// the bias, the residual (`m * n`, laid out as the output) and the epilogue.
    pub struct Shape<'a> {
        pub taps: usize,
        pub pairs: usize,
        pub n: usize,
        pub bias: Option<&'a [f32]>,
        pub residual: Option<&'a [f32]>,
        pub epilogue: Epilogue,
    }

    /// Every row times each column block of the panels, outermost (a block's panel stays in
    /// cache while every row reads it), into `out` (`m` rows of `n`).
    ///
    /// # Safety
    /// AVX-512F and AVX512-BF16 must be present; `rows_of` must have `m` rows of `s.taps`
    /// taps of `s.pairs` pairs; `panels` and `out` must hold what `s` and `m` say.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn columns<R: Rows>(rows_of: R, m: usize, s: &Shape<'_>, panels: &[u32], out: &mut [f32]) {
        let (depth, op) = (s.taps * s.pairs, out.as_mut_ptr());
        let bias = s.bias.map_or(std::ptr::null(), |b| b.as_ptr());
        let residual = s.residual.map_or(std::ptr::null(), |r| r.as_ptr());
        // GELU after the block's tiles, as the float32 GEMM applies it.
        let gelu = matches!(s.epilogue, Epilogue::Gelu | Epilogue::GeluTanh);
        let epilogue = if gelu { Epilogue::None } else { s.epilogue };
        let mut j = 0;
        // SAFETY (all below): the blocks, rows and outputs exist (the caller's).
        unsafe {
            while j < s.n {
                let wp = panels.as_ptr().add(j / PANEL * depth * PANEL);
                let b = Block { taps: s.taps, pairs: s.pairs, n: s.n, j, bias, residual, epilogue };
                match (s.n - j).min(PANEL).div_ceil(16) {
                    4 => rows::<R, 6, 4>(rows_of, m, wp, op, &b),
                    3 => rows::<R, 8, 3>(rows_of, m, wp, op, &b),
                    2 => rows::<R, 12, 2>(rows_of, m, wp, op, &b),
                    _ => rows::<R, 12, 1>(rows_of, m, wp, op, &b),
                }
                if gelu {
                    for r in 0..m {
                        apply_slice(
                            s.epilogue,
                            std::slice::from_raw_parts_mut(op.add(r * s.n + j), (s.n - j).min(PANEL)),
                        );
                    }
                }
                j += PANEL;
            }
        }
    }

    /// A column block: taps and pairs per tap, the output's width, the block's first column,
    /// the bias and the residual (or null) and the epilogue.
    struct Block {
        taps: usize,
        pairs: usize,
        n: usize,
        j: usize,
        bias: *const f32,
        residual: *const f32,
        epilogue: Epilogue,
    }

    /// Every row times the block: tiles of `T` rows, then the rest in tiles of 4, 2 and 1.
    #[inline(always)]
    unsafe fn rows<R: Rows, const T: usize, const V: usize>(
        rows_of: R,
        m: usize,
        wp: *const u32,
        op: *mut f32,
        b: &Block,
    ) {
        let mut i = 0;
        // SAFETY (all below): rows [i, i + tile) and their outputs exist (the caller's).
        unsafe {
            while i + T <= m {
                tile::<R, T, V>(rows_of, i, wp, op, b);
                i += T;
            }
            while i + 4 <= m {
                tile::<R, 4, V>(rows_of, i, wp, op, b);
                i += 4;
            }
            if i + 2 <= m {
                tile::<R, 2, V>(rows_of, i, wp, op, b);
                i += 2;
            }
            if i < m {
                tile::<R, 1, V>(rows_of, i, wp, op, b);
            }
        }
    }

    /// Rows `[i, i + T)` times `V` vectors of the block's panel: `T * V` float32 sums held in
    /// registers over every tap's pairs, each weight vector (16 columns × 2 values) loaded
    /// once per pair, then the bias and the epilogue, stored masked past `n`.
    #[inline(always)]
    unsafe fn tile<R: Rows, const T: usize, const V: usize>(
        rows_of: R,
        i: usize,
        wp: *const u32,
        op: *mut f32,
        b: &Block,
    ) {
        let masks: [u16; V] = std::array::from_fn(|v| lanes(b.n.saturating_sub(b.j + v * 16)));
        // SAFETY (all below): the rows' taps, the panel's rows of 64 pairs, the bias's columns
        // and the outputs exist; masked lanes are neither read nor written.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); V]; T];
            if !b.bias.is_null() {
                for v in 0..V {
                    let bias = _mm512_maskz_loadu_ps(masks[v], b.bias.add(b.j + v * 16));
                    acc.iter_mut().for_each(|row| row[v] = bias);
                }
            }
            for t in 0..b.taps {
                let rows: [*const u32; T] = std::array::from_fn(|r| rows_of.at(i + r, t));
                let wt = wp.add(t * b.pairs * PANEL);
                for q in 0..b.pairs {
                    let w: [__m512bh; V] = std::array::from_fn(|v| {
                        std::mem::transmute(_mm512_loadu_si512(wt.add(q * PANEL + v * 16).cast()))
                    });
                    for (r, row) in acc.iter_mut().enumerate() {
                        let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(*rows[r].add(q) as i32));
                        for v in 0..V {
                            row[v] = _mm512_dpbf16_ps(row[v], a, w[v]);
                        }
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for v in 0..V {
                    let at = (i + r) * b.n + b.j + v * 16;
                    let mut y = row[v];
                    if !b.residual.is_null() {
                        y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(masks[v], b.residual.add(at)));
                    }
                    _mm512_mask_storeu_ps(op.add(at), masks[v], apply(b.epilogue, y));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
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

    fn widen(b: u16) -> f32 {
        f32::from_bits((b as u32) << 16)
    }

    /// The GEMM against the float32 GEMM of the bfloat16-rounded values (the same products,
    /// summed in another order: float32 rounding apart), at shapes that leave every kind of
    /// remainder (odd `k`, partial tiles and column blocks).
    #[test]
    fn gemm_sums_bfloat16_products() {
        if !available() {
            return;
        }
        for (m, k, n) in [(1usize, 1usize, 1usize), (5, 7, 20), (13, 64, 64), (7, 33, 130), (32, 256, 72)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 53 % 89) as f32 - 44.0) / 23.0).collect();
            let bias: Vec<f32> = (0..n).map(|i| i as f32 / 7.0 - 1.0).collect();
            let mut panels = vec![0u32; n.div_ceil(PANEL) * k.div_ceil(2) * PANEL];
            pack_panels(&w, [n, k, 1, 1], [k, 1, 0, 0], &mut panels);
            let (xr, wr): (Vec<f32>, Vec<f32>) =
                (x.iter().map(|&v| widen(round(v))).collect(), w.iter().map(|&v| widen(round(v))).collect());
            let mut f32_panels = vec![0.0; n.div_ceil(PANEL) * k * PANEL];
            super::super::pack_conv_panels(&wr, [n, k, 1, 1], [k, 1, 0, 0], &mut f32_panels);
            for epilogue in [Epilogue::None, Epilogue::Relu, Epilogue::Gelu] {
                let (mut out, mut want) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                // A residual with the ReLU: the order a ResNet block's add and ReLU take.
                let residual: Vec<f32> = (0..m * n).map(|i| ((i * 29 % 31) as f32 - 15.0) / 9.0).collect();
                let residual = (epilogue == Epilogue::Relu).then_some(residual.as_slice());
                assert_eq!(gemm(&x, m, k, &panels, n, Some(&bias), residual, epilogue, &mut out), Ok(()));
                assert_eq!(
                    super::super::gemm_f32(&xr, m, k, &f32_panels, n, Some(&bias), residual, epilogue, &mut want),
                    Ok(())
                );
                for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{m}x{k}x{n} {epilogue:?} [{i}]: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// The convolution against the float32 one on the bfloat16-rounded values, with odd
    /// channel counts (a pair straddles nothing: each tap's channels are padded), padding and
    /// stride.
    #[test]
    fn indirect_convolves_bfloat16_values() {
        if !available() {
            return;
        }
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
            let mut panels = vec![0u32; cout.div_ceil(PANEL) * kh * kw * cin.div_ceil(2) * PANEL];
            pack_panels(&wt, [cout, cin, kh, kw], strides, &mut panels);
            let (xr, wr): (Vec<f32>, Vec<f32>) =
                (x.iter().map(|&v| widen(round(v))).collect(), wt.iter().map(|&v| widen(round(v))).collect());
            let mut f32_panels = vec![0.0; cout.div_ceil(PANEL) * g.taps() * PANEL];
            super::super::pack_conv_panels(&wr, [cout, cin, kh, kw], strides, &mut f32_panels);
            let (mut out, mut want) = (vec![f32::NAN; 2 * ho * wo * cout], vec![f32::NAN; 2 * ho * wo * cout]);
            let residual: Vec<f32> = (0..2 * ho * wo * cout).map(|i| ((i * 29 % 31) as f32 - 15.0) / 9.0).collect();
            let residual = Some(residual.as_slice());
            assert_eq!(indirect(&x, [2, h, w], &panels, &g, Some(&bias), residual, Epilogue::Relu, &mut out), Ok(()));
            assert_eq!(
                super::super::indirect_f32(
                    &xr,
                    [2, h, w],
                    &f32_panels,
                    &g,
                    Some(&bias),
                    residual,
                    Epilogue::Relu,
                    &mut want
                ),
                Ok(())
            );
            for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{cin}->{cout} [{i}]: {got} vs {want}");
            }
        }
    }
}
