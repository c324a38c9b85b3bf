//! An inverted residual's head in one kernel: a 1×1 convolution that expands the channels
//! (MobileNetV2's 16 → 96 at 112×112) and the depthwise convolution over its output, run over
//! bands of rows so that the expanded image never leaves L2. Apart, the 1×1 writes the whole
//! expanded image (4.8 MB at 112×112 × 96) and the depthwise convolution reads it back, both
//! from L3 or memory; ONNX Runtime's pair ran those two nodes in 0.6× kwexport's time on an
//! AVX2 Zen 3 whose L3 other tenants shared (BENCHMARKS.md, "twenty-eighth session").
//!
//! Each thread takes a run of output rows; for each band of them it expands the input rows
//! the band's windows read into a scratch image of those rows (keeping the rows the last band
//! shared with it), then runs the depthwise kernel on them. Both stages are the kernel
//! table's own (`gemm_block`, `depthwise`), so the results are theirs bit for bit.

use super::activation::Epilogue;
use super::conv::{Depthwise, Operands};
use super::gemm::{Dense, Out, Rows, Shape, Source, PANEL};
use super::Ran;

/// The bytes of expanded rows a band holds at most: half of a Zen 3's 512 KB L2, with room
/// for the input rows, the weights and the output rows beside them.
const BAND_BYTES: usize = 256 << 10;

/// The fewest expanded bytes an image has for the fused kernel to pay: below them the
/// expanded image stays in cache between the two kernels run apart, and the fused kernel's
/// bands cost more than they save (alone, one thread, on the AVX2 Zen 3, fused / apart:
/// 0.58 at 112×112 × 96 channels (4.8 MB), 0.76 at 56×56 × 192 (2.4 MB), 0.91 at 56×56 × 144
/// (1.8 MB), 1.06 at 28×28 × 192 (0.6 MB)).
pub const MIN_EXPANDED_BYTES: usize = 1 << 20;

/// Whether an image of `elements` expanded floats is worth the fused kernel.
pub fn pays(elements: usize) -> bool {
    elements.saturating_mul(4) >= MIN_EXPANDED_BYTES
}

/// The expansion's weight and what it adds: its `[ceil(n / 64), k, 64]` panels
/// (`super::pack_conv_panels`), bias and epilogue.
#[derive(Clone, Copy)]
pub struct Expansion<'a> {
    pub panels: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub epilogue: Epilogue,
}

/// The depthwise convolution's `[kh * kw, c]` taps, bias and epilogue.
#[derive(Clone, Copy)]
pub struct DepthwiseWeights<'a> {
    pub taps: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub epilogue: Epilogue,
}

/// `depthwise(expand(x))`: `x` is `batch` channels-last images (`[batch, h, w, k]`, pixels
/// `x.1` elements apart), expanded to `g.channels` channels by the 1×1 convolution
/// `expansion`, then convolved by `g`'s depthwise convolution into `out` (`[batch, ho, wo,
/// c]`, pixels `out.1` apart): the same values as the two kernels run one after the other
/// (`super::gemm_f32_rows`, `super::depthwise_f32`). Declines (writing nothing) where the
/// weights don't fit the shapes or kwexport's kernels don't run on this CPU.
///
/// # Safety
/// `x.0` must be readable for every input pixel's `k` channels and `out.0` writable for every
/// output pixel's `c`, the two apart; nothing else may write either while this runs.
pub unsafe fn expand_depthwise_f32(
    (x, lx): (*const f32, usize),
    [batch, h, w, k]: [usize; 4],
    expansion: Expansion<'_>,
    g: &Depthwise,
    dw: DepthwiseWeights<'_>,
    (out, lo): (*mut f32, usize),
) -> Ran {
    let c = g.channels;
    g.output(h, w).ok_or(super::Declined::Shapes)?;
    let fits = lx >= k
        && lo >= c
        && expansion.panels.len() >= super::panels_len(k, c)
        && expansion.bias.is_none_or(|b| b.len() >= c)
        && dw.taps.len() >= g.kernel[0] * g.kernel[1] * c
        && dw.bias.is_none_or(|b| b.len() >= c);
    let t = super::table_if(fits)?;
    let shape = Shape {
        taps: 1,
        cin: k,
        n: c,
        ldo: c,
        bias: expansion.bias.map_or(std::ptr::null(), |b| b.as_ptr()),
        scale: std::ptr::null(),
        sums: std::ptr::null(),
        residual: std::ptr::null(),
        epilogue: expansion.epilogue,
        requant: None,
    };
    let src = Dense { x, ld: lx };
    let expand = |first: usize, pixels: usize, out: *mut f32| {
        // SAFETY: the input's pixels `first..first + pixels` exist and `out` holds as many
        // rows of `c` (`banded`'s contract).
        unsafe {
            let src = Dense { x: src.at(first, 0), ld: src.ld };
            for j in (0..c).step_by(PANEL) {
                (t.gemm_block)(Source::Dense(src), 0..pixels, &shape, expansion.panels, Out(out), j, k);
            }
        }
    };
    // SAFETY: the caller's pointers reach what the shapes say (checked above for the weights).
    unsafe { banded(t, [batch, h, w], k, g, dw, (out, lo), &expand) };
    Ok(())
}

/// Writes the expanded channels of `pixels` input pixels from pixel `first` (counted across
/// the batch) into `out`, dense rows of the depthwise convolution's channels: a float32 or
/// an int8 1×1 convolution (`super::int8::expand_depthwise`).
pub(super) type Expand<'a> = dyn Fn(usize, usize, *mut f32) + Sync + 'a;

/// The depthwise convolution `g` (`dw`) of the image `expand` makes from `batch` images of
/// `[h, w]` pixels of `k` channels, into `out` (`[batch, ho, wo, c]`, pixels `out.1` apart),
/// over bands of output rows shared out over the threads, each band's input rows expanded
/// into a scratch image of the thread's.
///
/// # Safety
/// The table's functions run on this CPU; `dw`'s weights hold what `g` says; `expand` writes
/// the rows it is asked for within the image and `out.0` is writable for every output pixel's
/// `c`, which nothing else writes while this runs.
pub(super) unsafe fn banded(
    t: &super::isa::Table,
    [batch, h, w]: [usize; 3],
    k: usize,
    g: &Depthwise,
    dw: DepthwiseWeights<'_>,
    (out, lo): (*mut f32, usize),
    expand: &Expand<'_>,
) {
    let c = g.channels;
    let Some([ho, wo]) = g.output(h, w) else { return };
    let ([kh, _], [sh, _]) = (g.kernel, g.stride);
    // Output rows a band: as many as keep their input rows within `BAND_BYTES`.
    let row_bytes = w * c * 4;
    let band_rows = (BAND_BYTES / row_bytes.max(1)).max(kh);
    let band = ((band_rows - kh) / sh + 1).clamp(1, ho.max(1));
    let scratch_rows = (band - 1) * sh + kh;
    let job = Job { dims: [h, w], g: *g, hw: [ho, wo], dw, out, lo, expand };
    let rows = batch * ho;
    let flops = 2 * batch * (h * w * k * c + ho * wo * c * g.kernel[0] * g.kernel[1]);
    let threads = super::parallel::share(flops, rows.div_ceil(band), super::parallel::threads());
    super::parallel::for_each(rows, threads, &|begin, end| {
        let mut scratch = vec![0f32; scratch_rows * w * c];
        // SAFETY: the table's functions run on this CPU; each thread writes its own output
        // rows and its own scratch (the caller's pointers reach what the shapes say).
        unsafe { job.run(t, begin..end, band, &mut scratch) };
    });
}

/// What every thread of one call reads.
struct Job<'a> {
    /// The input images' height and width.
    dims: [usize; 2],
    g: Depthwise,
    hw: [usize; 2],
    dw: DepthwiseWeights<'a>,
    out: *mut f32,
    lo: usize,
    expand: &'a Expand<'a>,
}

// SAFETY: the input and weights are read only and kept alive by the caller for the whole call;
// the threads write disjoint output rows and scratch of their own.
unsafe impl Sync for Job<'_> {}

impl Job<'_> {
    /// Output rows `rows` (counted across the batch) in bands of `band` rows, on `scratch`.
    ///
    /// # Safety
    /// The table's functions run on this CPU; the job's pointers reach what its sizes say and
    /// `scratch` holds the input rows of a band.
    unsafe fn run(&self, t: &super::isa::Table, rows: std::ops::Range<usize>, band: usize, scratch: &mut [f32]) {
        let ([h, w], [ho, wo], c) = (self.dims, self.hw, self.g.channels);
        let ([kh, _], [sh, _], [ph, _]) = (self.g.kernel, self.g.stride, self.g.padding);
        // The image and its rows `held` the scratch holds, from its start.
        let mut held: Option<(usize, std::ops::Range<usize>)> = None;
        let mut row = rows.start;
        while row < rows.end {
            let (b, oy0) = (row / ho, row % ho);
            let oy1 = (oy0 + band).min(ho).min(oy0 + rows.end - row);
            // The input rows the band's windows read.
            let first = (oy0 * sh).saturating_sub(ph).min(h);
            let last = ((oy1 - 1) * sh + kh).saturating_sub(ph).clamp(first, h);
            // Rows the scratch already holds for this image move to its start.
            let kept = match &held {
                Some((hb, r)) if *hb == b && r.start <= first && first < r.end => {
                    let kept = r.end.min(last) - first;
                    let from = (first - r.start) * w * c;
                    scratch.copy_within(from..from + kept * w * c, 0);
                    kept
                }
                _ => 0,
            };
            let fresh = first + kept..last;
            if !fresh.is_empty() {
                // SAFETY: the scratch holds the image's rows `fresh` after the kept rows
                // (`scratch_rows` of them).
                let at = unsafe { scratch.as_mut_ptr().add(kept * w * c) };
                (self.expand)((b * h + fresh.start) * w, fresh.len() * w, at);
            }
            held = Some((b, first..last));
            // The depthwise kernel reads the scratch as the image's rows from `first`: its
            // origin lies `first` rows before the scratch (never read there).
            let ops = Operands::banded(
                scratch.as_ptr().wrapping_sub(first * w * c),
                [h, w],
                c,
                self.dw.taps,
                &self.g,
                [ho, wo],
                self.dw.bias,
                self.dw.epilogue,
                // SAFETY: image `b`'s output rows exist (the caller's).
                (unsafe { self.out.add(b * ho * wo * self.lo) }, self.lo),
            );
            // SAFETY: the rows the band's windows read lie in the scratch (above).
            unsafe { (t.depthwise)(&ops, oy0..oy1) };
            row += oy1 - oy0;
        }
    }
}
