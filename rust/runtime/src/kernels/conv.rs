//! Convolutions kwexport runs directly, not as a GEMM: depthwise ones (one channel per group)
//! and ones over few input channels (a network's stem), on channels-last outputs, split
//! across threads by output rows. The geometry types are shared with the GEMM's indirect
//! convolution (`super::gemm::indirect_f32`) and Winograd's.

use super::activation::{apply, Epilogue};
use super::simd::Simd;
use super::{Declined, Ran};

/// A convolution's output height and width for an input's, `None` where the kernel doesn't
/// fit the padded input.
pub(super) fn output_size(
    input: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
) -> Option<[usize; 2]> {
    let out = |d: usize| {
        let padded = input[d] + 2 * padding[d];
        (padded >= kernel[d]).then(|| (padded - kernel[d]) / stride[d] + 1)
    };
    Some([out(0)?, out(1)?])
}

/// Along one dimension, for output `o` at stride `s` and padding `p` of a `k`-tap window over
/// `size` inputs: the first tap's input position (negative in the padding), and the range of
/// taps inside the input.
pub(super) fn inside(o: usize, s: usize, p: usize, k: usize, size: usize) -> (isize, usize, usize) {
    let start = (o * s) as isize - p as isize;
    let first = (-start).max(0) as usize;
    let last = ((size as isize - start).min(k as isize)).max(0) as usize;
    (start, first, last.max(first))
}

/// A depthwise convolution's geometry (one group per channel, one output per group, no
/// dilation), checked once when the plan is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Depthwise {
    pub channels: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl Depthwise {
    /// From the weight's `[c, kh, kw]`, the stride and the padding: `None` for an empty
    /// kernel, a stride under 1 or a negative padding (torch's convolution then says why).
    pub fn new(shape: [i64; 3], stride: [i64; 2], padding: [i64; 2]) -> Option<Depthwise> {
        let positive = |v: i64| usize::try_from(v).ok().filter(|&v| v > 0);
        Some(Depthwise {
            channels: positive(shape[0])?,
            kernel: [positive(shape[1])?, positive(shape[2])?],
            stride: [positive(stride[0])?, positive(stride[1])?],
            padding: [usize::try_from(padding[0]).ok()?, usize::try_from(padding[1]).ok()?],
        })
    }

    /// The output's height and width for an input's, `None` where the kernel doesn't fit.
    pub fn output(&self, h: usize, w: usize) -> Option<[usize; 2]> {
        output_size([h, w], self.kernel, self.stride, self.padding)
    }
}

/// A convolution's geometry (no dilation), checked once when the plan is made. The
/// channels are the input's and the output's, all groups together; only the GEMM's indirect
/// convolution takes more than one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2d {
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub groups: usize,
}

impl Conv2d {
    /// The most input channels [`direct_f32`] is for: an image's (a network's stem), which
    /// oneDNN's kernels, blocked over input channels, run at 70% of their speed and an
    /// im2col GEMM at 60% (copying three floats per tap).
    pub const MAX_DIRECT_IN_CHANNELS: usize = 4;

    /// From the weight's `[out, in, kh, kw]`, the stride and the padding: `None` for an empty
    /// weight, a stride under 1 or a negative padding (torch's convolution then says why).
    pub fn new(shape: [i64; 4], stride: [i64; 2], padding: [i64; 2]) -> Option<Conv2d> {
        let positive = |v: i64| usize::try_from(v).ok().filter(|&v| v > 0);
        Some(Conv2d {
            out_channels: positive(shape[0])?,
            in_channels: positive(shape[1])?,
            kernel: [positive(shape[2])?, positive(shape[3])?],
            stride: [positive(stride[0])?, positive(stride[1])?],
            padding: [usize::try_from(padding[0]).ok()?, usize::try_from(padding[1]).ok()?],
            groups: 1,
        })
    }

    /// [`Conv2d::new`] for a convolution of `groups` groups (the weight's `[out, in / groups,
    /// kh, kw]`): `None` also where the groups don't divide the output channels.
    pub fn grouped(shape: [i64; 4], stride: [i64; 2], padding: [i64; 2], groups: i64) -> Option<Conv2d> {
        let groups = usize::try_from(groups).ok().filter(|&g| g > 0)?;
        let one = Conv2d::new(shape, stride, padding)?;
        (one.out_channels % groups == 0).then_some(Conv2d { in_channels: one.in_channels * groups, groups, ..one })
    }

    /// A group's input channels × kernel taps: the length of one output's dot product.
    pub fn taps(&self) -> usize {
        self.in_channels / self.groups * self.kernel[0] * self.kernel[1]
    }

    /// The output's height and width for an input's, `None` where the kernel doesn't fit.
    pub fn output(&self, h: usize, w: usize) -> Option<[usize; 2]> {
        output_size([h, w], self.kernel, self.stride, self.padding)
    }
}

/// A depthwise or direct convolution's operands as the kernel table's entries take them:
/// raw pointers, so that threads share them (each writes its own output rows).
#[derive(Clone, Copy)]
pub(super) struct Operands<G> {
    x: *const f32,
    /// Batch, height and width of the input.
    dims: [usize; 3],
    /// The input's element strides (batch, channel, row, column): the direct kernel's only.
    strides: [usize; 4],
    /// How far apart the input's pixels and the output's are (`c` where dense; more for a
    /// slice of a wider tensor's channels): the depthwise kernel's only.
    pixels: [usize; 2],
    taps: *const f32,
    g: G,
    /// The output's height and width.
    hw: [usize; 2],
    bias: *const f32,
    epilogue: Epilogue,
    out: *mut f32,
    /// Whether the depthwise kernel asks for its next input rows ahead ([`next_rows_to_l2`]):
    /// for an image of at least [`PREFETCHED_IMAGE_BYTES`], not for rows already in cache.
    ahead: bool,
}

impl Operands<Depthwise> {
    /// A depthwise convolution's operands over one image of `[h, w]` pixels of `c` channels,
    /// whose rows are in cache (`super::expand_depthwise`'s scratch): `x` is the image's
    /// origin, which may lie before the rows a caller's range reads, the only ones that need
    /// exist.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn banded(
        x: *const f32,
        [h, w]: [usize; 2],
        c: usize,
        taps: &[f32],
        g: &Depthwise,
        hw: [usize; 2],
        bias: Option<&[f32]>,
        epilogue: Epilogue,
        (out, lo): (*mut f32, usize),
    ) -> Self {
        Operands {
            x,
            dims: [1, h, w],
            strides: [0; 4],
            pixels: [c, lo],
            taps: taps.as_ptr(),
            g: *g,
            hw,
            bias: bias.map_or(std::ptr::null(), |b| b.as_ptr()),
            epilogue,
            out,
            ahead: false,
        }
    }
}

// SAFETY: the inputs are read only and kept alive by the caller for the whole call; the
// threads of one call write disjoint output rows (`by_rows`).
unsafe impl<G: Sync> Sync for Operands<G> {}

/// Output rows `range` (counted across the batch) of a convolution: the kernel table's entry.
pub(super) type Rows<G> = unsafe fn(&Operands<G>, std::ops::Range<usize>);

/// Runs `rows` over the `batch * ho` output rows, split across threads where each thread's
/// share holds enough arithmetic (`flops` in all).
///
/// # Safety
/// `rows` runs on this CPU and `ops` holds what its sizes say.
unsafe fn by_rows<G: Sync>(rows: Rows<G>, ops: &Operands<G>, flops: usize) {
    let n = ops.dims[0] * ops.hw[0];
    let threads = super::parallel::share(flops, n, super::parallel::threads());
    // SAFETY: each chunk writes its own output rows (the caller's sizes).
    super::parallel::for_each(n, threads, &|begin, end| unsafe { rows(ops, begin..end) });
}

/// A depthwise convolution over `batch` channels-last images (`x`: `[batch, h, w, c]`), with
/// the weight as `[kh * kw, c]` taps, the bias and `epilogue`, into `out` (`[batch, ho, wo,
/// c]`): for each output pixel, a vector of channels at a time, the sum over the taps that
/// fall inside the image (the padding is zeros). Declines (writing nothing) where the
/// slices don't fit the shapes or kwexport's kernels don't run on this CPU.
#[allow(clippy::too_many_arguments)]
pub fn depthwise_f32(
    x: &[f32],
    dims: [usize; 3],
    taps: &[f32],
    g: &Depthwise,
    bias: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> Ran {
    let c = g.channels;
    let [ho, wo] = g.output(dims[1], dims[2]).ok_or(Declined::Shapes)?;
    if x.len() < dims.iter().product::<usize>() * c || out.len() < dims[0] * ho * wo * c {
        return Err(Declined::Shapes);
    }
    // SAFETY: the slices hold the pixels (checked), dense; `out` is borrowed mutably, so
    // `x` can't share its memory.
    unsafe { depthwise_f32_strided((x.as_ptr(), c), dims, taps, g, bias, epilogue, (out.as_mut_ptr(), c)) }
}

/// [`depthwise_f32`] with the input's pixels `x.1` elements apart and the output's `out.1`
/// (each at least `c`): the channels of each a slice of a wider channels-last tensor's, as
/// a convolution that writes into its part of a concatenation leaves them
/// (`plan::concat`), possibly the same tensor's (GhostNet's cheap operation reads the
/// channels before the ones it writes). Pointers, not slices, for that reason.
///
/// # Safety
/// `x.0` must be readable for every input pixel's `c` channels and `out.0` writable for every
/// output pixel's, and no element read may be one written; nothing else may write either
/// while this runs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn depthwise_f32_strided(
    (x, lx): (*const f32, usize),
    [batch, h, w]: [usize; 3],
    taps: &[f32],
    g: &Depthwise,
    bias: Option<&[f32]>,
    epilogue: Epilogue,
    (out, lo): (*mut f32, usize),
) -> Ran {
    let c = g.channels;
    let Some([ho, wo]) = g.output(h, w) else { return Err(Declined::Shapes) };
    let fits = lx >= c && lo >= c && taps.len() >= g.kernel[0] * g.kernel[1] * c && bias.is_none_or(|b| b.len() >= c);
    let t = super::table_if(fits)?;
    let ops = Operands {
        x,
        dims: [batch, h, w],
        strides: [0; 4],
        pixels: [lx, lo],
        taps: taps.as_ptr(),
        g: *g,
        hw: [ho, wo],
        bias: bias.map_or(std::ptr::null(), |b| b.as_ptr()),
        epilogue,
        out,
        ahead: h * w * lx * 4 >= PREFETCHED_IMAGE_BYTES,
    };
    let flops = 2 * batch * ho * wo * c * g.kernel[0] * g.kernel[1];
    // SAFETY: the table's functions run on this CPU; the pointers reach what the shapes say
    // (the caller's contract).
    unsafe { by_rows(t.depthwise, &ops, flops) };
    Ok(())
}

/// A direct convolution of `x` (`[batch, cin, h, w]` at element `strides`: any layout), with
/// the weight as `[cin * kh * kw, cout]` (its taps' output channels contiguous), the bias and
/// `epilogue`, into `out` (channels-last `[batch, ho, wo, cout]`). Returns `false` (writing
/// nothing) where the slices don't fit the shapes or kwexport's kernels don't run on this CPU.
#[allow(clippy::too_many_arguments)]
pub fn direct_f32(
    x: &[f32],
    [batch, h, w]: [usize; 3],
    strides: [usize; 4],
    taps: &[f32],
    g: &Conv2d,
    bias: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> Ran {
    let Some([ho, wo]) = g.output(h, w).filter(|_| g.groups == 1) else { return Err(Declined::Shapes) };
    let fits = batch > 0
        && x.len() >= super::span(&[batch, g.in_channels, h, w], &strides)
        && taps.len() >= g.in_channels * g.kernel[0] * g.kernel[1] * g.out_channels
        && out.len() >= batch * ho * wo * g.out_channels
        && bias.is_none_or(|b| b.len() >= g.out_channels);
    let t = super::table_if(fits)?;
    let ops = Operands {
        x: x.as_ptr(),
        dims: [batch, h, w],
        strides,
        pixels: [0; 2],
        taps: taps.as_ptr(),
        g: *g,
        hw: [ho, wo],
        bias: bias.map_or(std::ptr::null(), |b| b.as_ptr()),
        epilogue,
        out: out.as_mut_ptr(),
        ahead: false,
    };
    let flops = 2 * batch * ho * wo * g.out_channels * g.taps();
    // SAFETY: the table's functions run on this CPU; the slices hold what the shapes say.
    unsafe { by_rows(t.direct, &ops, flops) };
    Ok(())
}

/// Whether the four output pixels from `ox` (of `wo`) all have every tap of their kernel
/// row inside the image: pixel `ox`'s taps are `cols`, along a dimension of stride `sw`,
/// padding `pw`, a `kw`-wide kernel and `w` inputs.
fn four_inside(ox: usize, wo: usize, cols: (usize, usize), [sw, pw, kw, w]: [usize; 4]) -> bool {
    ox + 4 <= wo && cols == (0, kw) && inside(ox + 3, sw, pw, kw, w).2 == kw
}

/// Output rows `range` of [`depthwise_f32`].
///
/// # Safety
/// `S`'s features must be enabled; the operands hold what their sizes say.
#[inline(always)]
pub(super) unsafe fn depthwise<S: Simd>(ops: &Operands<Depthwise>, range: std::ops::Range<usize>) {
    let (g, [_, h, w], [ho, wo], [lx, lo]) = (&ops.g, ops.dims, ops.hw, ops.pixels);
    let c = g.channels;
    let ([kh, kw], [sh, sw], [ph, pw]) = (g.kernel, g.stride, g.padding);
    let (xp, tp, op, bp, epilogue) = (ops.x, ops.taps, ops.out, ops.bias, ops.epilogue);
    // Channel blocks per tile: four vectors where there are 32 registers, two where 16.
    let most = if S::REGISTERS >= 32 { 4 } else { 2 };
    let ahead = ops.ahead;
    for row in range {
        let (b, oy) = (row / ho, row % ho);
        let (iy, i0, i1) = inside(oy, sh, ph, kh, h);
        let mut ox = 0;
        while ox < wo {
            let (ix, j0, j1) = inside(ox, sw, pw, kw, w);
            if ahead && oy + 1 < ho {
                next_rows_to_l2(xp, ops, b, oy + 1, ix);
            }
            // A 3- or 5-wide kernel at stride 1 or 2 slides over up to four pixels at once,
            // borders included: each input vector of a kernel row is loaded once for every
            // pixel and tap that reads it (a 512-bit load takes both of Zen 4's load ports,
            // so loads, not FMAs, bound the general tile).
            let slides = matches!((kw, sw), (3 | 5, 1 | 2));
            // Otherwise four pixels at once where each has every tap of its row inside the
            // image: four independent sums per weight vector loaded.
            let pixels = if slides {
                (wo - ox).min(4)
            } else if four_inside(ox, wo, (j0, j1), [sw, pw, kw, w]) {
                4
            } else {
                1
            };
            // SAFETY: taps inside the image only are read: rows from `i0`, columns from `j0`
            // (or, sliding, the columns inside the image), each address formed with wrapping
            // arithmetic from an origin that may lie in the padding; and the output pixels.
            unsafe {
                let first_tap = ((b * h) as isize + iy) * w as isize + ix;
                let (x0, o) = (xp.wrapping_offset(first_tap * lx as isize), op.add(((b * ho + oy) * wo + ox) * lo));
                let d = Taps { rows: [i0, i1], cols: [j0, j1], kw, c, lx, lo, row: w * lx, step: sw * lx };
                let mut c0 = 0;
                if slides {
                    let row = Slide { origin: x0, column: ix, width: w, pixels };
                    // Two whole vectors of channels at a time while they are left; four
                    // pixels with every tap inside the image check no tap.
                    let all_inside = pixels == 4 && ix >= 0 && ix as usize + 3 * sw + kw <= w;
                    while c0 + 2 * S::LANES <= c {
                        match (kw, sw, all_inside) {
                            (3, 1, true) => dw_pair::<S, 3, 1, false>(&row, tp, bp, o, c0, &d, epilogue),
                            (3, 1, false) => dw_pair::<S, 3, 1, true>(&row, tp, bp, o, c0, &d, epilogue),
                            (3, _, true) => dw_pair::<S, 3, 2, false>(&row, tp, bp, o, c0, &d, epilogue),
                            (3, _, false) => dw_pair::<S, 3, 2, true>(&row, tp, bp, o, c0, &d, epilogue),
                            (_, 1, true) => dw_pair::<S, 5, 1, false>(&row, tp, bp, o, c0, &d, epilogue),
                            (_, 1, false) => dw_pair::<S, 5, 1, true>(&row, tp, bp, o, c0, &d, epilogue),
                            (_, _, true) => dw_pair::<S, 5, 2, false>(&row, tp, bp, o, c0, &d, epilogue),
                            (_, _, false) => dw_pair::<S, 5, 2, true>(&row, tp, bp, o, c0, &d, epilogue),
                        }
                        c0 += 2 * S::LANES;
                    }
                    while c0 < c {
                        match (kw, sw) {
                            (3, 1) => dw_slide::<S, 3, 1>(&row, tp, bp, o, c0, &d, epilogue),
                            (3, _) => dw_slide::<S, 3, 2>(&row, tp, bp, o, c0, &d, epilogue),
                            (_, 1) => dw_slide::<S, 5, 1>(&row, tp, bp, o, c0, &d, epilogue),
                            _ => dw_slide::<S, 5, 2>(&row, tp, bp, o, c0, &d, epilogue),
                        }
                        c0 += S::LANES;
                    }
                }
                while c0 < c {
                    let blocks = (c - c0).div_ceil(S::LANES).min(most);
                    match (pixels, blocks) {
                        (4, 4) => dw_tile::<S, 4, 4>(x0, tp, bp, o, c0, &d, epilogue),
                        (4, 3) => dw_tile::<S, 4, 3>(x0, tp, bp, o, c0, &d, epilogue),
                        (4, 2) => dw_tile::<S, 4, 2>(x0, tp, bp, o, c0, &d, epilogue),
                        (4, _) => dw_tile::<S, 4, 1>(x0, tp, bp, o, c0, &d, epilogue),
                        (_, 4) => dw_tile::<S, 1, 4>(x0, tp, bp, o, c0, &d, epilogue),
                        (_, 3) => dw_tile::<S, 1, 3>(x0, tp, bp, o, c0, &d, epilogue),
                        (_, 2) => dw_tile::<S, 1, 2>(x0, tp, bp, o, c0, &d, epilogue),
                        _ => dw_tile::<S, 1, 1>(x0, tp, bp, o, c0, &d, epilogue),
                    }
                    c0 += blocks * S::LANES;
                }
            }
            ox += pixels;
        }
    }
}

/// The least input image (bytes) a depthwise convolution asks for ahead of its reads: a
/// MobileNet's expanded 112×112 and 56×56 images (1.6-4.8 MB) come from L3 or memory, and
/// the channels-last rows its tiles read, each pixel's vectors in turn, three rows at once,
/// were prefetched poorly by the hardware (in the model the stride-2 one at 112×112 took
/// up to 2.6× ONNX Runtime's time over channel blocks, which read one plane in order).
const PREFETCHED_IMAGE_BYTES: usize = 1 << 20;

/// Asks for the input rows that output row `oy` reads and the row before it did not, over
/// the columns of a tile of four pixels from input column `ix`, in L2: a row of the image
/// ahead of the tiles (at most 86 KB for MobileNetV2's largest).
#[inline(always)]
fn next_rows_to_l2(xp: *const f32, ops: &Operands<Depthwise>, b: usize, oy: usize, ix: isize) {
    let ([_, h, w], lx, g) = (ops.dims, ops.pixels[0], &ops.g);
    let ([kh, _], [sh, sw], [ph, _]) = (g.kernel, g.stride, g.padding);
    // Output row `oy`'s window's last `sh` rows, which row `oy - 1`'s didn't hold (the whole
    // window where the kernel is shorter than the stride).
    let last = (oy * sh + kh) as isize - ph as isize;
    let first = last - sh.min(kh) as isize;
    let c0 = ix.clamp(0, w as isize - 1) as usize;
    let c1 = (ix + (4 * sw) as isize).clamp(c0 as isize + 1, w as isize) as usize;
    for r in first.max(0) as usize..last.clamp(0, h as isize) as usize {
        let base = xp.wrapping_add(((b * h + r) * w + c0) * lx).cast::<u8>();
        for offset in (0..(c1 - c0) * lx * 4).step_by(64) {
            super::prefetch_l2(base.wrapping_add(offset));
        }
    }
}

/// Where a depthwise tile's taps are: the kernel rows and columns inside the image, the
/// kernel's width, the channels (the taps' stride), the strides (in elements) of an input
/// pixel and an output pixel, of an input row and of one output pixel's step along it.
struct Taps {
    rows: [usize; 2],
    cols: [usize; 2],
    kw: usize,
    c: usize,
    lx: usize,
    lo: usize,
    row: usize,
    step: usize,
}

/// Where a sliding depthwise tile reads: the first pixel's kernel origin (row and column
/// of tap (0, 0), possibly in the padding), that column, the image's width, and how many
/// of the four pixels are outputs.
struct Slide {
    origin: *const f32,
    column: isize,
    width: usize,
    pixels: usize,
}

/// Up to four neighbouring output pixels × one vector of channels from `c0` (masked past
/// `c`: the channels [`dw_pair`] leaves), for a kernel `KW` wide at stride `ST`: per kernel row inside the image, the `3 ST +
/// KW` input vectors the four pixels read are loaded once (zeros where they fall in the
/// padding), with the row's `KW` weight vectors, for `4 KW` FMAs.
#[inline(always)]
unsafe fn dw_slide<S: Simd, const KW: usize, const ST: usize>(
    row: &Slide,
    taps: *const f32,
    bias: *const f32,
    out: *mut f32,
    c0: usize,
    d: &Taps,
    epilogue: Epilogue,
) {
    // SAFETY (all below): rows inside the image (`d.rows`), columns checked against the
    // width before each load, channels masked past `c`; outputs for `row.pixels` pixels.
    unsafe {
        let mask = S::first(d.c.saturating_sub(c0));
        let start = if bias.is_null() { S::zero() } else { S::load_masked(mask, bias.add(c0)) };
        let mut acc = [start; 4];
        for i in d.rows[0]..d.rows[1] {
            let (xr, wr) = (row.origin.wrapping_add(i * d.row + c0), taps.add(i * KW * d.c + c0));
            let ws: [S::V; KW] = std::array::from_fn(|j| S::load_masked(mask, wr.add(j * d.c)));
            // Positions 0 .. 3 ST + KW of the row, `d.lx` apart (ST = 2: at most 11).
            let mut xs = [S::zero(); 11];
            let inside = row.column >= 0 && row.column as usize + 3 * ST + KW <= row.width;
            for (q, v) in xs.iter_mut().enumerate().take(3 * ST + KW) {
                if inside || (0..row.width as isize).contains(&(row.column + q as isize)) {
                    *v = S::load_masked(mask, xr.wrapping_add(q * d.lx));
                }
            }
            for (p, a) in acc.iter_mut().enumerate() {
                for (j, wv) in ws.iter().enumerate() {
                    *a = S::fma(xs[p * ST + j], *wv, *a);
                }
            }
        }
        for (p, a) in acc.iter().enumerate().take(row.pixels) {
            S::store_masked(out.add(p * d.lo + c0), mask, apply::<S>(epilogue, *a));
        }
    }
}

/// Up to four neighbouring output pixels × two whole vectors of channels from `c0`, for a
/// kernel `KW` wide at stride `ST`: eight sums, so that two FMAs issue every cycle past their
/// latency, each FMA reading its input vector straight from memory and, with `CHECK`, skipped
/// where the tap falls in the padding (the loads, not the FMAs, bounded [`dw_slide`]'s
/// single vector: 1.6-2.5× on AVX2).
#[inline(always)]
unsafe fn dw_pair<S: Simd, const KW: usize, const ST: usize, const CHECK: bool>(
    row: &Slide,
    taps: *const f32,
    bias: *const f32,
    out: *mut f32,
    c0: usize,
    d: &Taps,
    epilogue: Epilogue,
) {
    // SAFETY (all below): rows inside the image (`d.rows`), columns inside it (`inside`, or
    // all of them without `CHECK`: the caller's test), channels `c0 .. c0 + 2 LANES` within
    // `c` (the caller's); outputs for `row.pixels` pixels.
    unsafe {
        let start = |v: usize| if bias.is_null() { S::zero() } else { S::load(bias.add(c0 + v * S::LANES)) };
        let mut acc = [[start(0), start(1)]; 4];
        // Which of the window's columns (at most 3 ST + KW = 11) lie inside the image.
        let inside: [bool; 11] = std::array::from_fn(|q| (0..row.width as isize).contains(&(row.column + q as isize)));
        for i in d.rows[0]..d.rows[1] {
            let (xr, wr) = (row.origin.wrapping_add(i * d.row + c0), taps.add(i * KW * d.c + c0));
            for j in 0..KW {
                let w = [S::load(wr.add(j * d.c)), S::load(wr.add(j * d.c + S::LANES))];
                for (p, a) in acc.iter_mut().enumerate() {
                    if !CHECK || inside[p * ST + j] {
                        let x = xr.wrapping_add((p * ST + j) * d.lx);
                        a[0] = S::fma(S::load(x), w[0], a[0]);
                        a[1] = S::fma(S::load(x.wrapping_add(S::LANES)), w[1], a[1]);
                    }
                }
            }
        }
        for (p, a) in acc.iter().enumerate().take(row.pixels) {
            for (v, y) in a.iter().enumerate() {
                S::store(out.add(p * d.lo + c0 + v * S::LANES), apply::<S>(epilogue, *y));
            }
        }
    }
}

/// `P` neighbouring output pixels × `B` vectors of channels from `c0` (masked past `c`):
/// `P * B` independent sums over the taps, so the FMAs' latency overlaps. `x0` is the first
/// pixel's kernel origin (row and column of tap (0, 0), which may lie in the padding: only
/// taps inside are read).
#[inline(always)]
unsafe fn dw_tile<S: Simd, const P: usize, const B: usize>(
    x0: *const f32,
    taps: *const f32,
    bias: *const f32,
    out: *mut f32,
    c0: usize,
    d: &Taps,
    epilogue: Epilogue,
) {
    // SAFETY (all below): taps inside the image and channels masked past `c` (see the
    // caller).
    unsafe {
        let masks: [S::M; B] = std::array::from_fn(|v| S::first(d.c.saturating_sub(c0 + v * S::LANES)));
        let mut acc = [[S::zero(); B]; P];
        if !bias.is_null() {
            for v in 0..B {
                let b = S::load_masked(masks[v], bias.add(c0 + v * S::LANES));
                acc.iter_mut().for_each(|px| px[v] = b);
            }
        }
        for i in d.rows[0]..d.rows[1] {
            for j in d.cols[0]..d.cols[1] {
                let (xt, wt) = (x0.wrapping_add(i * d.row + j * d.lx + c0), taps.add((i * d.kw + j) * d.c + c0));
                let wv: [S::V; B] = std::array::from_fn(|v| S::load_masked(masks[v], wt.add(v * S::LANES)));
                for (p, px) in acc.iter_mut().enumerate() {
                    for v in 0..B {
                        let xv = S::load_masked(masks[v], xt.wrapping_add(p * d.step + v * S::LANES));
                        px[v] = S::fma(xv, wv[v], px[v]);
                    }
                }
            }
        }
        for (p, px) in acc.iter().enumerate() {
            for v in 0..B {
                S::store_masked(out.add(p * d.lo + c0 + v * S::LANES), masks[v], apply::<S>(epilogue, px[v]));
            }
        }
    }
}

/// Output rows `range` of [`direct_f32`].
///
/// # Safety
/// `S`'s features must be enabled; the operands hold what their sizes and strides say.
#[inline(always)]
pub(super) unsafe fn direct<S: Simd>(ops: &Operands<Conv2d>, range: std::ops::Range<usize>) {
    let (g, [_, h, w], [sb, sc, sy, sx], [ho, wo]) = (&ops.g, ops.dims, ops.strides, ops.hw);
    let (cin, cout) = (g.in_channels, g.out_channels);
    let ([kh, kw], [sh, sw], [ph, pw]) = (g.kernel, g.stride, g.padding);
    let (xp, tp, op, bp, epilogue) = (ops.x, ops.taps, ops.out, ops.bias, ops.epilogue);
    for row in range {
        let (b, oy) = (row / ho, row % ho);
        let (iy, i0, i1) = inside(oy, sh, ph, kh, h);
        let mut ox = 0;
        while ox < wo {
            let (ix, j0, j1) = inside(ox, sw, pw, kw, w);
            let pixels = if four_inside(ox, wo, (j0, j1), [sw, pw, kw, w]) { 4 } else { 1 };
            // SAFETY: the pixel's kernel origin (offset by `i0`, `j0` where it lies in the
            // padding) and its output pixel.
            unsafe {
                let origin = (b * sb) as isize + iy * sy as isize + ix * sx as isize;
                let (x0, o) = (xp.wrapping_offset(origin), op.add(((b * ho + oy) * wo + ox) * cout));
                let d = Patch { rows: [i0, i1], cols: [j0, j1], kh, kw, cin, cout, sc, sy, sx, step: sw * sx };
                let mut c0 = 0;
                while c0 < cout {
                    let blocks = (cout - c0).div_ceil(S::LANES).min(2);
                    match (pixels, blocks) {
                        (4, 2) => direct_tile::<S, 4, 2>(x0, tp, bp, o, c0, &d, epilogue),
                        (4, _) => direct_tile::<S, 4, 1>(x0, tp, bp, o, c0, &d, epilogue),
                        (_, 2) => direct_tile::<S, 1, 2>(x0, tp, bp, o, c0, &d, epilogue),
                        _ => direct_tile::<S, 1, 1>(x0, tp, bp, o, c0, &d, epilogue),
                    }
                    c0 += blocks * S::LANES;
                }
            }
            ox += pixels;
        }
    }
}

/// Where a direct tile's inputs are: the kernel rows and columns inside the image, the
/// kernel's size, the channels, and the input's element strides (channel, row, column,
/// and one output pixel's step along a row).
struct Patch {
    rows: [usize; 2],
    cols: [usize; 2],
    kh: usize,
    kw: usize,
    cin: usize,
    cout: usize,
    sc: usize,
    sy: usize,
    sx: usize,
    step: usize,
}

/// `P` neighbouring output pixels × `B` vectors of output channels from `c0` (masked past
/// `cout`): each input value broadcast against each block's weights.
#[inline(always)]
unsafe fn direct_tile<S: Simd, const P: usize, const B: usize>(
    x0: *const f32,
    taps: *const f32,
    bias: *const f32,
    out: *mut f32,
    c0: usize,
    d: &Patch,
    epilogue: Epilogue,
) {
    // SAFETY (all below): taps inside the image, output channels masked past `cout` (see
    // the caller).
    unsafe {
        let masks: [S::M; B] = std::array::from_fn(|v| S::first(d.cout.saturating_sub(c0 + v * S::LANES)));
        let mut acc = [[S::zero(); B]; P];
        if !bias.is_null() {
            for v in 0..B {
                let b = S::load_masked(masks[v], bias.add(c0 + v * S::LANES));
                acc.iter_mut().for_each(|px| px[v] = b);
            }
        }
        for ci in 0..d.cin {
            for i in d.rows[0]..d.rows[1] {
                for j in d.cols[0]..d.cols[1] {
                    let xt = x0.wrapping_add(ci * d.sc + i * d.sy + j * d.sx);
                    let wt = taps.add(((ci * d.kh + i) * d.kw + j) * d.cout + c0);
                    let wv: [S::V; B] = std::array::from_fn(|v| S::load_masked(masks[v], wt.add(v * S::LANES)));
                    for (p, px) in acc.iter_mut().enumerate() {
                        let xv = S::splat(*xt.wrapping_add(p * d.step));
                        for v in 0..B {
                            px[v] = S::fma(xv, wv[v], px[v]);
                        }
                    }
                }
            }
        }
        for (p, px) in acc.iter().enumerate() {
            for v in 0..B {
                S::store_masked(out.add(p * d.cout + c0 + v * S::LANES), masks[v], apply::<S>(epilogue, px[v]));
            }
        }
    }
}
