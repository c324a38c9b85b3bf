//! 3×3 convolutions at stride 1 by Winograd's F(2×2, 3×3) (Lavin and Gray, 2016): each 2×2
//! block of outputs from a 4×4 block of inputs in 16 products per channel pair where the
//! direct convolution takes 36, as 16 matrix products over the blocks (kwexport's GEMM), with
//! the input and output transforms around them. 2.25× fewer multiplications; the transforms
//! add a pass over a band of blocks that stays in cache. Its rounding differs from the direct
//! sum's by the transforms' (under 1e-6 relative here; the float32 tolerance is 1e-4).
//!
//! The weight grows by 16/9 in the transform, so a convolution over few pixels, which streams
//! its weight rather than computing, is faster direct: the caller picks by pixel count.

use super::{Conv2d, Declined, Epilogue, Ran, PANEL};

/// The transformed weight's panels: 16 matrices `U[e]` (`[cin, cout]`, `e` the position in
/// the 4×4 block), each packed as the GEMM reads it (`ceil(cout / 64)` panels of `[cin, 64]`,
/// `gemm::pack_size`). The one place their size is computed.
pub fn pack_size(cin: usize, cout: usize) -> [usize; 3] {
    let [panels, rows, width] = super::gemm::pack_size([cout, cin, 1, 1]);
    [16, panels * rows, width]
}

/// The elements of [`pack_size`].
pub fn panels_len(cin: usize, cout: usize) -> usize {
    pack_size(cin, cout).iter().product()
}

/// A `[cout, cin, 3, 3]` weight (at element `strides`) as `U = G g Gᵀ` for each channel pair,
/// packed into [`panels_len`] floats.
pub fn pack_weights(w: &[f32], [cout, cin]: [usize; 2], strides: [usize; 4], panels: &mut [f32]) {
    const G: [[f32; 3]; 4] = [[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]];
    let (per, strips) = (super::gemm::panels_len(cin, cout), super::gemm::Strips::current(cin));
    // Zero past `cout`: the GEMM reads whole panels.
    panels[..16 * per].fill(0.0);
    for o in 0..cout {
        for c in 0..cin {
            let g = |i: usize, j: usize| w[o * strides[0] + c * strides[1] + i * strides[2] + j * strides[3]];
            // G g, then (G g) Gᵀ.
            let mut gg = [[0f32; 3]; 4];
            for (a, row) in gg.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = (0..3).map(|i| G[a][i] * g(i, j)).sum();
                }
            }
            for a in 0..4 {
                for b in 0..4 {
                    let u: f32 = (0..3).map(|j| gg[a][j] * G[b][j]).sum();
                    panels[(a * 4 + b) * per + o / PANEL * cin * PANEL + strips.at(c, o % PANEL)] = u;
                }
            }
        }
    }
}

/// The fewest output pixels for which the transform pays (`cargo bench --bench runtime --
/// kernels/winograd`: 0.51–0.62× the direct kernel's time from 4×4 pixels to 56×56; at 2×2,
/// where resnet18's last 3×3s stream their weight, 1.4×).
pub const MIN_PIXELS: usize = 16;

/// The fewest input channels for which the transforms pay: each block's input transform
/// costs per channel what the products save only over enough output channels. Measured
/// (Zen 5, one thread, against the indirect GEMM): 16 → 64 channels on a 55×55 image 361
/// against 243 µs (SqueezeNet's first expansions), 24 → 64 408 against 356, 32 → 128 at 27×27
/// 200 against 218, 48 → 192 at 13×13 98 against 109.
pub const MIN_IN_CHANNELS: usize = 32;

/// Whether a convolution is one this kernel computes and [`MIN_IN_CHANNELS`] says it pays
/// for (the plan's choice; the kernel itself takes any channel count).
pub fn pays(g: &Conv2d) -> bool {
    takes(g) && g.in_channels >= MIN_IN_CHANNELS
}

/// Whether a convolution is one this kernel computes: 3×3, stride 1, one group (no dilation
/// is the caller's).
pub fn takes(g: &Conv2d) -> bool {
    g.kernel == [3, 3] && g.stride == [1, 1] && g.padding[0] <= 2 && g.padding[1] <= 2 && g.groups == 1
}

/// The convolution of channels-last images `x` (`[batch, h, w, cin]`) with the weight's
/// `panels` ([`pack_weights`]), plus the bias and `residual` (the output's shape), then
/// `epilogue`, into `out` (`[batch, ho, wo, cout]`). Returns `false` where the slices don't fit
/// the shapes, the geometry isn't one [`takes`] accepts, kwexport's kernels don't run on this
/// CPU, or an input is NaN or infinite: the transforms mix each block's 16 inputs into all
/// four of its outputs (`inf - inf` is NaN), so a NaN or an infinity would reach outputs the
/// direct sum keeps finite, and an infinity would become NaN; the caller runs another kernel
/// then. `out` may be partly written where it returns `false`.
#[allow(clippy::too_many_arguments)]
pub fn conv(
    x: &[f32],
    dims: [usize; 3],
    panels: &[f32],
    g: &Conv2d,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> Ran {
    conv_strided(x, dims, panels, g, (bias, residual), epilogue, (out, g.out_channels))
}

/// [`conv`] into output pixels `out.1` elements apart (`>= out_channels`: a convolution
/// writing its channels of a concatenation, `plan::concat`), without a residual there.
pub fn conv_strided(
    x: &[f32],
    [batch, h, w]: [usize; 3],
    panels: &[f32],
    g: &Conv2d,
    (bias, residual): (Option<&[f32]>, Option<&[f32]>),
    epilogue: Epilogue,
    (out, ldo): (&mut [f32], usize),
) -> Ran {
    let (cin, cout) = (g.in_channels, g.out_channels);
    let Some([ho, wo]) = g.output(h, w) else { return Err(Declined::Shapes) };
    let pixels = batch * ho * wo;
    let fits = takes(g)
        && x.len() >= batch * h * w * cin
        && panels.len() >= panels_len(cin, cout)
        // The residual is read densely: only with a dense output.
        && (ldo == cout || residual.is_none())
        && super::gemm::results_fit([pixels, cout], ldo, bias, residual, out.len());
    let t = super::table_if(fits)?;
    if !super::all_finite(&x[..batch * h * w * cin]) {
        return Err(Declined::Values);
    }
    let blocks = ho.div_ceil(2) * wo.div_ceil(2);
    // A band holds at least as many blocks as the weight outweighs (`band * (cin + cout) >=
    // cin * cout`, as the GEMM's rows do, `gemm::each_block`): each band streams all 16
    // transformed matrices, and ResNet-18's 512-channel 3×3s at 7×7 (16 blocks, 16.8 MB
    // transformed) ran as two bands of 8, 3.5 ms a node, where one band takes 2.4 (Zen 3, one
    // thread).
    let least = band(cin, cout).max(cin * cout / (cin + cout).max(1));
    let Split { band, cols, items, threads } = split(batch, blocks, least, [cin, cout]);
    let (add, gemm, out_ptr) = ((bias, residual), t.gemm_block, out.as_mut_ptr());
    let ops = Operands { x, dims: [batch, h, w], panels, g, add, band, cols, gemm, out: out_ptr, ldo };
    // SAFETY: the table's functions run on this CPU; the slices hold what the shapes say,
    // and each item writes its own blocks' outputs in its own channels.
    super::parallel::for_each(items, threads, &|begin, end| unsafe { (t.winograd)(&ops, begin..end) });
    // One pass over the output (in cache at these sizes): applied per pixel inside the
    // transform's loop it measured slower.
    match epilogue {
        Epilogue::None => Ok(()),
        _ if pixels == 0 => Ok(()),
        _ if ldo == cout => super::epilogue_f32(epilogue, &mut out[..pixels * cout]),
        // Per pixel: the channels between belong to the concatenation's other parts.
        _ => out[..(pixels - 1) * ldo + cout]
            .chunks_mut(ldo)
            .try_for_each(|pixel| super::epilogue_f32(epilogue, &mut pixel[..cout])),
    }
}

/// How a call's blocks share out (float32's and int8's kernels): bands of `band` blocks
/// across the batch, each item a band's `cols` output channels, `items` items on `threads`.
pub(super) struct Split {
    pub(super) band: usize,
    pub(super) cols: usize,
    pub(super) items: usize,
    pub(super) threads: usize,
}

/// The [`Split`] of `batch` images of `blocks` blocks each, `cin -> cout` channels, in bands
/// of at least `least` blocks where the threads allow.
pub(super) fn split(batch: usize, blocks: usize, least: usize, [cin, cout]: [usize; 2]) -> Split {
    let threads = super::parallel::threads();
    let mut per_image = blocks.div_ceil(least.max(1));
    // Fewer bands than threads (a 4×4 image's 4 blocks, resnet18's 256-channel 3×3s at 64×64):
    // each thread takes a share of the output channels of every band, and so streams its
    // share of the 16 transformed weights, where splitting the blocks had each thread stream
    // all of them (4 MB there: no faster on two threads than on one).
    let groups = match batch * per_image < threads {
        true => threads.min(cout / PANEL).max(1),
        false => 1,
    };
    let cols = cout.div_ceil(groups).next_multiple_of(PANEL).min(cout);
    let groups = cout.div_ceil(cols);
    // Otherwise as many bands for every thread: a 13×13 image's 49 blocks were 3 bands of 21
    // on two threads, one thread doing two (48 -> 192 channels: 1.12× faster on two threads).
    while groups == 1 && !(batch * per_image).is_multiple_of(threads) && per_image < blocks {
        per_image += 1;
    }
    let band = blocks.div_ceil(per_image);
    let bands = blocks.div_ceil(band);
    let flops = 2 * 16 * batch * bands * band * cin * cout;
    let items = groups * batch * bands;
    Split { band, cols, items, threads: super::parallel::share(flops, items, threads) }
}

/// The blocks per band for its transformed inputs and products to stay in L2 (16 matrices
/// each); [`conv`] takes more where the weight outweighs them.
pub(super) fn band(cin: usize, cout: usize) -> usize {
    (64 * 1024 / (16 * cin.max(cout))).clamp(6, 96)
}

/// [`conv`]'s operands as the kernel table's entry takes them: the output as a pointer,
/// shared by the threads of one call (each writes its own bands' outputs).
pub(super) struct Operands<'a> {
    x: &'a [f32],
    dims: [usize; 3],
    panels: &'a [f32],
    g: &'a Conv2d,
    add: (Option<&'a [f32]>, Option<&'a [f32]>),
    band: usize,
    /// The output channels of each item, a multiple of [`PANEL`] (or all of them).
    cols: usize,
    /// The GEMM of the table the call runs on, for the 16 products.
    gemm: super::gemm::Block<f32>,
    out: *mut f32,
    /// How far apart the output's pixels are.
    ldo: usize,
}

// SAFETY: the inputs are read only; the threads of one call write the outputs of disjoint
// blocks through `out`, which the caller keeps alive until every thread has finished.
unsafe impl Sync for Operands<'_> {}

/// [`bands`] compiled for one instruction set: the kernel table's entry.
pub(super) type Run = unsafe fn(&Operands<'_>, std::ops::Range<usize>);

/// Items `range` of [`conv`] before its epilogue: bands counted across the batch (image
/// `item / bands`, band `item % bands`), then again for each further group of
/// [`Operands::cols`] output channels, inlined into each instruction set's entry (the
/// transforms' loops over channels vectorize for it). Its 16 products run on the call's own table's
/// GEMM block, which takes any shape: none can be declined and leave stale products.
///
/// # Safety
/// The instruction set's features must be enabled; the operands hold what the shapes say.
#[inline(always)]
pub(super) unsafe fn bands(ops: &Operands<'_>, range: std::ops::Range<usize>) {
    let (x, [_, h, w], panels, g, (bias, residual)) = (ops.x, ops.dims, ops.panels, ops.g, ops.add);
    let (cin, cout, band) = (g.in_channels, g.out_channels, ops.band);
    let [ho, wo] = [h + 2 * g.padding[0] - 2, w + 2 * g.padding[1] - 2];
    let per = super::gemm::panels_len(cin, cout);
    let [pt, pl] = g.padding;
    let (th, tw) = (ho.div_ceil(2), wo.div_ceil(2));
    let per_image = (th * tw).div_ceil(band);
    let bands = ops.dims[0] * per_image;
    let mut v = vec![0f32; 16 * band * cin];
    let mut m = vec![0f32; 16 * band * ops.cols];
    let (mut d, mut rows) = (vec![0f32; 16 * cin], vec![0f32; 16 * cin.max(ops.cols)]);
    for item in range {
        let (c0, item) = (item / bands * ops.cols, item % bands);
        // This item's channels `[c0, c0 + n)`: their panels start at `c0`'s (a multiple of
        // the panels' width), their results at `c0` of each pixel.
        let n = ops.cols.min(cout - c0);
        let panels_of = |e: usize| &panels[e * per + c0 * cin..][..super::gemm::panels_len(cin, n)];
        let (b, t0) = (item / per_image, item % per_image * band);
        let image = &x[b * h * w * cin..(b + 1) * h * w * cin];
        {
            let tiles = band.min(th * tw - t0);
            // Vᵉ = (Bᵀ d B)ᵉ for each block's 4×4 inputs d, zeros outside the image.
            for t in 0..tiles {
                let (ty, tx) = ((t0 + t) / tw, (t0 + t) % tw);
                for i in 0..4 {
                    for j in 0..4 {
                        let (iy, ix) = ((2 * ty + i).wrapping_sub(pt), (2 * tx + j).wrapping_sub(pl));
                        let dst = &mut d[(i * 4 + j) * cin..(i * 4 + j + 1) * cin];
                        if iy < h && ix < w {
                            dst.copy_from_slice(&image[(iy * w + ix) * cin..(iy * w + ix + 1) * cin]);
                        } else {
                            dst.fill(0.0);
                        }
                    }
                }
                input_transform(&d, cin, &mut rows, &mut v, t, band);
            }
            // The 16 products, each over the band's blocks.
            for e in 0..16 {
                let (ve, me) = (&v[e * band * cin..][..tiles * cin], &mut m[e * band * n..][..tiles * n]);
                // SAFETY: `ve`, the panels and `me` hold `tiles * cin`, `n` columns' panels and
                // `tiles * n`.
                unsafe { super::gemm::product(ops.gemm, ve, tiles, cin, panels_of(e), n, me) };
            }
            // Y = Aᵀ M A, plus the bias and the residual, for the outputs inside the image.
            for t in 0..tiles {
                let (ty, tx) = ((t0 + t) / tw, (t0 + t) % tw);
                output_transform(&m, n, t, band, &mut rows);
                for (k, (oy, ox)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
                    let (oy, ox) = (2 * ty + oy, 2 * tx + ox);
                    if oy >= ho || ox >= wo {
                        continue;
                    }
                    let pixel = (b * ho + oy) * wo + ox;
                    let at = pixel * cout + c0;
                    // SAFETY: this block's output pixel's channels of this item, inside the
                    // output (the caller's sizes) and written by this item only.
                    let o = unsafe { std::slice::from_raw_parts_mut(ops.out.add(pixel * ops.ldo + c0), n) };
                    let y = &rows[k * n..(k + 1) * n];
                    let bias = bias.map(|b| &b[c0..c0 + n]);
                    match (bias, residual) {
                        (Some(bias), Some(r)) => {
                            for (((o, y), b), r) in o.iter_mut().zip(y).zip(bias).zip(&r[at..at + n]) {
                                *o = y + b + r;
                            }
                        }
                        (Some(bias), None) => o.iter_mut().zip(y).zip(bias).for_each(|((o, y), b)| *o = y + b),
                        (None, Some(r)) => o.iter_mut().zip(y).zip(&r[at..at + n]).for_each(|((o, y), r)| *o = y + r),
                        (None, None) => o.copy_from_slice(y),
                    }
                }
            }
        }
    }
}

/// `Bᵀ d B` for one block's 4×4 inputs (`d[(i * 4 + j) * cin + c]`), into row `t` of each of
/// the 16 matrices of `v` (`band` rows of `cin` each); `rows` is scratch of `16 * cin`.
#[inline(always)]
fn input_transform(d: &[f32], cin: usize, rows: &mut [f32], v: &mut [f32], t: usize, band: usize) {
    // Bᵀ = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], applied to the rows
    // (i), then to the columns (j), each channel on its own.
    let at = |i: usize, j: usize| &d[(i * 4 + j) * cin..][..cin];
    for j in 0..4 {
        let (d0, d1, d2, d3) = (at(0, j), at(1, j), at(2, j), at(3, j));
        let (r0, rest) = rows[j * cin..].split_at_mut(4 * cin);
        let (r1, rest) = rest.split_at_mut(4 * cin);
        let (r2, r3) = rest.split_at_mut(4 * cin);
        for c in 0..cin {
            r0[c] = d0[c] - d2[c];
            r1[c] = d1[c] + d2[c];
            r2[c] = d2[c] - d1[c];
            r3[c] = d1[c] - d3[c];
        }
    }
    for a in 0..4 {
        let r = |j: usize| &rows[(a * 4 + j) * cin..][..cin];
        let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
        let row = |b: usize| ((a * 4 + b) * band + t) * cin;
        let (o0, o1, o2, o3) = (row(0), row(1), row(2), row(3));
        for c in 0..cin {
            v[o0 + c] = r0[c] - r2[c];
            v[o1 + c] = r1[c] + r2[c];
            v[o2 + c] = r2[c] - r1[c];
            v[o3 + c] = r1[c] - r3[c];
        }
    }
}

/// `Aᵀ m A` for block `t` of the 16 product matrices `m` (`band` rows of `cout` each): its
/// four outputs (row-major over the 2×2 block) into `y[k * cout..]`, which holds `16 * cout`.
#[inline(always)]
fn output_transform(m: &[f32], cout: usize, t: usize, band: usize, y: &mut [f32]) {
    // Aᵀ = [[1, 1, 1, 0], [0, 1, -1, -1]], applied to the rows, then to the columns.
    let at = |e: usize| &m[(e * band + t) * cout..][..cout];
    let (s, out) = y.split_at_mut(8 * cout);
    for j in 0..4 {
        let (m0, m1, m2, m3) = (at(j), at(4 + j), at(8 + j), at(12 + j));
        let (s0, s1) = s.split_at_mut(4 * cout);
        let (s0, s1) = (&mut s0[j * cout..][..cout], &mut s1[j * cout..][..cout]);
        for c in 0..cout {
            s0[c] = m0[c] + m1[c] + m2[c];
            s1[c] = m1[c] - m2[c] - m3[c];
        }
    }
    for r in 0..2 {
        let row = |j: usize| &s[(r * 4 + j) * cout..][..cout];
        let (a0, a1, a2, a3) = (row(0), row(1), row(2), row(3));
        let (y0, y1) = out[2 * r * cout..].split_at_mut(cout);
        for c in 0..cout {
            y0[c] = a0[c] + a1[c] + a2[c];
            y1[c] = a1[c] - a2[c] - a3[c];
        }
    }
    // The results now sit after the 8 rows of scratch: move them to the front.
    y.copy_within(8 * cout..12 * cout, 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the reference convolution on the tests' three threads, with padding 0, 1 and
    /// 2, odd sizes (a block half outside the image), a bias, a residual and an activation.
    #[test]
    fn matches_the_reference_convolution() {
        super::super::parallel::tests::install_test_pool();
        super::super::tests::each_isa(|| {
            for (cin, cout, padding, [h, w]) in
                // The fourth: 49 blocks an image, in as many bands for each thread. The last:
                // one band an image, fewer than the threads, so its 200 channels split as
                // 128 + 72 (a partial panel).
                [
                    (5usize, 7usize, 1usize, [6usize, 7usize]),
                    (16, 70, 0, [9, 5]),
                    (33, 16, 2, [4, 4]),
                    (24, 40, 1, [13, 13]),
                    (40, 200, 1, [4, 4]),
                ]
            {
                let g = Conv2d::new([cout as i64, cin as i64, 3, 3], [1, 1], [padding as i64; 2]).unwrap();
                let [ho, wo] = g.output(h, w).unwrap();
                let x: Vec<f32> = (0..2 * h * w * cin).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
                let wt: Vec<f32> = (0..cout * cin * 9).map(|i| ((i * 53 % 89) as f32 - 44.0) / 23.0).collect();
                let bias: Vec<f32> = (0..cout).map(|i| i as f32 / 7.0 - 1.0).collect();
                let res: Vec<f32> = (0..2 * ho * wo * cout).map(|i| ((i * 29 % 31) as f32 - 15.0) / 9.0).collect();
                let strides = [cin * 9, 9, 3, 1];
                let mut panels = vec![0.0; panels_len(cin, cout)];
                pack_weights(&wt, [cout, cin], strides, &mut panels);
                let mut got = vec![f32::NAN; 2 * ho * wo * cout];
                assert_eq!(conv(&x, [2, h, w], &panels, &g, Some(&bias), Some(&res), Epilogue::Relu, &mut got), Ok(()));
                let adds = (Some(&bias[..]), Some(&res[..]));
                let want = super::super::reference::conv2d(&x, [2, h, w], &wt, &g, adds, Epilogue::Relu);
                let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
                for (i, (&got, &want)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (got as f64 - want).abs() <= 1e-5 * scale,
                        "{cin}->{cout} p{padding} [{i}]: {got} vs {want}"
                    );
                }
            }
        });
    }
}
