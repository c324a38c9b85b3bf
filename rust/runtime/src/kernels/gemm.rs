//! kwexport's GEMM: linears, 1×1 convolutions (rows are pixels) and, reading each row's taps
//! through a table of pointers, every other convolution (`indirect_f32`). The driver
//! (threads, column blocks, register tiles) is written once, generic over the element type
//! ([`Dot`]: float32 values, bfloat16 pairs for `super::bf16`, the int8 GEMM's int16 pairs
//! and byte quads for `super::int8`) and over [`Simd`], and instantiated per instruction set by
//! `super::isa`, whose table the driver calls per block.

use super::activation::{apply, epilogue_slice, Epilogue};
use super::conv::Conv2d;
use super::simd::Simd;
use super::{Declined, Ran};

/// The width of a weight panel: the columns one pass of the GEMM computes, the same for every
/// instruction set (a panel holds several register tiles' columns where vectors are narrow).
pub const PANEL: usize = 64;

/// The columns of a panel stored together ([`Strips`]) for `S`'s tiles: the whole panel where
/// a tile is 64 columns wide (AVX-512: each row's 256 bytes in order), two vectors where it is
/// two vectors wide (AVX2's 6 × 16 tile).
pub(super) const fn strip<S: Simd>() -> usize {
    if S::REGISTERS >= 32 {
        PANEL
    } else {
        2 * S::LANES
    }
}

/// Where each element of a `[depth, 64]` weight panel lies: the panel is stored in strips of
/// the kernels' tile width, each strip's `depth` rows one after another, so that a tile
/// reads its columns of the weight in order. With whole 64-column rows, AVX2's 16-column
/// tiles read one cache line of each 256-byte row, and a strip of a few hundred rows
/// crowded a sixteenth of L1's sets: on a Zen 3, BERT (d=256, 32 tokens) took 1.15× the time
/// it takes with strips, the 8 × 256 MLP at batch 4 1.3× (BENCHMARKS.md). The one place a
/// panel's order is written: every packer places elements through [`Strips::at`], and the
/// tiles read them as [`strip`] says.
#[derive(Debug, Clone, Copy)]
pub struct Strips {
    strip: usize,
    depth: usize,
}

impl Strips {
    /// The layout the kernels that run here read, for panels `depth` rows deep (whole rows
    /// where kwexport's kernels don't run: nothing reads them then).
    pub fn current(depth: usize) -> Strips {
        Strips { strip: super::isa::kernels().map_or(PANEL, |t| t.strip), depth }
    }

    /// The offset in its panel of row `r` (< depth), column `col` (< 64).
    #[inline(always)]
    pub fn at(self, r: usize, col: usize) -> usize {
        (col / self.strip * self.depth + r) * self.strip + col % self.strip
    }
}

/// The panels [`pack_conv_panels`] makes of a `[n, cin, kh, kw]` weight (a matrix is `[n, k,
/// 1, 1]`): `ceil(n / 64)` panels of `[cin * kh * kw, 64]`. The one place the float32
/// panels' size is computed.
pub fn pack_size([n, cin, kh, kw]: [usize; 4]) -> [usize; 3] {
    [n.div_ceil(PANEL), cin * kh * kw, PANEL]
}

/// The panels [`pack_conv_panels`] makes of a `[n, cin, kh, kw]` weight of `groups` groups
/// (`cin` per group): each group's [`pack_size`] panels, one group after another.
pub fn grouped_pack_size([n, cin, kh, kw]: [usize; 4], groups: usize) -> [usize; 3] {
    let [panels, k, width] = pack_size([n / groups.max(1), cin, kh, kw]);
    [panels * groups, k, width]
}

/// Whether `len` elements hold `m` rows of `n`, `ld` apart (`ld >= n`), from the first row's
/// first element to the last row's last: a GEMM's input rows, or its output's where they are
/// a slice of wider ones (a part of a concatenation, `plan::concat`).
pub(super) fn rows_fit(len: usize, [m, n]: [usize; 2], ld: usize) -> bool {
    m == 0 || (ld >= n && len >= (m - 1) * ld + n)
}

/// Whether a GEMM's `m × n` result fits `out` with its rows `ldo` apart, with `n` biases and
/// a residual laid out as the result where given: what every GEMM-shaped kernel checks
/// besides its input and panels.
pub(super) fn results_fit(
    [m, n]: [usize; 2],
    ldo: usize,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    out: usize,
) -> bool {
    rows_fit(out, [m, n], ldo)
        && bias.is_none_or(|b| b.len() >= n)
        && residual.is_none_or(|r| rows_fit(r.len(), [m, n], ldo))
}

/// The elements of the panels of a `[k, n]` matrix ([`pack_size`] of `[n, k, 1, 1]`).
pub fn panels_len(k: usize, n: usize) -> usize {
    pack_size([n, k, 1, 1]).iter().product()
}

/// `out[m, n] = bias[n] + x[m, k] @ w[k, n]` for small `m` (a few rows of activations: a
/// decode step, a small batch), where torch's GEMM spends more on setup than on arithmetic.
/// `panels` is the weight packed once ([`pack_conv_panels`], its first use): `ceil(n / 64)`
/// contiguous `[k, 64]` panels, so the kernel streams each panel from memory in order (a row
/// of a plain `[k, n]` weight is a new page every few rows, which the prefetchers don't
/// follow). Declines (writing nothing) where kwexport's kernels don't run on this CPU;
/// the plan measures it against torch's kernel per shape and keeps the faster (`exec`).
pub fn linear_f32(
    x: &[f32],
    m: usize,
    k: usize,
    panels: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Ran {
    gemm_f32(x, m, k, panels, n, bias, None, Epilogue::None, out)
}

/// [`linear_f32`] for any number of rows, plus `residual` (`m * n`, laid out as `out`: a
/// convolution's residual add, `passes::conv_residual`), then `epilogue` on each result: also
/// a 1×1 convolution over channels-last pixels (rows are pixels, `k` and `n` channels). Tiles
/// of up to 6 rows × 64 columns on AVX-512 (6 × 16 on AVX2), or more rows where fewer columns
/// are left (12 × 16 for a 16-channel convolution), keep every accumulator in a register
/// across the whole `k` loop.
#[allow(clippy::too_many_arguments)]
pub fn gemm_f32(
    x: &[f32],
    m: usize,
    k: usize,
    panels: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> Ran {
    gemm_f32_rows(x, k, [m, k, n], panels, (bias, residual), epilogue, (out, n))
}

/// [`gemm_f32`] over rows of `x` that are `ld` elements apart (`ld >= k`: a 1×1
/// convolution on a channel slice of a channels-last tensor, a `chunk` of its channels),
/// into rows of `out.0` that are `out.1` apart (`>= n`: a convolution writing its channels
/// of a concatenation, `plan::concat`; a residual is laid out as `out`).
pub fn gemm_f32_rows(
    x: &[f32],
    ld: usize,
    [m, k, n]: [usize; 3],
    panels: &[f32],
    (bias, residual): (Option<&[f32]>, Option<&[f32]>),
    epilogue: Epilogue,
    (out, ldo): (&mut [f32], usize),
) -> Ran {
    let fits = rows_fit(x.len(), [m, k], ld)
        && panels.len() >= panels_len(k, n)
        && results_fit([m, n], ldo, bias, residual, out.len());
    let t = super::table_if(fits)?;
    let (bias, residual) = addends((bias, residual));
    let (scale, sums) = (std::ptr::null(), std::ptr::null());
    let shape = Shape { taps: 1, cin: k, n, ldo, bias, scale, sums, residual, epilogue, requant: None };
    // SAFETY: the table's functions run on this CPU; every slice holds what the shapes say
    // (checked).
    unsafe { columns(t.gemm_block, Source::Dense(Dense { x: x.as_ptr(), ld }), m, &shape, panels, out) };
    Ok(())
}

/// `out[m, n] = x[m, k] @ panels` on `block` (a kernel table's GEMM): for a kernel that runs
/// products of its own (Winograd's) on the table it was called with.
///
/// # Safety
/// `block` runs on this CPU; `x`, `panels` and `out` hold `m * k`, [`panels_len`] and `m * n`
/// elements.
pub(super) unsafe fn product(
    block: Block<f32>,
    x: &[f32],
    m: usize,
    k: usize,
    panels: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let null = std::ptr::null();
    let shape = Shape {
        taps: 1,
        cin: k,
        n,
        ldo: n,
        bias: null,
        scale: null,
        sums: std::ptr::null(),
        residual: null,
        epilogue: Epilogue::None,
        requant: None,
    };
    // SAFETY: as the caller guarantees.
    unsafe { columns(block, Source::Dense(Dense { x: x.as_ptr(), ld: k }), m, &shape, panels, out) }
}

/// An indirect convolution's table: for each of the `m` output pixels (of `[ho, wo]`
/// images) and each tap of the kernel, `first + p * stride` for the input pixel `p` it reads
/// (of `[h, w]` images, counted across the batch), or `padding` for a tap in the padding;
/// split across threads. A tap row whose taps all lie inside the image is a run of
/// consecutive pixels, and each pixel's position is counted on from the last, not divided
/// out (measured: 1.7 ns an entry with a bounds check per tap, 48 µs of a 310 µs int8
/// convolution; 15% of a 16 → 64 channel 3×3 convolution's time at 55×55 before the
/// counting, 8% after).
pub(super) fn tap_table<T>(
    m: usize,
    [h, w]: [usize; 2],
    [ho, wo]: [usize; 2],
    g: &Conv2d,
    (first, stride, padding): (*const T, usize, *const T),
) -> Vec<*const T> {
    let taps = g.kernel[0] * g.kernel[1];
    let mut table = vec![padding; m * taps];
    let geometry = TapGeometry { image: [h, w], out: [ho, wo], g: *g };
    let first = super::parallel::Shared(first.cast_mut());
    // An entry costs about what 20 of the GEMM's flops do (0.5 ns).
    super::parallel::units(&mut table, taps, TAP_WORK * taps, &|start, entries| {
        geometry.fill(start, entries, (first, stride))
    });
    table
}

/// The work an entry of [`tap_table`] counts.
pub(super) const TAP_WORK: usize = 20;

/// Where an indirect convolution's taps lie: its input images' `[h, w]`, its output's `[ho,
/// wo]` and its kernel, stride and padding ([`tap_table`]).
#[derive(Clone, Copy)]
pub(super) struct TapGeometry {
    pub(super) image: [usize; 2],
    pub(super) out: [usize; 2],
    pub(super) g: Conv2d,
}

impl TapGeometry {
    /// [`tap_table`]'s entries of the output pixels from `start` that `entries` holds (whole
    /// pixels' taps), those in the padding left as they are.
    pub(super) fn fill<T>(
        self,
        start: usize,
        entries: &mut [*const T],
        (first, stride): (super::parallel::Shared<T>, usize),
    ) {
        let ([h, w], [ho, wo], g) = (self.image, self.out, &self.g);
        let ([kh, kw], [sh, sw], [ph, pw]) = (g.kernel, g.stride, g.padding);
        // The chunk's first output pixel; the later ones by counting (no division per pixel).
        let (mut b, mut oy, mut ox) = (start / (ho * wo), start / wo % ho, start % wo);
        for entries in entries.chunks_exact_mut(kh * kw) {
            // The first input column, where the kernel's columns all lie inside the image.
            let x0 = (ox * sw).checked_sub(pw).filter(|&x0| x0 + kw <= w);
            for (i, row) in entries.chunks_exact_mut(kw).enumerate() {
                let Some(iy) = (oy * sh + i).checked_sub(ph).filter(|&y| y < h) else { continue };
                let line = (b * h + iy) * w;
                match x0 {
                    // A run of consecutive input pixels.
                    Some(x0) => {
                        let mut p = first.at((line + x0) * stride).cast_const();
                        for e in row {
                            *e = p;
                            p = p.wrapping_add(stride);
                        }
                    }
                    None => {
                        for (j, e) in row.iter_mut().enumerate() {
                            if let Some(ix) = (ox * sw + j).checked_sub(pw).filter(|&x| x < w) {
                                *e = first.at((line + ix) * stride).cast_const();
                            }
                        }
                    }
                }
            }
            ox += 1;
            if ox == wo {
                (ox, oy) = (0, oy + 1);
                if oy == ho {
                    (oy, b) = (0, b + 1);
                }
            }
        }
    }
}

/// A convolution over channels-last images (`x`: `[batch, h, w, cin]`) as an indirect GEMM:
/// im2col's product of each output pixel's patch (`kh * kw * cin` values, zeros in the
/// padding) with the weight's `panels` (the `[kh * kw * cin, cout]` matrix of
/// [`pack_conv_panels`]), plus the bias, then `epilogue`, into `out` (`[batch, ho, wo,
/// cout]`); but the GEMM's tiles read each pixel's taps through a table of pointers (one per
/// pixel and tap: the input pixel's `cin` channels, or a row of zeros for a tap in the
/// padding), so no patch is ever copied (3–7% faster than gathering patches into a buffer
/// that stays in L2). `residual`, if any, is added before the epilogue, as [`gemm_f32`] adds
/// it. Declines (writing nothing) where the slices don't fit the shapes or kwexport's
/// kernels don't run on this CPU.
#[allow(clippy::too_many_arguments)]
pub fn indirect_f32(
    x: &[f32],
    dims: [usize; 3],
    panels: &[f32],
    g: &Conv2d,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> Ran {
    indirect_f32_strided(x, dims, panels, g, (bias, residual), epilogue, (out, g.out_channels))
}

/// [`indirect_f32`] into output pixels `out.1` elements apart (`>= out_channels`: a
/// convolution writing its channels of a concatenation, `plan::concat`); a residual is laid
/// out as `out`.
pub fn indirect_f32_strided(
    x: &[f32],
    [batch, h, w]: [usize; 3],
    panels: &[f32],
    g: &Conv2d,
    (bias, residual): (Option<&[f32]>, Option<&[f32]>),
    epilogue: Epilogue,
    (out, ldo): (&mut [f32], usize),
) -> Ran {
    let (cin, n, k, groups) = (g.in_channels, g.out_channels, g.taps(), g.groups);
    let Some([ho, wo]) = g.output(h, w) else { return Err(Declined::Shapes) };
    let m = batch * ho * wo;
    let packed = grouped_pack_size([n, cin / groups, g.kernel[0], g.kernel[1]], groups);
    let fits = x.len() >= batch * h * w * cin
        && panels.len() >= packed.iter().product()
        && results_fit([m, n], ldo, bias, residual, out.len());
    let t = super::table_if(fits)?;
    let taps = g.kernel[0] * g.kernel[1];
    let zeros = vec![0f32; cin];
    let table = tap_table(m, [h, w], [ho, wo], g, (x.as_ptr(), cin, zeros.as_ptr()));
    let (bias, residual) = addends((bias, residual));
    let (per_in, per_out) = (cin / groups, n / groups);
    let (scale, sums) = (std::ptr::null(), std::ptr::null());
    let shape = Shape { taps, cin: per_in, n: per_out, ldo, bias, scale, sums, residual, epilogue, requant: None };
    let table = Table { table: table.as_ptr(), taps, offset: 0 };
    if groups == 1 {
        // SAFETY: the table's functions run on this CPU; every pointer of the table starts
        // `cin` readable floats (of `x`, or of `zeros`, alive until the end of this
        // function), and the other slices hold what the shapes say (checked).
        unsafe { columns(t.gemm_block, Source::Table(table), m, &shape, panels, out) };
        return Ok(());
    }
    let group_panels = panels_len(k, per_out);
    // SAFETY: as for one group; each group's panels are `group_panels` floats from its first.
    unsafe {
        let geometry = [groups, per_in, k, 2 * m * k * n];
        grouped(t.gemm_block, table, m, &shape, geometry, (panels, group_panels, group_panels), out)
    };
    Ok(())
}

/// A grouped convolution's GEMMs, one per group: the rows of `table` from the group's first
/// element (`per_in` elements a group, inside each pixel's row) times the group's panels (the
/// first `len` of `stride` elements a group), `depth` deep, into the group's `s.n` output
/// columns of rows `s.ldo` apart (all groups' columns), the bias, residual, scales and sums
/// moved to those columns; each thread takes a share of the rows over every group, as many
/// threads as `flops` (the whole convolution's multiply-adds, twice) give work. Threads that
/// took whole groups wrote columns of the same cache lines (RegNet's groups of 8 outputs are
/// half a line): int8, 3 groups of 8 at 56×56 on a Zen 4, one thread's group took 235 µs
/// beside the other's two where one thread ran all three in 132.
///
/// # Safety
/// `block` runs on this CPU; every pointer of the table starts a row holding all `groups *
/// per_in` elements; `panels` holds `groups` groups' panels, `s`'s per-column values and
/// residual all groups' columns, `out` `m` rows of `s.ldo`.
pub(super) unsafe fn grouped<X: Sync>(
    block: Block<X>,
    table: Table<X>,
    m: usize,
    s: &Shape,
    [groups, per_in, depth, flops]: [usize; 4],
    (panels, stride, len): (&[X], usize, usize),
    out: &mut [f32],
) {
    let (per_out, op, shape) = (s.n, Out(out.as_mut_ptr()), *s);
    let threads = super::parallel::share(flops, m.div_ceil(ROW_CHUNK), super::parallel::threads());
    let share = m.div_ceil(threads);
    let per = if share >= 8 * ROW_CHUNK { share.next_multiple_of(ROW_CHUNK) } else { share };
    super::parallel::for_each(m.div_ceil(per.max(1)), threads, &|begin, end| {
        // Whole values, not their fields (raw pointers), cross to the threads.
        let (Out(out), table, shape) = (op, table, shape);
        let range = begin * per..(end * per).min(m);
        for group in 0..groups {
            let columns = group * per_out;
            let at = |p: *const f32| if p.is_null() { p } else { p.wrapping_add(columns) };
            let sums = if shape.sums.is_null() { shape.sums } else { shape.sums.wrapping_add(columns) };
            let (bias, scale, residual) = (at(shape.bias), at(shape.scale), at(shape.residual));
            let s = Shape { bias, scale, sums, residual, ..shape };
            let rows = Source::Table(Table { offset: group * per_in, ..table });
            let ps = &panels[group * stride..][..len];
            for j in (0..per_out).step_by(PANEL) {
                // SAFETY: as for one GEMM, with the table's pointers moved to the group's
                // elements, the per-column values, the residual and the output to its
                // columns, and its own panels; no other group writes those columns.
                unsafe { block(rows, range.clone(), &s, ps, Out(out.add(columns)), j, depth) };
            }
        }
    });
}

/// A convolution's `[out, in, kh, kw]` weight (at element `strides`: contiguous or
/// channels-last) as the GEMM's panels of its `[kh * kw * in, out]` matrix, whose rows follow
/// [`indirect_f32`]'s patches: row `(i * kw + j) * in + c` holds the weights of input channel
/// `c` at tap `(i, j)`, in the kernels' [`Strips`]. `panels` holds [`pack_size`]'s elements;
/// past `n` they are zero.
pub fn pack_conv_panels(w: &[f32], shape: [usize; 4], strides: [usize; 4], panels: &mut [f32]) {
    let [n, cin, kh, kw] = shape;
    let k = cin * kh * kw;
    let strips = Strips::current(k);
    for (p, panel) in panels.chunks_exact_mut(k * PANEL).take(n.div_ceil(PANEL)).enumerate() {
        for r in 0..k {
            let (i, j, c) = (r / (kw * cin), r / cin % kw, r % cin);
            for col in 0..PANEL {
                let o = p * PANEL + col;
                panel[strips.at(r, col)] =
                    if o < n { w[o * strides[0] + c * strides[1] + i * strides[2] + j * strides[3]] } else { 0.0 };
            }
        }
    }
}

/// [`pack_conv_panels`] for a weight of `groups` groups (`[n, cin, kh, kw]`, `cin` per group):
/// each group's `n / groups` outputs as a weight of their own, packed one group after
/// another ([`grouped_pack_size`]), as [`indirect_f32`] reads them.
pub fn pack_grouped_panels(
    w: &[f32],
    [n, cin, kh, kw]: [usize; 4],
    strides: [usize; 4],
    groups: usize,
    panels: &mut [f32],
) {
    let per_out = n / groups.max(1);
    let size: usize = pack_size([per_out, cin, kh, kw]).iter().product();
    if size == 0 {
        return;
    }
    for (group, dst) in panels.chunks_exact_mut(size).take(groups).enumerate() {
        pack_conv_panels(&w[group * per_out * strides[0]..], [per_out, cin, kh, kw], strides, dst);
    }
}

/// What a GEMM multiplies and how its tiles sum it on `S`'s vectors: the micro-kernel of
/// one element type (and, where an instruction set has its own, of that set), so that the
/// driver below is written once.
///
/// # Safety
/// The methods may use `S`'s instructions (see [`Simd`]); the pointer one reads `S::LANES`
/// elements.
pub(super) unsafe trait Dot<S: Simd>: Copy + 'static {
    /// An element of a row: a value, or a pair.
    type X: Copy + Sync + 'static;
    /// An element of a panel row, for the row element it multiplies: the same type, except
    /// for int8 pairs, whose weight is stored at a byte a value and widened as it loads.
    type P: Copy + 'static;
    /// `S::LANES` sums.
    type Acc: Copy;
    /// `S::LANES` elements of a panel row, or one row element in every lane.
    type W: Copy;
    /// The sums a tile starts from, given its columns' bias and integer starting sums (the
    /// bits of int32 lanes, [`Shape::sums`]), where given.
    unsafe fn start(bias: Option<S::V>, sums: Option<S::V>) -> Self::Acc;
    /// `S::LANES` elements of a panel row.
    unsafe fn load(p: *const Self::P) -> Self::W;
    /// One element of a row, in every lane.
    unsafe fn splat(x: Self::X) -> Self::W;
    /// `acc + a * w`, per lane (a pair's two products where elements are pairs).
    unsafe fn madd(acc: Self::Acc, a: Self::W, w: Self::W) -> Self::Acc;
    /// The sums as float32 results, given the columns' scales and bias (if any).
    unsafe fn finish(acc: Self::Acc, scale: Option<S::V>, bias: Option<S::V>) -> S::V;
}

/// Float32 values, fused-multiply-added from the bias on (the float32 GEMM).
#[derive(Clone, Copy)]
pub(super) struct F32;

// SAFETY: each method is `S`'s operation of the same name.
unsafe impl<S: Simd> Dot<S> for F32 {
    type X = f32;
    type P = f32;
    type Acc = S::V;
    type W = S::V;
    #[inline(always)]
    unsafe fn start(bias: Option<S::V>, _: Option<S::V>) -> S::V {
        // SAFETY: the trait's contract.
        bias.unwrap_or_else(|| unsafe { S::zero() })
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> S::V {
        // SAFETY: the trait's contract.
        unsafe { S::load(p) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> S::V {
        // SAFETY: the trait's contract.
        unsafe { S::splat(x) }
    }
    #[inline(always)]
    unsafe fn madd(acc: S::V, a: S::V, w: S::V) -> S::V {
        // SAFETY: the trait's contract.
        unsafe { S::fma(a, w, acc) }
    }
    #[inline(always)]
    unsafe fn finish(acc: S::V, _: Option<S::V>, _: Option<S::V>) -> S::V {
        acc
    }
}

/// Pairs of bfloat16, their products summed in float32 from the bias on (the bfloat16 GEMM,
/// `super::bf16`): on any instruction set, each half widened exactly to float32 and
/// fused-multiply-added ([`Simd::dot_bf16`]); AVX512-BF16's `vdpbf16ps` is
/// `super::bf16::Native`.
#[derive(Clone, Copy)]
pub(super) struct Bf16;

// SAFETY: each method is `S`'s operations on pairs and float32 vectors.
unsafe impl<S: Simd> Dot<S> for Bf16 {
    type X = u32;
    type P = u32;
    type Acc = S::V;
    type W = S::I;
    #[inline(always)]
    unsafe fn start(bias: Option<S::V>, _: Option<S::V>) -> S::V {
        // SAFETY: the trait's contract.
        bias.unwrap_or_else(|| unsafe { S::zero() })
    }
    #[inline(always)]
    unsafe fn load(p: *const u32) -> S::I {
        // SAFETY: the trait's contract.
        unsafe { S::load_pairs(p) }
    }
    #[inline(always)]
    unsafe fn splat(x: u32) -> S::I {
        // SAFETY: the trait's contract.
        unsafe { S::splat_pair(x) }
    }
    #[inline(always)]
    unsafe fn madd(acc: S::V, a: S::I, w: S::I) -> S::V {
        // SAFETY: the trait's contract.
        unsafe { S::dot_bf16(acc, a, w) }
    }
    #[inline(always)]
    unsafe fn finish(acc: S::V, _: Option<S::V>, _: Option<S::V>) -> S::V {
        acc
    }
}

/// Rows of int16 pairs (two int8 levels with their zero points taken out) times a weight of
/// int8 pairs (a byte a value, widened to int16 as it loads: half the bytes of int16 pairs
/// to hold and to stream), summed exactly in int32, then scaled per column and biased in
/// float32 (the int8 GEMM, `super::int8`).
#[derive(Clone, Copy)]
pub(super) struct Pairs;

// SAFETY: each method is `S`'s integer operations on pairs, then float32 arithmetic.
unsafe impl<S: Simd> Dot<S> for Pairs {
    type X = u32;
    type P = u16;
    type Acc = S::I;
    type W = S::I;
    #[inline(always)]
    unsafe fn start(_: Option<S::V>, _: Option<S::V>) -> S::I {
        // SAFETY: the trait's contract.
        unsafe { S::izero() }
    }
    #[inline(always)]
    unsafe fn load(p: *const u16) -> S::I {
        // SAFETY: the trait's contract.
        unsafe { S::load_byte_pairs(p) }
    }
    #[inline(always)]
    unsafe fn splat(x: u32) -> S::I {
        // SAFETY: the trait's contract.
        unsafe { S::splat_pair(x) }
    }
    #[inline(always)]
    unsafe fn madd(acc: S::I, a: S::I, w: S::I) -> S::I {
        // SAFETY: the trait's contract.
        unsafe { S::dot_pairs(acc, a, w) }
    }
    #[inline(always)]
    unsafe fn finish(acc: S::I, scale: Option<S::V>, bias: Option<S::V>) -> S::V {
        // SAFETY (all below): the trait's contract.
        unsafe {
            let sums = S::to_float(acc);
            let scaled = match scale {
                Some(s) => S::mul(sums, s),
                None => sums,
            };
            match bias {
                Some(b) => S::add(scaled, b),
                None => scaled,
            }
        }
    }
}

/// Rows of int16 pairs times a weight of int16 pairs, summed exactly in int32 and stored as
/// the sums' bits, unscaled (the int8 Winograd convolution's products, `super::int8::winograd`,
/// whose transformed weights need 16 bits): the shape's scales, bias, epilogue and
/// requantization must be absent, which [`Words::shape`] gives.
#[derive(Clone, Copy)]
pub(super) struct Words;

impl Words {
    /// A shape for these products: `[rows' groups of pairs, columns]`, nothing applied to the
    /// sums.
    pub(super) fn shape(words: usize, n: usize) -> Shape {
        let null = std::ptr::null();
        let (bias, scale, sums, residual) = (null, null, std::ptr::null(), null);
        Shape { taps: 1, cin: words, n, ldo: n, bias, scale, sums, residual, epilogue: Epilogue::None, requant: None }
    }
}

// SAFETY: each method is `S`'s integer operations on pairs; `finish` moves bits only.
unsafe impl<S: Simd> Dot<S> for Words {
    type X = u32;
    type P = u32;
    type Acc = S::I;
    type W = S::I;
    #[inline(always)]
    unsafe fn start(_: Option<S::V>, _: Option<S::V>) -> S::I {
        // SAFETY: the trait's contract.
        unsafe { S::izero() }
    }
    #[inline(always)]
    unsafe fn load(p: *const u32) -> S::I {
        // SAFETY: the trait's contract.
        unsafe { S::load_pairs(p) }
    }
    #[inline(always)]
    unsafe fn splat(x: u32) -> S::I {
        // SAFETY: the trait's contract.
        unsafe { S::splat_pair(x) }
    }
    #[inline(always)]
    unsafe fn madd(acc: S::I, a: S::I, w: S::I) -> S::I {
        // SAFETY: the trait's contract.
        unsafe { S::dot_pairs(acc, a, w) }
    }
    #[inline(always)]
    unsafe fn finish(acc: S::I, _: Option<S::V>, _: Option<S::V>) -> S::V {
        // SAFETY: the trait's contract.
        unsafe { S::bits(acc) }
    }
}

/// Where a GEMM tile reads each row's elements: `taps` runs of `cin` per row, which the
/// weight's panel rows follow in order.
pub(super) trait Rows<X>: Copy {
    /// The first of row `r`'s elements for tap `t`.
    ///
    /// # Safety
    /// Row `r` and tap `t` must exist.
    unsafe fn at(self, r: usize, t: usize) -> *const X;
}

/// The rows of an `[m, k]` matrix, one tap each, `ld` elements apart (`k` where dense; more
/// for a channel slice of a channels-last tensor).
pub(super) struct Dense<X> {
    pub(super) x: *const X,
    pub(super) ld: usize,
}

impl<X> Clone for Dense<X> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<X> Copy for Dense<X> {}

impl<X> Rows<X> for Dense<X> {
    #[inline(always)]
    unsafe fn at(self, r: usize, _: usize) -> *const X {
        // SAFETY: row `r` exists (the caller's).
        unsafe { self.x.add(r * self.ld) }
    }
}

/// Rows read through a table of pointers, `taps` per row, each `offset` elements on (a
/// group's first channel; [`indirect_f32`]).
pub(super) struct Table<X> {
    pub(super) table: *const *const X,
    pub(super) taps: usize,
    pub(super) offset: usize,
}

impl<X> Clone for Table<X> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<X> Copy for Table<X> {}

impl<X> Rows<X> for Table<X> {
    #[inline(always)]
    unsafe fn at(self, r: usize, t: usize) -> *const X {
        // SAFETY: entry `(r, t)` exists, and its run from `offset` (the caller's).
        unsafe { (*self.table.add(r * self.taps + t)).add(self.offset) }
    }
}

/// A GEMM's rows, dense or through a table (one type for the kernel table's entry; each
/// block's tiles are instantiated for the one it is).
pub(super) enum Source<X> {
    Dense(Dense<X>),
    Table(Table<X>),
}

impl<X> Clone for Source<X> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<X> Copy for Source<X> {}

/// A GEMM's shape besides its rows: taps and elements per tap of each row, the output's
/// width, the bias and the per-column scales (or null) and the epilogue.
#[derive(Clone, Copy)]
pub(super) struct Shape {
    pub(super) taps: usize,
    pub(super) cin: usize,
    pub(super) n: usize,
    /// The elements from one row of the output (and of the residual) to the next: `n`, or
    /// all groups' columns where the GEMM is one group's.
    pub(super) ldo: usize,
    pub(super) bias: *const f32,
    /// `n` values the sums are multiplied by before the bias (the int8 GEMM's), or null.
    pub(super) scale: *const f32,
    /// `n` int32 sums each column's starts from (the int8 GEMM's zero-point correction,
    /// `super::int8`), or null.
    pub(super) sums: *const i32,
    /// `m * n` values added to the results before the epilogue, or null.
    pub(super) residual: *const f32,
    pub(super) epilogue: Epilogue,
    /// A fake quantization of each result after the epilogue (the int8 linear's `output`), or
    /// none.
    pub(super) requant: Option<super::int8::Requant>,
}

impl Shape {
    /// The shape of the GEMM whose output's (and residual's) rows start at row `first` of
    /// this one's.
    pub(super) fn rows_from(&self, first: usize) -> Shape {
        let residual = match self.residual.is_null() {
            true => self.residual,
            false => self.residual.wrapping_add(first * self.ldo),
        };
        Shape { residual, ..*self }
    }
}

/// A bias and a residual as the tiles read them (null where absent).
fn addends((bias, residual): (Option<&[f32]>, Option<&[f32]>)) -> (*const f32, *const f32) {
    let at = |s: Option<&[f32]>| s.map_or(std::ptr::null(), |s| s.as_ptr());
    (at(bias), at(residual))
}

/// The output's first element, shared by the threads of one GEMM: each writes the rows
/// and columns of its own blocks only.
#[derive(Clone, Copy)]
pub(super) struct Out(pub(super) *mut f32);

// SAFETY: the threads of one call write disjoint elements through it (`columns`), and the
// call returns only once every thread has finished.
unsafe impl Sync for Out {}

impl Out {
    /// The output from element `i` on (a method, so closures capture the whole `Sync` value).
    pub(super) fn at(self, i: usize) -> Out {
        Out(self.0.wrapping_add(i))
    }
}
// SAFETY: the tables and shapes point at memory the caller keeps alive and unwritten for
// the whole call; the threads only read through them.
unsafe impl<X> Sync for Source<X> {}
// SAFETY: as for `Source`.
unsafe impl<X> Sync for Table<X> {}
// SAFETY: as for `Source`.
unsafe impl<X> Sync for Dense<X> {}
// SAFETY: as for `Source`.
unsafe impl Sync for Shape {}

/// One block of a GEMM, as the kernel table holds it: rows `range` of `source` times the
/// column block from `j` (of `k`-deep panels), into the output.
pub(super) type Block<X> = unsafe fn(Source<X>, std::ops::Range<usize>, &Shape, &[X], Out, usize, usize);

/// A multiple of every tile's height, to which a thread's share of the rows is rounded where
/// it is large.
const ROW_CHUNK: usize = 24;

/// The GEMM's column blocks, outermost: a block's `k x 64` panel of the weight stays in
/// cache while every group of rows reads it, so the weight streams from memory once per
/// call. On several threads (`super::parallel`), each takes whole column blocks (its own
/// share of the weight) where the blocks share out evenly; otherwise each takes an equal
/// share of the rows over every block.
///
/// # Safety
/// `block` runs on this CPU; the rows, panels and output hold what the shape says.
pub(super) unsafe fn columns<X: Sync>(
    block: Block<X>,
    source: Source<X>,
    m: usize,
    s: &Shape,
    panels: &[X],
    out: &mut [f32],
) {
    let (k, op) = (s.taps * s.cin, Out(out.as_mut_ptr()));
    each_block(m, s, &|range, j| {
        // SAFETY: the block's rows and columns exist and no other item writes them.
        unsafe { block(source, range, s, panels, op, j, k) };
    });
}

/// The column blocks and row ranges of an `m`-row GEMM of shape `s`, each given to `body`
/// (rows, first column) on the pool's threads as [`columns`] shares them out: whole column
/// blocks a thread, or an equal share of the rows over every block.
pub(super) fn each_block(m: usize, s: &Shape, body: &(dyn Fn(std::ops::Range<usize>, usize) + Sync)) {
    let k = s.taps * s.cin;
    let blocks = s.n.div_ceil(PANEL);
    let threads = super::parallel::share(2 * m * k * s.n, blocks * m.div_ceil(ROW_CHUNK), super::parallel::threads());
    // Each thread takes whole column blocks (its own panels, which matters for a large
    // weight) where they share out evenly: as many full blocks per thread, or so many blocks
    // that one more or less is little. Otherwise, and wherever the rows outweigh the weight
    // (a convolution's pixels), each thread takes a share of the rows over every block: 3
    // blocks on 2 threads (144 columns, a MobileNet's 1×1) had left one thread 16 columns to
    // the other's 128, and a thread that shares the rows reads and writes the ones the
    // elementwise kernels and convolutions before and after it gave that thread, still in
    // its cache (resnet18 int8 at 224 pixels, two threads: 0.96× the call with its 128-column
    // 3×3s split by blocks). A share is rounded to whole chunks of tiles only where that
    // moves little work.
    let rows_outweigh = m * (k + s.n) > k * s.n;
    let by_blocks =
        !rows_outweigh && ((blocks.is_multiple_of(threads) && s.n.is_multiple_of(PANEL)) || blocks >= 8 * threads);
    let share = m.div_ceil(if by_blocks { 1 } else { threads });
    let per = if share >= 8 * ROW_CHUNK { share.next_multiple_of(ROW_CHUNK) } else { share };
    let chunks = m.div_ceil(per.max(1));
    super::parallel::for_each(blocks * chunks, threads, &|begin, end| {
        for item in begin..end {
            let (j, r0) = (item % blocks * PANEL, item / blocks * per);
            body(r0..(r0 + per).min(m), j);
        }
    });
}

/// Rows `range` times the column block from `j`, then GELU over their results while they
/// are in cache (the other epilogues are applied as the tiles store), and after it the
/// requantization if any: the kernel table's [`Block`].
///
/// # Safety
/// `S`'s features must be enabled; the rows, the block's columns and its panel exist.
#[inline(always)]
pub(super) unsafe fn block<S: Simd, D: Dot<S>>(
    source: Source<D::X>,
    range: std::ops::Range<usize>,
    s: &Shape,
    panels: &[D::X],
    op: Out,
    j: usize,
    k: usize,
) {
    let tiles = tiles_shape(s);
    // SAFETY (all below): as the caller guarantees.
    unsafe {
        match source {
            Source::Dense(d) => columns_block::<S, D, _>(d, range.clone(), &tiles, panels, op.0, j, k),
            Source::Table(t) => columns_block::<S, D, _>(t, range.clone(), &tiles, panels, op.0, j, k),
        }
        gelu_pass::<S>(s, range, op, j);
    }
}

/// The shape a block's tiles store by: `s`, less GELU and the requantization after it, which
/// [`gelu_pass`] applies (GELU's polynomial would crowd the tiles' registers).
pub(super) fn tiles_shape(s: &Shape) -> Shape {
    match s.epilogue {
        Epilogue::Gelu | Epilogue::GeluTanh => Shape { epilogue: Epilogue::None, requant: None, ..*s },
        _ => *s,
    }
}

/// Where `s`'s epilogue is GELU, GELU and the requantization over the block's results (rows
/// `range`, the columns from `j`), stored by tiles of [`tiles_shape`], while they are in cache.
/// (Not a closure around the tiles: a closure doesn't inherit its caller's target features.)
///
/// # Safety
/// `S`'s features must be enabled; the block's rows and columns of the output exist.
#[inline(always)]
pub(super) unsafe fn gelu_pass<S: Simd>(s: &Shape, range: std::ops::Range<usize>, op: Out, j: usize) {
    if !matches!(s.epilogue, Epilogue::Gelu | Epilogue::GeluTanh) {
        return;
    }
    let width = (s.n - j).min(PANEL);
    for r in range {
        // SAFETY: this row's part of the block, written by its tiles and by no other thread.
        unsafe {
            let row = std::slice::from_raw_parts_mut(op.0.add(r * s.ldo + j), width);
            epilogue_slice::<S>(s.epilogue, row);
            if let Some(q) = &s.requant {
                q.apply_slice::<S>(row);
            }
        }
    }
}

/// Rows `range` times the column block from `j` (of `k`-deep panels), in column tiles as
/// wide as the instruction set's registers hold: the whole 64 on AVX-512, 16 on AVX2 (32
/// for one or two rows), each reading its [`Strips`] of the panel in order.
#[inline(always)]
unsafe fn columns_block<S: Simd, D: Dot<S>, R: Rows<D::X>>(
    rows_of: R,
    range: std::ops::Range<usize>,
    s: &Shape,
    panels: &[D::X],
    op: *mut f32,
    j: usize,
    k: usize,
) {
    let (wide, width) = (S::REGISTERS >= 32, (s.n - j).min(PANEL));
    // With 16 registers, one or two rows take 4 vectors at once (a GEMV streams its weight:
    // fewer, longer passes over each panel row), more rows 2 (6 rows × 2 vectors).
    let few = range.len() <= 2;
    let step = if wide {
        PANEL
    } else if few {
        4 * S::LANES
    } else {
        2 * S::LANES
    };
    let mut sub = 0;
    while sub < width {
        // A tile narrower than the widest (the last, or a small `n`: a 1x1 convolution's
        // 16-48 channels) holds fewer vectors per row, so more rows fit the registers.
        let vectors = (width - sub).min(step).div_ceil(S::LANES);
        // SAFETY: columns from j + sub and their panel exist (see the callers).
        unsafe {
            // Panels of `D::P`s, in the `D::X`s they are stored in (int8 pairs two to a
            // word), at an alignment a `D::P`'s at most.
            let wp = panels.as_ptr().cast::<D::P>().add(j / PANEL * k * PANEL);
            let (jj, range) = (j + sub, range.clone());
            match (wide, vectors) {
                (true, 4) => rows::<S, D, R, 6, 5, 4>(rows_of, range, wp, op, s, jj),
                (true, 3) => rows::<S, D, R, 8, 7, 3>(rows_of, range, wp, op, s, jj),
                (false, 3 | 4) => rows::<S, D, R, 2, 1, 4>(rows_of, range, wp, op, s, jj),
                (_, 2) if wide => rows::<S, D, R, 12, 11, 2>(rows_of, range, wp, op, s, jj),
                (_, 2) => rows::<S, D, R, 6, 5, 2>(rows_of, range, wp, op, s, jj),
                _ => rows::<S, D, R, 12, 11, 1>(rows_of, range, wp, op, s, jj),
            }
        }
        sub += step;
    }
}

/// Rows `range` times `V` vectors of the panel at `wp` (columns from `j`, of all the
/// panels' columns): tiles of `T`
/// rows, then the remainder in tiles of 4 (where `T` is taller), 2 and 1. A remainder of 1
/// to 3 rows would run on tiles of too few sums to hide the FMAs' latency (a 1-row tile at
/// a quarter of the speed), so where every tile can be `T` or `U` (`T - 1`) rows the tiles
/// are balanced instead: a 7×7 image's 49 pixels as 5 × 5 + 4 × 6, not 8 × 6 + 1.
#[inline(always)]
unsafe fn rows<S: Simd, D: Dot<S>, R: Rows<D::X>, const T: usize, const U: usize, const V: usize>(
    rows_of: R,
    range: std::ops::Range<usize>,
    wp: *const D::P,
    op: *mut f32,
    s: &Shape,
    j: usize,
) {
    let (mut i, m) = (range.start, range.end);
    let (len, tiles) = (m - i, (m - i).div_ceil(T));
    // On AVX2 a strip of the panel (16 columns, `k` rows: 16 KB at k = 256) comes from memory
    // in the first tile of rows over it and from L1 in the others, during which the memory
    // sits idle. Where there are other tiles, the second asks for the next strip (stored
    // right after this one) in L2, a line per step of `k`, so the first tile over it finds
    // it there: a chain of GPT-2-sized linears at 12 and 32 rows whose 12.6 MB of weight
    // streams from memory took 0.81–1.01× its time, weights that stay in L3 1.01–1.08×
    // (BENCHMARKS.md). Every tile asking was slower where a strip doesn't fit L1.
    let (first, ahead) = (i, strip::<S>() < PANEL && len > T);
    let second = |i: usize| ahead && i > first && i <= first + T;
    // SAFETY (all below): rows [i, i + tile) and their outputs exist (see the callers).
    unsafe {
        if T > 4 && (1..4).contains(&(len % T)) && tiles * U <= len {
            // `tiles * T - len` tiles of `U`, then the others of `T` end exactly at `m`.
            for _ in 0..tiles * T - len {
                tile::<S, D, R, U, V>(rows_of, i, wp, op.add(i * s.ldo), s, j, second(i));
                i += U;
            }
        }
        while i + T <= m {
            tile::<S, D, R, T, V>(rows_of, i, wp, op.add(i * s.ldo), s, j, second(i));
            i += T;
        }
        // Tiles of 4 only where the main tile is taller (a shorter one would spill).
        while T > 4 && i + 4 <= m {
            tile::<S, D, R, 4, V>(rows_of, i, wp, op.add(i * s.ldo), s, j, second(i));
            i += 4;
        }
        if i + 2 <= m {
            tile::<S, D, R, 2, V>(rows_of, i, wp, op.add(i * s.ldo), s, j, second(i));
            i += 2;
        }
        if i < m {
            tile::<S, D, R, 1, V>(rows_of, i, wp, op.add(i * s.ldo), s, j, second(i));
        }
    }
}

/// Rows `[i, i + T)` times the panel's columns `[j, j + V LANES)` (zero past `n`), plus the
/// bias, then the epilogue, into `out` (row stride `n`, masked past `n`): `T * V`
/// accumulators held in registers across all the rows' taps and values, each weight
/// vector loaded once per value from its strip ([`Strips`]).
#[inline(always)]
unsafe fn tile<S: Simd, D: Dot<S>, R: Rows<D::X>, const T: usize, const V: usize>(
    rows_of: R,
    i: usize,
    panel: *const D::P,
    out: *mut f32,
    s: &Shape,
    j: usize,
    prefetch_next: bool,
) {
    // SAFETY (all below): T rows with `taps` runs of `cin` elements; the panel holds `taps *
    // cin` rows of 64 in strips; the bias and scales (where given) hold `n` values; masked
    // lanes past `n` are neither read nor written.
    unsafe {
        // Loops, not `array::from_fn`: a closure calling an intrinsic is compiled without the
        // target features wherever it isn't inlined, and the intrinsic becomes a call.
        let mut masks = [S::first(0); V];
        for (v, mask) in masks.iter_mut().enumerate() {
            *mask = S::first(s.n.saturating_sub(j + v * S::LANES));
        }
        let (mut bias, mut scale, mut sums) = ([None; V], [None; V], [None; V]);
        for v in 0..V {
            for (values, p) in [(&mut bias, s.bias), (&mut scale, s.scale), (&mut sums, s.sums.cast())] {
                if !p.is_null() {
                    values[v] = Some(S::load_masked(masks[v], p.add(j + v * S::LANES)));
                }
            }
        }
        // Each vector's column in its strip, whose rows are `strip` elements apart.
        let (strip, depth) = (strip::<S>(), s.taps * s.cin);
        let column: [*const D::P; V] = std::array::from_fn(|v| {
            let col = j % PANEL + v * S::LANES;
            panel.add(col / strip * depth * strip + col % strip)
        });
        let mut start = [D::start(bias[0], sums[0]); V];
        for v in 1..V {
            start[v] = D::start(bias[v], sums[v]);
        }
        let mut acc: [[D::Acc; V]; T] = [start; T];
        for t in 0..s.taps {
            let rows: [*const D::X; T] = std::array::from_fn(|r| rows_of.at(i + r, t));
            for c in 0..s.cin {
                let at = (t * s.cin + c) * strip;
                if prefetch_next {
                    super::prefetch_l2(column[0].wrapping_add(depth * strip + at));
                }
                let mut w = [D::load(column[0].add(at)); V];
                for v in 1..V {
                    w[v] = D::load(column[v].add(at));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let a = D::splat(*rows[r].add(c));
                    for v in 0..V {
                        row[v] = D::madd(row[v], a, w[v]);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for v in 0..V {
                let mut y = D::finish(row[v], scale[v], bias[v]);
                if !s.residual.is_null() {
                    let at = s.residual.add((i + r) * s.ldo + j + v * S::LANES);
                    y = S::add(y, S::load_masked(masks[v], at));
                }
                let mut y = apply::<S>(s.epilogue, y);
                if let Some(q) = &s.requant {
                    y = q.apply::<S>(y);
                }
                S::store_masked(out.add(r * s.ldo + j + v * S::LANES), masks[v], y);
            }
        }
    }
}
