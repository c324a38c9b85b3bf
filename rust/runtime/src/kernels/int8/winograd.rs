//! int8 3×3 convolutions at stride 1 by Winograd's F(2×2, 3×3) (`super::super::winograd`'s
//! transforms) on int16 pairs, for CPUs whose int8 GEMM multiplies pairs (`vpmaddwd`: AVX2
//! and AVX-512 without VNNI), where the direct kernel's 36 products per 2×2 block and channel
//! pair cost what float32's do: Winograd takes 16.
//!
//! Exact, as the direct kernel is: the input's levels less the zero point (|d| ≤ 255) are
//! transformed by `Bᵀ d B` (entries 0, ±1: |v| ≤ 1020), the weight by `(2G) g (2G)ᵀ` (integers,
//! four times `G g Gᵀ`: |u| ≤ 9 · 128), so every product and sum is an integer. The GEMM sums
//! them in int32 and the output transform `Aᵀ m A` is integer; its result is four times the
//! direct sum, which [`MAX_IN_CHANNELS`] keeps within int32, so sums between that wrap (two's
//! complement) still end exact, and it divides exactly. The sums are then the direct
//! kernel's, and so are the float32 results: scaled, biased, added to and requantized in the
//! same order.
//!
//! The transformed weight takes 16/9 of the taps at twice a byte each (3.6× the int8
//! weight's bytes): a convolution over few pixels streams it rather than computing, and runs
//! direct ([`pays`]).

use super::super::gemm::{self, Dense, Out, Source, Words};
use super::super::simd::Simd;
use super::super::winograd::{band, split, Split};
use super::super::{parallel, Conv2d, Declined, Ran, PANEL};
use super::{quantize_rows, with_rows, Layout, Quant, Requant, RowsAt};
use crate::kernels::activation::{epilogue_slice, Epilogue};

/// The most input channels for which four times the direct sum fits int32: `4 * 9 * cin *
/// 255 * 128 < 2^31`.
pub const MAX_IN_CHANNELS: usize = 1827;

/// The fewest input channels for which the transforms pay: each block's transforms cost per
/// channel what the products save only over enough channels, and a GEMM 16 words deep
/// spends much of its time starting and storing tiles. Measured on a Zen 3 (AVX2, one
/// thread, ResNet-18 at 224 pixels, each node against the direct kernel): 64 channels at
/// 56×56 1.05×, 128 at 28×28 0.77×, 256 at 14×14 0.72×.
pub const MIN_IN_CHANNELS: usize = 128;

/// The fewest output pixels per image for which it pays: below, the transformed weight's
/// stream outweighs the products saved (7×7 pixels, ResNet's last 3×3s, is not measured
/// faster and runs direct).
pub const MIN_PIXELS: usize = 64;

/// Whether a convolution is one this kernel computes: 3×3, stride 1, one group, padding up to
/// 2, at most [`MAX_IN_CHANNELS`] (no dilation is the caller's).
pub fn takes(g: &Conv2d) -> bool {
    super::super::winograd::takes(g) && g.in_channels <= MAX_IN_CHANNELS
}

/// Whether it [`takes`] a convolution and is faster there than the direct kernel on
/// `layout`: only pairs (VNNI's quads and AMX's tiles multiply four or more bytes at once),
/// with enough channels and output pixels.
pub fn pays(g: &Conv2d, layout: Layout, [h, w]: [usize; 2]) -> bool {
    let pixels = g.output(h, w).map_or(0, |[ho, wo]| ho * wo);
    layout == Layout::Pairs && takes(g) && g.in_channels >= MIN_IN_CHANNELS && pixels >= MIN_PIXELS
}

/// The words of the transformed weight of `cin` input and `n` output channels: 16 matrices
/// `U[e]` (`[cin, n]`), each `ceil(n / 64)` panels of `ceil(cin / 2)` rows of 64 int16 pairs.
pub fn packed_len([n, cin]: [usize; 2]) -> usize {
    16 * matrix_len(n, cin.div_ceil(2))
}

/// The words of one transformed matrix of `words` rows of pairs.
fn matrix_len(n: usize, words: usize) -> usize {
    n.div_ceil(PANEL) * words * PANEL
}

/// An int8 `[n, cin, 3, 3]` weight (at element `strides`) as `(2G) g (2G)ᵀ` for each channel
/// pair, its 16 matrices packed one after another into [`packed_len`] words: in each, the
/// element of input channel `c` and output `o` is the low (even `c`) or high half of row `c /
/// 2`'s word in column `o`, in the kernels' strips (`gemm::Strips`); zero past `cin` and `n`.
pub fn pack(w: &[i8], [n, cin]: [usize; 2], strides: [usize; 4], packed: &mut [u32]) {
    const G2: [[i32; 3]; 4] = [[2, 0, 0], [1, 1, 1], [1, -1, 1], [0, 0, 2]];
    let words = cin.div_ceil(2);
    let (per, strips) = (matrix_len(n, words), gemm::Strips::current(words));
    let mut halves = vec![0i16; 2 * packed_len([n, cin])];
    for o in 0..n {
        for c in 0..cin {
            let g =
                |i: usize, j: usize| i32::from(w[o * strides[0] + c * strides[1] + i * strides[2] + j * strides[3]]);
            let mut gg = [[0i32; 3]; 4];
            for (a, row) in gg.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = (0..3).map(|i| G2[a][i] * g(i, j)).sum();
                }
            }
            for (a, ga) in gg.iter().enumerate() {
                for (b, gb) in G2.iter().enumerate() {
                    // |u| <= 9 * 128: an int16.
                    let u: i32 = (0..3).map(|j| ga[j] * gb[j]).sum();
                    let word = (a * 4 + b) * per + o / PANEL * words * PANEL + strips.at(c / 2, o % PANEL);
                    halves[2 * word + c % 2] = u as i16;
                }
            }
        }
    }
    for (word, pair) in packed.iter_mut().zip(halves.chunks_exact(2)) {
        *word = u32::from(pair[0] as u16) | (u32::from(pair[1] as u16) << 16);
    }
}

/// `kernels::int8::conv` for a convolution [`takes`] accepts, on the weight [`pack`] made:
/// the same results, by Winograd's transforms. Declines where the slices don't fit the
/// shapes, the quantizations aren't ones the kernels take, or kwexport's kernels don't run
/// here.
#[allow(clippy::too_many_arguments)]
pub fn conv(
    (x, ld): (&[f32], usize),
    [batch, h, w]: [usize; 3],
    g: &Conv2d,
    quant: &Quant,
    panels: &[u32],
    w_scale: &[f32],
    (bias, residual): (Option<&[f32]>, Option<&[f32]>),
    (epilogue, output): (Epilogue, Option<&Quant>),
    out: &mut [f32],
) -> Ran {
    let (cin, n) = (g.in_channels, g.out_channels);
    let Some([ho, wo]) = g.output(h, w).filter(|_| takes(g)) else { return Err(Declined::Shapes) };
    let (pixels, m) = (batch * h * w, batch * ho * wo);
    let fits = gemm::rows_fit(x.len(), [pixels, cin], ld)
        && panels.len() >= packed_len([n, cin])
        && w_scale.len() >= n
        && gemm::results_fit([m, n], n, bias, residual, out.len());
    let t = super::super::table_if(fits)?;
    let kernel = super::super::isa::int8(t, Layout::Pairs).ok_or(Declined::Values)?;
    if !quant.fits() || output.is_some_and(|q| !q.fits()) {
        return Err(Declined::Values);
    }
    let words = cin.div_ceil(2);
    let blocks = ho.div_ceil(2) * wo.div_ceil(2);
    // The float32 kernel's split over the threads, in bands that stay in L2 (taking more where
    // the weight outweighs them, as float32's do, measured no faster: 1.01×).
    let Split { band, cols, items, threads } = split(batch, blocks, band(cin, n), [cin, n]);
    let scale: Vec<f32> = w_scale[..n].iter().map(|&s| quant.scale as f32 * s).collect();
    with_rows(pixels * words, |rows| {
        quantize_rows(kernel, x, cin, quant, RowsAt::Strided(ld), rows);
        let ops = Operands {
            rows,
            dims: [batch, h, w],
            panels,
            g,
            scale: &scale,
            add: (bias, residual),
            post: (epilogue, output.map(Requant::of)),
            band,
            cols,
            gemm: t.gemm_words,
            out: out.as_mut_ptr(),
        };
        // SAFETY: the table's functions run on this CPU; the slices hold what the shapes say
        // (checked above), and each item writes its own blocks' outputs in its own channels.
        parallel::for_each(items, threads, &|begin, end| unsafe { (t.winograd_int8)(&ops, begin..end) });
    });
    Ok(())
}

/// [`conv`]'s operands as the kernel table's entry takes them: the images' levels as
/// [`quantize_rows`] wrote them (pairs of int16, `ceil(cin / 2)` words a pixel), and the
/// output as a pointer, shared by the threads of one call (each writes its own items').
pub(in super::super) struct Operands<'a> {
    rows: &'a [u32],
    dims: [usize; 3],
    panels: &'a [u32],
    g: &'a Conv2d,
    /// Each column's input scale times its weight scale.
    scale: &'a [f32],
    add: (Option<&'a [f32]>, Option<&'a [f32]>),
    post: (Epilogue, Option<Requant>),
    band: usize,
    /// The output channels of each item, a multiple of [`PANEL`] (or all of them).
    cols: usize,
    /// The table's GEMM block on int16 pairs ([`Words`]).
    gemm: gemm::Block<u32>,
    out: *mut f32,
}

// SAFETY: the inputs are read only; the threads of one call write the outputs of disjoint
// items through `out`, which the caller keeps alive until every thread has finished.
unsafe impl Sync for Operands<'_> {}

/// [`bands`] compiled for one instruction set: the kernel table's entry.
pub(in super::super) type Run = unsafe fn(&Operands<'_>, std::ops::Range<usize>);

/// Items `range` of [`conv`] (as float32's `bands`: bands of blocks across the batch, then
/// again for each further group of [`Operands::cols`] output channels), inlined into each
/// instruction set's entry.
///
/// # Safety
/// `S`'s features must be enabled; the operands hold what the shapes say.
#[inline(always)]
pub(in super::super) unsafe fn bands<S: Simd>(ops: &Operands<'_>, range: std::ops::Range<usize>) {
    let ([_, h, w], g, band) = (ops.dims, ops.g, ops.band);
    let (cin, cout) = (g.in_channels, g.out_channels);
    let (words, lanes) = (cin.div_ceil(2), 2 * cin.div_ceil(2));
    let [ho, wo] = [h + 2 * g.padding[0] - 2, w + 2 * g.padding[1] - 2];
    let [pt, pl] = g.padding;
    let (th, tw) = (ho.div_ceil(2), wo.div_ceil(2));
    let per_image = (th * tw).div_ceil(band);
    let bands = ops.dims[0] * per_image;
    let per = matrix_len(cout, words);
    // SAFETY: the rows' words as their int16 halves (the low half first, as `quantize` wrote
    // them little-endian), which `u32`'s alignment covers.
    let levels = unsafe { std::slice::from_raw_parts(ops.rows.as_ptr().cast::<i16>(), 2 * ops.rows.len()) };
    let mut v = vec![0u32; 16 * band * words];
    let mut m = vec![0f32; 16 * band * ops.cols];
    let (mut d, mut scratch) = (vec![0i16; 16 * lanes], vec![0i16; 16 * lanes]);
    let mut y = vec![0i32; 12 * ops.cols];
    for item in range {
        let (c0, item) = (item / bands * ops.cols, item % bands);
        let n = ops.cols.min(cout - c0);
        let (b, t0) = (item / per_image, item % per_image * band);
        let image = &levels[b * h * w * lanes..(b + 1) * h * w * lanes];
        let tiles = band.min(th * tw - t0);
        {
            // SAFETY: `v`'s words as int16 halves, as above.
            let v16 = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<i16>(), 2 * v.len()) };
            for t in 0..tiles {
                let (ty, tx) = ((t0 + t) / tw, (t0 + t) % tw);
                for i in 0..4 {
                    for j in 0..4 {
                        let (iy, ix) = ((2 * ty + i).wrapping_sub(pt), (2 * tx + j).wrapping_sub(pl));
                        let dst = &mut d[(i * 4 + j) * lanes..][..lanes];
                        if iy < h && ix < w {
                            dst.copy_from_slice(&image[(iy * w + ix) * lanes..][..lanes]);
                        } else {
                            // The padding: a float32 zero's level, less the zero point.
                            dst.fill(0);
                        }
                    }
                }
                input_transform(&d, lanes, &mut scratch, v16, t, band);
            }
        }
        let shape = Words::shape(words, n);
        for e in 0..16 {
            let source = Source::Dense(Dense { x: v[e * band * words..].as_ptr(), ld: words });
            let panels = &ops.panels[e * per + c0 * words..][..matrix_len(n, words)];
            let me = Out(m[e * band * n..][..tiles * n].as_mut_ptr());
            for j in (0..n).step_by(PANEL) {
                // SAFETY: `v`'s rows `..tiles` hold `words` words each; the panels this item's
                // `n` columns' (from `c0`, a multiple of 64); `me` `tiles` rows of `n`; the
                // block is the table's, which runs on this CPU.
                unsafe { (ops.gemm)(source, 0..tiles, &shape, panels, me, j, words) };
            }
        }
        // SAFETY: the products' floats hold int32 sums' bits (`Words`).
        let sums = unsafe { std::slice::from_raw_parts(m.as_ptr().cast::<i32>(), m.len()) };
        let (bias, residual) = ops.add;
        let (epilogue, requant) = ops.post;
        let scale = &ops.scale[c0..c0 + n];
        for t in 0..tiles {
            let (ty, tx) = ((t0 + t) / tw, (t0 + t) % tw);
            output_transform(sums, n, t, band, &mut y);
            for (k, (oy, ox)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
                let (oy, ox) = (2 * ty + oy, 2 * tx + ox);
                if oy >= ho || ox >= wo {
                    continue;
                }
                let at = ((b * ho + oy) * wo + ox) * cout + c0;
                // SAFETY: this block's output pixel's channels of this item, inside the output
                // (the caller's sizes) and written by this item only.
                let o = unsafe { std::slice::from_raw_parts_mut(ops.out.add(at), n) };
                // Four times the direct sum, exactly: the direct kernel's float32 steps on it.
                for (c, (o, &s)) in o.iter_mut().zip(&y[k * n..][..n]).enumerate() {
                    *o = (s >> 2) as f32 * scale[c];
                }
                if let Some(bias) = bias {
                    o.iter_mut().zip(&bias[c0..c0 + n]).for_each(|(o, b)| *o += b);
                }
                if let Some(r) = residual {
                    o.iter_mut().zip(&r[at..at + n]).for_each(|(o, r)| *o += r);
                }
                // SAFETY: `S`'s features are enabled (the caller's).
                unsafe {
                    epilogue_slice::<S>(epilogue, o);
                    if let Some(q) = &requant {
                        q.apply_slice::<S>(o);
                    }
                }
            }
        }
    }
}

/// `Bᵀ d B` for one block's 4×4 int16 levels (`d[(i * 4 + j) * lanes + c]`), into row `t` of
/// each of the 16 matrices of `v` (`band` rows of `lanes` halves each); `rows` is scratch of
/// `16 * lanes`. Within int16: each result sums four levels of at most 255.
#[inline(always)]
fn input_transform(d: &[i16], lanes: usize, rows: &mut [i16], v: &mut [i16], t: usize, band: usize) {
    // Bᵀ = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], applied to the rows
    // (i), then to the columns (j), each channel on its own.
    let at = |i: usize, j: usize| &d[(i * 4 + j) * lanes..][..lanes];
    for j in 0..4 {
        let (d0, d1, d2, d3) = (at(0, j), at(1, j), at(2, j), at(3, j));
        let (r0, rest) = rows[j * lanes..].split_at_mut(4 * lanes);
        let (r1, rest) = rest.split_at_mut(4 * lanes);
        let (r2, r3) = rest.split_at_mut(4 * lanes);
        for c in 0..lanes {
            r0[c] = d0[c].wrapping_sub(d2[c]);
            r1[c] = d1[c].wrapping_add(d2[c]);
            r2[c] = d2[c].wrapping_sub(d1[c]);
            r3[c] = d1[c].wrapping_sub(d3[c]);
        }
    }
    for a in 0..4 {
        let r = |j: usize| &rows[(a * 4 + j) * lanes..][..lanes];
        let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
        let row = |b: usize| ((a * 4 + b) * band + t) * lanes;
        let (o0, o1, o2, o3) = (row(0), row(1), row(2), row(3));
        for c in 0..lanes {
            v[o0 + c] = r0[c].wrapping_sub(r2[c]);
            v[o1 + c] = r1[c].wrapping_add(r2[c]);
            v[o2 + c] = r2[c].wrapping_sub(r1[c]);
            v[o3 + c] = r1[c].wrapping_sub(r3[c]);
        }
    }
}

/// `Aᵀ m A` for block `t` of the 16 product matrices `m` (`band` rows of `cout` int32 sums
/// each): its four outputs (row-major over the 2×2 block) into `y[k * cout..]`, which holds
/// `12 * cout`. Wrapping: the results fit int32 (four times a direct sum), so a sum between
/// that leaves it still ends right.
#[inline(always)]
fn output_transform(m: &[i32], cout: usize, t: usize, band: usize, y: &mut [i32]) {
    // Aᵀ = [[1, 1, 1, 0], [0, 1, -1, -1]], applied to the rows, then to the columns.
    let at = |e: usize| &m[(e * band + t) * cout..][..cout];
    let (out, s) = y.split_at_mut(4 * cout);
    for j in 0..4 {
        let (m0, m1, m2, m3) = (at(j), at(4 + j), at(8 + j), at(12 + j));
        let (s0, s1) = s.split_at_mut(4 * cout);
        let (s0, s1) = (&mut s0[j * cout..][..cout], &mut s1[j * cout..][..cout]);
        for c in 0..cout {
            s0[c] = m0[c].wrapping_add(m1[c]).wrapping_add(m2[c]);
            s1[c] = m1[c].wrapping_sub(m2[c]).wrapping_sub(m3[c]);
        }
    }
    for r in 0..2 {
        let row = |j: usize| &s[(r * 4 + j) * cout..][..cout];
        let (a0, a1, a2, a3) = (row(0), row(1), row(2), row(3));
        let (y0, y1) = out[2 * r * cout..].split_at_mut(cout);
        for c in 0..cout {
            y0[c] = a0[c].wrapping_add(a1[c]).wrapping_add(a2[c]);
            y1[c] = a1[c].wrapping_sub(a2[c]).wrapping_sub(a3[c]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{conv as direct, Packed};
    use super::*;

    /// The same bits as the direct kernel, on each family and the tests' three threads:
    /// padding 0, 1 and 2, odd sizes (a block half outside the image), odd channels, a zero
    /// point, a bias, a residual, ReLU and an output quantization, and a band of fewer blocks
    /// than threads (its channels split).
    #[test]
    fn matches_the_direct_kernel_exactly() {
        super::super::super::parallel::tests::install_test_pool();
        super::super::super::tests::each_isa(|| {
            for (cin, n, padding, [h, w], batch) in [
                (32usize, 16usize, 1usize, [6usize, 7usize], 2usize),
                (33, 70, 0, [9, 5], 1),
                (40, 24, 2, [4, 4], 2),
                (64, 64, 1, [13, 13], 1),
                (48, 200, 1, [4, 4], 1),
            ] {
                let g = Conv2d::new([n as i64, cin as i64, 3, 3], [1, 1], [padding as i64; 2]).unwrap();
                let [ho, wo] = g.output(h, w).unwrap();
                let x: Vec<f32> = (0..batch * h * w * cin).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
                let wt: Vec<i8> = (0..n * cin * 9).map(|i| ((i * 53 % 255) as i32 - 127) as i8).collect();
                let w_scale: Vec<f32> = (0..n).map(|i| 0.01 + i as f32 / 1000.0).collect();
                let bias: Vec<f32> = (0..n).map(|i| i as f32 / 7.0 - 1.0).collect();
                let res: Vec<f32> = (0..batch * ho * wo * n).map(|i| ((i * 29 % 31) as f32 - 15.0) / 9.0).collect();
                let quant = Quant { scale: 0.023, zero_point: 7, qmin: 0, qmax: 255 };
                let output = Quant { scale: 0.5, zero_point: -3, qmin: -128, qmax: 127 };
                let strides = [cin * 9, 9, 3, 1];
                let shape = [n, cin, 3, 3];
                let mut words = vec![0u32; Layout::Pairs.conv_packed_len(shape, 1, false)];
                Layout::Pairs.pack_conv(&wt, shape, strides, 1, false, &mut words);
                let weight = Packed { words: &words, layout: Layout::Pairs, peak: 127 };
                let mut panels = vec![0u32; packed_len([n, cin])];
                pack(&wt, [n, cin], strides, &mut panels);
                for post in [(Epilogue::Relu, None), (Epilogue::None, Some(&output))] {
                    let adds = (Some(&bias[..]), Some(&res[..]));
                    let mut want = vec![f32::NAN; batch * ho * wo * n];
                    let dims = [batch, h, w];
                    let ran = direct((&x, cin), dims, &g, &quant, weight, &w_scale, adds, post, &mut want);
                    assert_eq!(ran, Ok(()));
                    let mut got = vec![f32::NAN; want.len()];
                    assert_eq!(conv((&x, cin), dims, &g, &quant, &panels, &w_scale, adds, post, &mut got), Ok(()));
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{cin}->{n} p{padding} {h}x{w} [{i}]: {a} vs {b}");
                    }
                }
            }
        });
    }

    /// The extremes of the ranges: levels 255 from the zero point and weights of 127 and -128,
    /// at the most channels taken, where the sums between wrap.
    #[test]
    fn extreme_levels_and_weights_stay_exact() {
        super::super::super::parallel::tests::install_test_pool();
        super::super::super::tests::each_isa(|| {
            let (cin, n, [h, w]) = (MAX_IN_CHANNELS, 8, [4, 4]);
            let g = Conv2d::new([n as i64, cin as i64, 3, 3], [1, 1], [1, 1]).unwrap();
            let x: Vec<f32> = (0..h * w * cin).map(|i| if (i / cin + i % 3) % 2 == 0 { 255.0 } else { -1.0 }).collect();
            let wt: Vec<i8> = (0..n * cin * 9).map(|i| if (i / 9 + i % 2) % 2 == 0 { 127 } else { -128 }).collect();
            let w_scale = vec![1.0f32; n];
            let quant = Quant { scale: 1.0, zero_point: 0, qmin: 0, qmax: 255 };
            let (strides, shape) = ([cin * 9, 9, 3, 1], [n, cin, 3, 3]);
            let mut words = vec![0u32; Layout::Pairs.conv_packed_len(shape, 1, false)];
            Layout::Pairs.pack_conv(&wt, shape, strides, 1, false, &mut words);
            let weight = Packed { words: &words, layout: Layout::Pairs, peak: 128 };
            let mut panels = vec![0u32; packed_len([n, cin])];
            pack(&wt, [n, cin], strides, &mut panels);
            let post = (Epilogue::None, None);
            let mut want = vec![f32::NAN; h * w * n];
            assert_eq!(
                direct((&x, cin), [1, h, w], &g, &quant, weight, &w_scale, (None, None), post, &mut want),
                Ok(())
            );
            let mut got = vec![f32::NAN; want.len()];
            assert_eq!(conv((&x, cin), [1, h, w], &g, &quant, &panels, &w_scale, (None, None), post, &mut got), Ok(()));
            assert_eq!(got, want);
        });
    }
}
