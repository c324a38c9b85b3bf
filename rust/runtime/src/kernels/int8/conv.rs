//! An int8 convolution (`kwexport::conv_int8`, `passes::linear_int8`) as the int8 GEMM over a
//! table of pointers, the float32 indirect convolution's way (`gemm::indirect_f32`): each
//! input pixel's channels are quantized once into a row of words, and the GEMM reads each
//! output pixel's taps through a table of pointers to those rows, so no patch is copied. A
//! tap in the padding reads a row at the zero point's level, whose products the columns'
//! zero-point correction cancels, as a float32 zero would give. Each tap's channels are
//! rounded up to whole words (their weights zero), so the weight is packed as the `[n, taps *
//! words * per word]` matrix [`Layout::pack_conv`] makes.

use super::super::gemm::{self, Source, Table};
use super::super::parallel;
use super::super::{Conv2d, Declined, Ran};
use super::{quantize_band, with_rows, Layout, Packed, Products, Quant, RowsAt, QUANTIZE_WORK};
use crate::kernels::activation::Epilogue;

impl Layout {
    /// Whether a `[n, cin, kh, kw]` weight's taps are packed as whole patches: where `cin`
    /// ends inside a word (an image's 3 channels), each output pixel's patch is gathered into
    /// one dense row (`kh * kw * cin` levels, then words) rather than a word or more per tap
    /// through the pointer table (ResNet-18's 7×7 stem: 49 words and pointers a pixel against
    /// 37 words). A 1×1 weight packs alike either way.
    pub fn patches(self, [_, cin, _, _]: [usize; 4]) -> bool {
        !cin.is_multiple_of(self.per_word())
    }

    /// The depth of the matrix a `[n, cin, kh, kw]` convolution weight packs as: per tap,
    /// `cin` rounded up to whole words; or, for [`Layout::patches`], the patch's levels
    /// rounded up to whole words.
    pub fn conv_depth(self, shape @ [_, cin, kh, kw]: [usize; 4]) -> usize {
        match self.patches(shape) {
            true => (kh * kw * cin).next_multiple_of(self.per_word()),
            false => kh * kw * cin.next_multiple_of(self.per_word()),
        }
    }

    /// The words of a convolution weight [`Layout::pack_conv`] packs: one packed matrix per
    /// group (`paired`: of twice the outputs and half the depth, [`pairs_groups`]).
    pub fn conv_packed_len(self, shape: [usize; 4], groups: usize, paired: bool) -> usize {
        let (per_out, depth) = (shape[0] / groups, self.conv_depth(shape));
        match paired {
            true => groups * self.packed_len([2 * per_out, depth / 2]),
            false => groups * self.packed_len([per_out, depth]),
        }
    }

    /// An int8 `[n, cin, kh, kw]` weight of `groups` groups (`cin` channels each, at element
    /// `strides`) as, per group, the panels of its `[n / groups, conv_depth]` matrix, whose
    /// column `(i * kw + j) * cin_words + c` holds input channel `c` at tap `(i, j)` (zero
    /// for `c >= cin`; `cin_words` is `cin` itself for [`Layout::patches`]), packed by
    /// [`Layout::pack`]. A 1×1 weight packs as its `[n, cin]` matrix does. `paired` (where
    /// [`pairs_groups`] says so) packs each group's outputs in lane pairs instead
    /// ([`Layout::pack_paired`]). `packed` holds [`Layout::conv_packed_len`]'s words.
    pub fn pack_conv(
        self,
        w: &[i8],
        shape: [usize; 4],
        strides: [usize; 4],
        groups: usize,
        paired: bool,
        packed: &mut [u32],
    ) {
        if paired {
            return self.pack_paired(w, shape, strides, groups, packed);
        }
        let [n, cin, kh, kw] = shape;
        let per_tap = if self.patches(shape) { cin } else { cin.next_multiple_of(self.per_word()) };
        let (k, per_out) = (self.conv_depth(shape), n / groups);
        let len = self.packed_len([per_out, k]);
        for (group, packed) in packed.chunks_exact_mut(len).take(groups).enumerate() {
            let mut matrix = vec![0i8; per_out * k];
            for (o, row) in matrix.chunks_exact_mut(k).enumerate() {
                let o = group * per_out + o;
                for (tap, run) in row.chunks_exact_mut(per_tap).take(kh * kw).enumerate() {
                    let (i, j) = (tap / kw, tap % kw);
                    for (c, v) in run[..cin].iter_mut().enumerate() {
                        *v = w[o * strides[0] + c * strides[1] + i * strides[2] + j * strides[3]];
                    }
                }
            }
            self.pack(&matrix, [per_out, k], [k, 1], packed);
        }
    }

    /// [`Layout::pack_conv`] in lane pairs (`super::Paired`): per group, the `[2 * per_out,
    /// taps * cin / 2]` matrix whose row `2 * o + h` holds output `o`'s weights for the `h`-th
    /// word of each pair of words of each tap (channels `(2 * p + h) * 4..` at column `(tap *
    /// pairs + p) * 4..`), packed by [`Layout::pack`]; its column sums are the halves'.
    fn pack_paired(self, w: &[i8], shape: [usize; 4], strides: [usize; 4], groups: usize, packed: &mut [u32]) {
        let [n, cin, kh, kw] = shape;
        let (per_out, pairs, taps) = (n / groups, cin / 8, kh * kw);
        let k = taps * pairs * 4;
        let len = self.packed_len([2 * per_out, k]);
        for (group, packed) in packed.chunks_exact_mut(len).take(groups).enumerate() {
            let mut matrix = vec![0i8; 2 * per_out * k];
            for (row, values) in matrix.chunks_exact_mut(k).enumerate() {
                let (o, h) = (group * per_out + row / 2, row % 2);
                for (col, v) in values.iter_mut().enumerate() {
                    let (tap, p, b) = (col / 4 / pairs, col / 4 % pairs, col % 4);
                    let (c, i, j) = ((2 * p + h) * 4 + b, tap / kw, tap % kw);
                    *v = w[o * strides[0] + c * strides[1] + i * strides[2] + j * strides[3]];
                }
            }
            self.pack(&matrix, [2 * per_out, k], [k, 1], packed);
        }
    }
}

/// Whether `kernel` runs a `[n, cin, kh, kw]` weight of `groups` groups (`cin` channels
/// each) in lane pairs (`super::Paired`): groups of at most 8 outputs over whole pairs of
/// words (`cin` a multiple of 8), on a kernel that has the paired block.
fn pairs_groups_on(kernel: super::super::isa::Int8, [n, cin, kh, kw]: [usize; 4], groups: usize) -> bool {
    let layout = kernel.layout;
    let grouped = groups > 1 && n.is_multiple_of(groups) && n / groups <= 8;
    kernel.paired.is_some() && grouped && cin.is_multiple_of(8) && !layout.patches([n, cin, kh, kw])
}

/// [`pairs_groups_on`] the int8 kernel that runs `layout` on this CPU (the one [`conv`]
/// takes): whether [`Layout::pack_conv`] packs the weight in lane pairs for it.
pub fn pairs_groups(layout: Layout, shape: [usize; 4], groups: usize) -> bool {
    let kernel = super::super::isa::kernels().and_then(|t| super::super::isa::int8(t, layout));
    kernel.is_some_and(|k| k.layout == layout && pairs_groups_on(k, shape, groups))
}

/// `out[pixel, n] = epilogue(bias[n] + conv(dequantize(quantize(x)), w * w_scale[n]) +
/// residual[pixel, n])`: `x`
/// the channels-last pixels of `[batch, h, w]` images, each `g.in_channels` floats with
/// pixels `ld` elements apart, quantized by `quant`; `weight` the int8 `[n, cin / groups, kh,
/// kw]` weight packed by [`Layout::pack_conv`] (zero point 0); `out` the channels-last
/// `[batch, ho, wo, n]` result (and the residual, if any, laid out as it: a ResNet block's
/// add, `passes::conv_residual`); then, with an `output` quantization, each result quantized
/// and dequantized by it as it is stored. The same sums as the linear's ([`super::linear`]),
/// exact. With groups, one GEMM per group over its channels of each pixel's row (each thread
/// a share of the rows over every group: `gemm::grouped`), which must start on a word: declines otherwise, where the slices
/// don't fit, or where the quantizations or the layout aren't ones the kernels here take.
#[allow(clippy::too_many_arguments)]
pub fn conv(
    x: (&[f32], usize),
    dims: [usize; 3],
    g: &Conv2d,
    quant: &Quant,
    weight: Packed<'_>,
    w_scale: &[f32],
    addends: (Option<&[f32]>, Option<&[f32]>),
    post: (Epilogue, Option<&Quant>),
    out: &mut [f32],
) -> Ran {
    let kernel = super::super::isa::int8(super::super::table_if(true)?, weight.layout).ok_or(Declined::Values)?;
    conv_with(kernel, x, dims, g, quant, weight, w_scale, addends, post, out)
}

/// [`conv`] on `kernel`.
#[allow(clippy::too_many_arguments)]
fn conv_with(
    kernel: super::super::isa::Int8,
    (x, ld): (&[f32], usize),
    [batch, h, w]: [usize; 3],
    g: &Conv2d,
    quant: &Quant,
    weight: Packed<'_>,
    w_scale: &[f32],
    (bias, residual): (Option<&[f32]>, Option<&[f32]>),
    post: (Epilogue, Option<&Quant>),
    out: &mut [f32],
) -> Ran {
    let (cin, n, layout, groups) = (g.in_channels, g.out_channels, weight.layout, g.groups);
    let whole_words = groups == 1 || (cin / groups).is_multiple_of(layout.per_word());
    let Some([ho, wo]) = g.output(h, w).filter(|_| whole_words) else { return Err(Declined::Shapes) };
    let shape = [n, cin / groups, g.kernel[0], g.kernel[1]];
    let (pixels, m, k) = (batch * h * w, batch * ho * wo, layout.conv_depth(shape));
    let paired = kernel.paired.filter(|_| pairs_groups_on(kernel, shape, groups));
    let fits = gemm::rows_fit(x.len(), [pixels, cin], ld)
        && weight.words.len() >= layout.conv_packed_len(shape, groups, paired.is_some())
        && w_scale.len() >= n
        && gemm::results_fit([m, n], n, bias, residual, out.len());
    if !fits {
        return Err(Declined::Shapes);
    }
    let products = Products { kernel, quant, weight, w_scale, bias, residual, post };
    products.check(k)?;
    if layout.patches(shape) {
        return patches(&products, (x, ld), [batch, h, w], g, out);
    }
    let words = cin.div_ceil(layout.per_word());
    if g.kernel == [1, 1] && g.padding == [0, 0] && groups == 1 {
        return pointwise(&products, (x, ld), [batch, h, w], g, out);
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(ran) = shifted(&products, (x, ld), [batch, h, w], g, out) {
        return ran;
    }
    // Each pixel's levels, then the padding's row: the zero point's level less the base
    // (`Level::base`: 0 for pairs, `zero_point - qmin` in each byte for quads).
    with_rows((pixels + 1) * words, |rows| {
        let (pixel_rows, padding) = rows.split_at_mut(pixels * words);
        padding.fill(match layout {
            Layout::Quads => u32::from_le_bytes([(quant.zero_point - quant.qmin) as u8; 4]),
            Layout::Pairs => 0,
        });
        // The image's levels and the table of pointers to them in one parallel region (the
        // table only points at the rows: nothing reads them before the GEMM's region).
        let taps = g.kernel[0] * g.kernel[1];
        let (first, mut table) = (parallel::Shared(pixel_rows.as_mut_ptr()), vec![padding.as_ptr(); m * taps]);
        let geometry = gemm::TapGeometry { image: [h, w], out: [ho, wo], g: *g };
        let quantize =
            |row: usize, band: &mut [u32]| quantize_band(kernel, x, cin, quant, RowsAt::Strided(ld), row, band);
        let fill = |pixel: usize, entries: &mut [*const u32]| geometry.fill(pixel, entries, (first, words));
        let rows_job = (pixel_rows, words, QUANTIZE_WORK * cin, &quantize as &(dyn Fn(usize, &mut [u32]) + Sync));
        let fill: &(dyn Fn(usize, &mut [*const u32]) + Sync) = &fill;
        parallel::units_pair(rows_job, (&mut table, taps, gemm::TAP_WORK * taps, fill));
        let table = Table { table: table.as_ptr(), taps, offset: 0 };
        if groups == 1 {
            // SAFETY: every pointer of the table starts `words` words of `rows`, alive until
            // the end of this closure; the weight holds its panels for `[n, taps * words * per
            // word]`, and the other slices what the shapes say (checked).
            unsafe { products.run(Source::Table(table), [m, taps, words, n], out) };
            return;
        }
        let (per_out, group_words) = (n / groups, words / groups);
        if let Some(block) = paired {
            // Rows of pairs of words, and each group's matrix of twice the outputs.
            let pairs = group_words / 2;
            let group_len = layout.packed_len([2 * per_out, taps * pairs * 4]);
            let panels_len = layout.panel_words(2 * per_out, taps * pairs);
            let sum = |c: usize| {
                let sums = &weight.words[c / per_out * group_len + panels_len + 2 * (c % per_out)..];
                (sums[0] as i32).wrapping_add(sums[1] as i32) as u32
            };
            let factors = products.columns(n, sum);
            let shape = products.shape([taps, pairs, per_out, n], (&factors.0, &factors.1));
            let table = Table { table: table.table.cast::<*const [u32; 2]>(), taps, offset: 0 };
            // SAFETY: as below, the table's rows and the panels read as pairs of words
            // (`[u32; 2]`, of `u32`'s alignment): every row and the panels are whole pairs
            // (`group_words` is even, checked; a group's words are `packed_len`'s, even).
            unsafe {
                let panels =
                    std::slice::from_raw_parts(weight.words.as_ptr().cast::<[u32; 2]>(), weight.words.len() / 2);
                let geometry = [groups, pairs, taps * pairs, 2 * m * k * n];
                gemm::grouped(block, table, m, &shape, geometry, (panels, group_len / 2, panels_len / 2), out)
            };
            return;
        }
        let group_len = layout.conv_packed_len([per_out, shape[1], shape[2], shape[3]], 1, false);
        let panels_len = layout.panel_words(per_out, taps * group_words);
        let sum = |c: usize| weight.words[c / per_out * group_len + panels_len + c % per_out];
        let factors = products.columns(n, sum);
        let shape = products.shape([taps, group_words, per_out, n], (&factors.0, &factors.1));
        // SAFETY: as for one group; each group's panels are the first `panels_len` of its
        // `group_len` words (its column sums after them).
        unsafe {
            let geometry = [groups, group_words, taps * group_words, 2 * m * k * n];
            gemm::grouped(kernel.block, table, m, &shape, geometry, (weight.words, group_len, panels_len), out)
        };
    });
    Ok(())
}

/// [`conv_with`] for a 1×1 kernel without padding in one group (whole words a pixel,
/// checked): each output pixel reads one input pixel, so only those pixels are quantized,
/// into dense rows the GEMM reads as a linear's. A ResNet block's strided shortcut through the
/// table quantized four times the pixels it read.
fn pointwise(
    p: &Products<'_>,
    (x, ld): (&[f32], usize),
    [batch, h, w]: [usize; 3],
    g: &Conv2d,
    out: &mut [f32],
) -> Ran {
    let (cin, n) = (g.in_channels, g.out_channels);
    let Some([ho, wo]) = g.output(h, w) else { return Err(Declined::Shapes) };
    let (words, m, [sh, sw]) = (cin / p.weight.layout.per_word(), batch * ho * wo, g.stride);
    let pixel = |r: usize| {
        let (b, oy, ox) = (r / (ho * wo), r / wo % ho, r % wo);
        ((b * h + oy * sh) * w + ox * sw) * ld
    };
    // At a stride of 1 the output's pixels are the input's, its rows `ld` apart.
    let at = if g.stride == [1, 1] { RowsAt::Strided(ld) } else { RowsAt::Each(&pixel) };
    let fill = |first: usize, band: &mut [u32]| quantize_band(p.kernel, x, cin, p.quant, at, first, band);
    // SAFETY: `fill` writes every word of a band's rows; the weight holds its panels for `[n,
    // words * per word]` (a 1×1 weight packs as its matrix), the rest what the shapes say (the
    // caller's checks).
    unsafe { p.run_filled(&fill, [m, words, n], out) };
    Ok(())
}

/// [`conv_with`] on AMX's tiles reading the taps in place ([`super::amx::Shifted`]): each
/// image quantized into its padded pixels (the padding at the zero point's level), then the
/// tiles' GEMM over its virtual rows. Only for one group, a stride of 1, whole tile rows of
/// channels (64 a pixel), no GELU (which the tiles apply after), on enough rows and columns
/// for the tiles (`super::amx::block`'s gate); `None` otherwise (the table's way runs).
#[cfg(target_arch = "x86_64")]
fn shifted(
    p: &Products<'_>,
    (x, ld): (&[f32], usize),
    [batch, h, w]: [usize; 3],
    g: &Conv2d,
    out: &mut [f32],
) -> Option<Ran> {
    use super::amx::{conv_shifted, Shifted, TILE};
    let (cin, n, quant) = (g.in_channels, g.out_channels, p.quant);
    let words = cin / p.kernel.layout.per_word();
    let ([kh, kw], [ph, pw]) = (g.kernel, g.padding);
    let gelu = matches!(p.post.0, Epilogue::Gelu | Epilogue::GeluTanh);
    let [ho, wo] = g.output(h, w)?;
    let fits = p.kernel.tiles && p.kernel.layout == Layout::Quads && g.groups == 1 && g.stride == [1, 1];
    if !fits || !cin.is_multiple_of(4 * TILE) || gelu || n < super::super::PANEL / 2 || ho * wo < TILE {
        return None;
    }
    let [hp, wp] = [h + 2 * ph, w + 2 * pw];
    // The virtual rows of the last 32-row block read up to 31 pixels past the last line's
    // (`amx::Shifted`): padding too.
    let pixels = hp * wp + 2 * TILE;
    let m = (ho - 1) * wp + wo;
    let taps: Vec<usize> = (0..kh * kw).map(|t| t / kw * wp + t % kw).collect();
    let pad = u32::from_le_bytes([(quant.zero_point - quant.qmin) as u8; 4]);
    let levels = quant.levels();
    let panels_len = p.kernel.layout.panel_words(n, taps.len() * words);
    let factors = p.columns(n, |c| p.weight.words[panels_len + c]);
    let shape = p.shape([taps.len(), words, n, n], (&factors.0, &factors.1));
    // The calling thread's kept rows (`with_rows`) as the image: each line's pixels are
    // written below, so only the padding is filled (filling it all took a twentieth of
    // ResNet-18's call).
    with_rows(pixels * words, |image| {
        image[..ph * wp * words].fill(pad);
        image[(ph + h) * wp * words..].fill(pad);
        for b in 0..batch {
            // Each line of the image into its padded line, split across threads by lines.
            let lines = &mut image[ph * wp * words..][..h * wp * words];
            parallel::units(lines, wp * words, QUANTIZE_WORK * w * cin, &|first, lines| {
                for (y, line) in (first..).zip(lines.chunks_exact_mut(wp * words)) {
                    line[..pw * words].fill(pad);
                    line[(pw + w) * words..].fill(pad);
                    let (dst, first) = (&mut line[pw * words..][..w * words], (b * h + y) * w);
                    if w == 0 {
                        continue;
                    }
                    // SAFETY: the quantizer runs on this CPU; the line's `w` pixels of `cin`
                    // floats, `ld` apart (`rows_fit`), into as many rows of `words`; the range
                    // fits the layout (`check`).
                    unsafe { (p.kernel.quantize)(&x[first * ld..][..(w - 1) * ld + cin], [cin, ld], &levels, dst) };
                }
            });
            let at = b * ho * wo * n;
            let residual = if shape.residual.is_null() { shape.residual } else { shape.residual.wrapping_add(at) };
            let shape = gemm::Shape { residual, ..shape };
            let rows = Shifted { x: image.as_ptr(), words, taps: taps.as_ptr(), lines: [wp, wo] };
            // SAFETY: the tiles were granted (`p.kernel.tiles`); the virtual rows `[0, m)` rounded
            // up to 32 read pixels `< m + 31 + (kh - 1) * wp + kw <= pixels` of the image; the
            // weight holds its panels for `[n, taps * words * 4]`, the residual (moved to this
            // image) and `out` this image's `ho * wo` rows of `n` (the caller's checks).
            unsafe { conv_shifted(rows, m, &shape, &p.weight.words[..panels_len], &mut out[at..][..ho * wo * n]) };
        }
    });
    Some(Ok(()))
}

/// Where each output pixel's patch ([`Layout::patches`]) comes from: the images' levels,
/// `run` bytes a pixel, channels-last.
#[derive(Clone, Copy)]
pub(super) struct Patches {
    levels: *const u8,
    len: usize,
    /// `[batch, h, w]` and `[ho, wo]`.
    image: [usize; 3],
    out: [usize; 2],
    g: Conv2d,
    run: usize,
    /// The padding's level less the base, in bytes.
    pad: u8,
}

// SAFETY: the levels are memory the caller keeps alive and unwritten for the whole call; the
// threads only read through them.
unsafe impl Sync for Patches {}

impl Patches {
    /// Writes the patches of output pixels `first..first + rows` into rows of `dst` `stride`
    /// bytes apart: each tap's `run` bytes, `(i * kw + j) * run` in; the padding's level for
    /// taps in the padding, and for a row's bytes past the patch up to `bytes` (a word's
    /// levels past it, and a tile row's words, meet zero weights: the tiles' buffer, already
    /// written, leaves them as they are). The pixels' coordinates step along their lines
    /// rather than being divided out per row (three divisions a row cost a fifth of a stem's
    /// gather).
    ///
    /// # Safety
    /// `dst` is valid for `rows` rows' writes of `max(bytes, patch)` bytes at `stride`; the
    /// pixels are output pixels; the levels are alive.
    #[inline(always)]
    pub(super) unsafe fn write_rows(&self, first: usize, rows: usize, dst: *mut u8, stride: usize, bytes: usize) {
        let ([ho, wo], patch) = (self.out, self.g.kernel[0] * self.g.kernel[1] * self.run);
        let (mut b, mut oy, mut ox) = (first / (ho * wo), first / wo % ho, first % wo);
        for r in 0..rows {
            // SAFETY (all below): this row's bytes in `dst` (the caller's); every run read
            // lies in the levels (`at` of a pixel inside the image).
            unsafe { self.write_one([b, oy, ox], dst.add(r * stride), patch.max(bytes)) };
            ox += 1;
            if ox == wo {
                ox = 0;
                oy += 1;
                if oy == ho {
                    (oy, b) = (0, b + 1);
                }
            }
        }
    }

    /// One output pixel's patch (`[b, oy, ox]`) into `dst`'s `bytes` bytes, as [`write_rows`].
    ///
    /// # Safety
    /// As [`write_rows`]', for one row.
    #[inline(always)]
    unsafe fn write_one(&self, [b, oy, ox]: [usize; 3], dst: *mut u8, bytes: usize) {
        let ([_, h, w], run) = (self.image, self.run);
        let ([kh, kw], [sh, sw], [ph, pw]) = (self.g.kernel, self.g.stride, self.g.padding);
        let patch = kh * kw * run;
        let src = self.levels;
        // The first input column, where the kernel's columns all lie inside the image, and
        // the kernel's rows that do.
        let x0 = (ox * sw).checked_sub(pw).filter(|&x0| x0 + kw <= w);
        let inside = |i: usize| (oy * sh + i).checked_sub(ph).filter(|&y| y < h);
        let full = x0.is_some() && inside(0).is_some() && inside(kh - 1).is_some();
        // SAFETY (all below): inside `dst`'s `bytes` (the caller's), which hold the patch;
        // each run read lies in the `len` bytes of levels (a pixel inside the image).
        unsafe {
            match full {
                true if bytes > patch => std::ptr::write_bytes(dst.add(patch), self.pad, bytes - patch),
                true => {}
                false => std::ptr::write_bytes(dst, self.pad, bytes),
            }
            for i in 0..kh {
                let Some(iy) = inside(i) else { continue };
                let at = |ix: usize| ((b * h + iy) * w + ix) * run;
                if let Some(x0) = x0 {
                    debug_assert!(at(x0) + kw * run <= self.len);
                    copy_short(dst.add(i * kw * run), src.add(at(x0)), kw * run);
                    continue;
                }
                for j in 0..kw {
                    if let Some(ix) = (ox * sw + j).checked_sub(pw).filter(|&x| x < w) {
                        copy_short(dst.add((i * kw + j) * run), src.add(at(ix)), run);
                    }
                }
            }
        }
    }
}

/// [`conv_with`] for [`Layout::patches`] (one group, checked): the input's levels as one dense
/// run, then each output pixel's patch gathered into a row of words (a tap in the padding at
/// the zero point's level, as the table's padding row), multiplied as a dense GEMM. AMX's
/// tiles gather the rows of each block of theirs where they run instead
/// (`amx::conv_patches`): the patches of a 224-pixel image's stem are megabytes.
fn patches(p: &Products<'_>, (x, ld): (&[f32], usize), [batch, h, w]: [usize; 3], g: &Conv2d, out: &mut [f32]) -> Ran {
    let (cin, n, layout, quant) = (g.in_channels, g.out_channels, p.weight.layout, p.quant);
    let Some([ho, wo]) = g.output(h, w) else { return Err(Declined::Shapes) };
    let [kh, kw] = g.kernel;
    let (per, pixels, m) = (layout.per_word(), batch * h * w, batch * ho * wo);
    let words = layout.conv_depth([n, cin, kh, kw]) / per;
    let dense: std::borrow::Cow<'_, [f32]> = match ld == cin {
        true => x[..pixels * cin].into(),
        false => (0..pixels).flat_map(|p| x[p * ld..p * ld + cin].iter().copied()).collect(),
    };
    let mut levels = vec![0u32; (pixels * cin).div_ceil(per)];
    // SAFETY: the quantizer runs on this CPU, into one row of `pixels * cin` levels; the
    // range fits the layout (`check`).
    unsafe { (p.kernel.quantize)(&dense, [pixels * cin; 2], &quant.levels(), &mut levels) };
    // A pixel's levels, in bytes; the padding's level less the base (`Level::base`) in each
    // level of a word: `zero_point - qmin` bytes for quads, int16 zeros for pairs.
    let pad = match layout {
        Layout::Quads => (quant.zero_point - quant.qmin) as u8,
        Layout::Pairs => 0,
    };
    let (run, image, len) = (cin * 4 / per, [batch, h, w], levels.len() * 4);
    let patches = Patches { levels: levels.as_ptr().cast(), len, image, out: [ho, wo], g: *g, run, pad };
    #[cfg(target_arch = "x86_64")]
    if p.kernel.tiles {
        let panels_len = layout.panel_words(n, words);
        let factors = p.columns(n, |c| p.weight.words[panels_len + c]);
        let shape = p.shape([1, words, n, n], (&factors.0, &factors.1));
        // SAFETY: the tiles were granted (`p.kernel.tiles`); each output pixel's patch lies
        // in the levels, alive and unwritten until the end of this function; the weight holds
        // its panels for `[n, words * 4]`, `out` the `m` rows of `n` (the caller's checks).
        unsafe { super::amx::conv_patches(patches, m, &shape, &p.weight.words[..panels_len], out) };
        return Ok(());
    }
    // Every byte of every row is written below, into the calling thread's kept rows (zeroing
    // fresh rows first cost as much as the gather).
    let fill = |first: usize, band: &mut [u32]| {
        // SAFETY: the band's rows hold the patches (and every byte of their `words`); the
        // levels are alive until the end of this function.
        unsafe { patches.write_rows(first, band.len() / words, band.as_mut_ptr().cast(), words * 4, words * 4) };
    };
    // SAFETY: `fill` writes every word of a band's rows; the weight holds its panels for `[n,
    // words * per word]` (`Layout::pack_conv`), the rest what the shapes say (the caller's
    // checks).
    unsafe { p.run_filled(&fill, [m, words, n], out) };
    Ok(())
}

/// Copies `src` to `dst`: a patch's line of taps (a few dozen bytes: 21 for a 7×7 over 3
/// channels, 9 for a 3×3) as two overlapping moves of 16, 8 or 4 bytes where it is 4 to 32
/// bytes long, where a call to `memcpy` per line cost as much as the copy.
///
/// # Safety
/// `dst` is valid for `src.len()` bytes' writes, and doesn't overlap `src`.
#[inline(always)]
unsafe fn copy_short(dst: *mut u8, src: *const u8, len: usize) {
    /// Two moves of `N` bytes, the first and the last `N` of `len` (`N <= len <= 2 N`).
    #[inline(always)]
    unsafe fn two<const N: usize>(dst: *mut u8, src: *const u8, len: usize) {
        // SAFETY: `len >= N` bytes at `src` and `dst` (the caller's).
        unsafe {
            let (head, tail) =
                (src.cast::<[u8; N]>().read_unaligned(), src.add(len - N).cast::<[u8; N]>().read_unaligned());
            dst.cast::<[u8; N]>().write_unaligned(head);
            dst.add(len - N).cast::<[u8; N]>().write_unaligned(tail);
        }
    }
    // SAFETY (all): `len` bytes at `src` and `dst` (the caller's).
    unsafe {
        match len {
            16..=32 => two::<16>(dst, src, len),
            8..=15 => two::<8>(dst, src, len),
            4..=7 => two::<4>(dst, src, len),
            _ => std::ptr::copy_nonoverlapping(src, dst, len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::{isa, reference};
    use super::*;

    /// Geometries: a 3×3 with padding (SqueezeNet's expansions), a strided one, a 5×5 over
    /// channels that don't fill a word, a 1×1 and a wide one past one panel of columns.
    fn cases() -> Vec<(Conv2d, [usize; 3], Quant)> {
        let conv = |[n, c, kh, kw]: [i64; 4], stride, padding| Conv2d::new([n, c, kh, kw], stride, padding).unwrap();
        let grouped =
            |shape: [i64; 4], stride, padding, groups| Conv2d::grouped(shape, stride, padding, groups).unwrap();
        let u8 = |scale, zero_point| Quant { scale, zero_point, qmin: 0, qmax: 255 };
        vec![
            (conv([16, 8, 3, 3], [1, 1], [1, 1]), [1, 6, 7], u8(0.05, 128)),
            (conv([24, 13, 3, 3], [2, 2], [1, 1]), [2, 9, 8], u8(0.03, 7)),
            (
                conv([5, 3, 5, 5], [1, 2], [2, 1]),
                [1, 7, 6],
                Quant { scale: 0.02, zero_point: -3, qmin: -128, qmax: 127 },
            ),
            (conv([70, 20, 1, 1], [1, 1], [0, 0]), [1, 4, 5], u8(0.1, 255)),
            (conv([130, 16, 3, 3], [1, 1], [0, 0]), [1, 5, 5], u8(0.011, 0)),
            // A strided 1×1 whose channels end inside a word.
            (conv([12, 10, 1, 1], [2, 2], [0, 0]), [1, 7, 6], u8(0.03, 40)),
            // A ResNet's stem: an image's 3 channels.
            (conv([64, 3, 7, 7], [2, 2], [3, 3]), [1, 20, 18], u8(0.02, 100)),
            // Two images, whose rows the threads split inside an image.
            (conv([64, 3, 7, 7], [2, 2], [3, 3]), [2, 11, 9], u8(0.02, 100)),
            // Enough pixels and taps for AMX's tiles (`super::amx`), whose taps end inside a
            // tile row, beside a 1×1 on them (dense rows).
            (conv([70, 44, 3, 3], [1, 1], [1, 1]), [1, 16, 14], u8(0.013, 77)),
            (conv([40, 400, 1, 1], [1, 1], [0, 0]), [1, 16, 14], u8(0.02, 3)),
            // A ResNet block's strided shortcut (`pointwise`): two images, odd sizes.
            (conv([128, 64, 1, 1], [2, 2], [0, 0]), [2, 13, 11], u8(0.03, 60)),
            // RegNet's groups of 8 channels (in lane pairs on AVX-512, as groups of 4 outputs
            // over 16 channels, 2 pairs of words, are), and groups past one panel of columns.
            (grouped([48, 8, 3, 3], [1, 1], [1, 1], 6), [2, 7, 6], u8(0.04, 9)),
            (grouped([12, 16, 3, 3], [2, 2], [1, 1], 3), [1, 9, 7], u8(0.05, 31)),
            (grouped([160, 12, 3, 3], [2, 2], [1, 1], 2), [1, 9, 9], u8(0.03, 200)),
            // Large enough that the quantization and the table split across threads.
            (conv([64, 64, 3, 3], [1, 1], [1, 1]), [1, 48, 48], u8(0.05, 128)),
            // AMX's taps read in place (`shifted`): two images, columns past a panel, a last
            // line ending inside a block; without padding, a 1×5 kernel; one row of pixels.
            (conv([96, 128, 3, 3], [1, 1], [1, 1]), [2, 9, 11], u8(0.03, 17)),
            (conv([40, 64, 1, 5], [1, 1], [0, 2]), [1, 6, 7], u8(0.02, 250)),
            (conv([64, 64, 3, 3], [1, 1], [0, 0]), [1, 3, 21], u8(0.04, 0)),
        ]
    }

    /// The convolution as its im2col matrix times the weight, by the linear's reference, per
    /// group, plus the residual if any, then the epilogue.
    #[allow(clippy::too_many_arguments)]
    fn want(
        x: &[f32],
        dims: [usize; 3],
        g: &Conv2d,
        q: &Quant,
        w: &[i8],
        ws: &[f32],
        (b, residual): (&[f32], Option<&[f32]>),
        e: Epilogue,
    ) -> Vec<f64> {
        let ([batch, h, wd], [kh, kw], groups) = (dims, g.kernel, g.groups);
        let (cin, per_in, per_out) = (g.in_channels, g.in_channels / groups, g.out_channels / groups);
        let [ho, wo] = g.output(h, wd).unwrap();
        let (k, m) = (per_in * kh * kw, batch * ho * wo);
        let mut out = vec![0.0; m * g.out_channels];
        for group in 0..groups {
            // The zero point's float value (0) in the padding.
            let mut patches = vec![0f32; m * k];
            for (p, patch) in patches.chunks_exact_mut(k).enumerate() {
                let (b, oy, ox) = (p / (ho * wo), p / wo % ho, p % wo);
                for (c, i, j) in (0..per_in).flat_map(|c| (0..kh).flat_map(move |i| (0..kw).map(move |j| (c, i, j)))) {
                    let iy = (oy * g.stride[0] + i).checked_sub(g.padding[0]).filter(|&y| y < h);
                    let ix = (ox * g.stride[1] + j).checked_sub(g.padding[1]).filter(|&v| v < wd);
                    if let (Some(iy), Some(ix)) = (iy, ix) {
                        patch[(c * kh + i) * kw + j] = x[((b * h + iy) * wd + ix) * cin + group * per_in + c];
                    }
                }
            }
            let cols = group * per_out..(group + 1) * per_out;
            let wg = &w[cols.start * k..cols.end * k];
            let (ws, b) = (&ws[cols.clone()], Some(&b[cols.clone()]));
            let got = reference::linear_int8(&patches, [m, k, per_out], q, wg, ws, b, Epilogue::None);
            for (r, row) in got.chunks_exact(per_out).enumerate() {
                out[r * g.out_channels + cols.start..][..per_out].copy_from_slice(row);
            }
        }
        let residual = residual.map(|r| r.iter().map(|&v| v as f64).collect::<Vec<_>>());
        let added = out.iter().zip(residual.iter().flatten().chain(std::iter::repeat(&0.0)));
        added.map(|(&v, &r)| reference::epilogue(e, v + r)).collect()
    }

    /// Each int8 GEMM of each family against the im2col reference (exact sums, float32
    /// rounding of the scaling apart), with pixels dense and `ld` apart, on the tests' pool
    /// of threads.
    #[test]
    fn each_family_computes_the_quantized_convolution() {
        super::super::super::parallel::tests::install_test_pool();
        let each = |i: isa::Isa| isa::int8_variants(i.table().unwrap()).into_iter().map(move |v| (i, v));
        for (isa, kernel) in isa::supported().into_iter().flat_map(each) {
            let _forced = isa::force(isa);
            let layout = kernel.layout;
            for (g, dims @ [batch, h, w], quant) in cases() {
                let (cin, n) = (g.in_channels, g.out_channels);
                let shape = [n, cin / g.groups, g.kernel[0], g.kernel[1]];
                let [ho, wo] = g.output(h, w).unwrap();
                let len = n * shape[1] * g.kernel[0] * g.kernel[1];
                let wt =
                    super::super::tests::fit(kernel, (0..len).map(|i| ((i * 53 % 256) as i32 - 128) as i8).collect());
                let ws: Vec<f32> = (0..n).map(|i| 0.001 + i as f32 / 7000.0).collect();
                let bias: Vec<f32> = (0..n).map(|i| i as f32 / 7.0 - 1.0).collect();
                let paired = pairs_groups_on(kernel, shape, g.groups);
                let mut words = vec![0u32; layout.conv_packed_len(shape, g.groups, paired)];
                let strides = [shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1];
                layout.pack_conv(&wt, shape, strides, g.groups, paired, &mut words);
                let weight = super::super::tests::weight(&words, layout, &wt);
                for ld in [cin, cin + 3] {
                    let pixels = batch * h * w;
                    let x: Vec<f32> = (0..pixels * ld).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect();
                    let dense: Vec<f32> = x.chunks(ld).flat_map(|r| r[..cin].iter().copied()).collect();
                    // A residual with the ReLU: the order a ResNet block's add and ReLU take.
                    let residual: Vec<f32> =
                        (0..batch * ho * wo * n).map(|i| ((i * 29 % 31) as f32 - 15.0) / 9.0).collect();
                    for (epilogue, added) in [(Epilogue::None, false), (Epilogue::Relu, false), (Epilogue::Relu, true)]
                    {
                        let mut out = vec![f32::NAN; batch * ho * wo * n];
                        let (post, addends) = ((epilogue, None), (Some(&bias[..]), added.then_some(&residual[..])));
                        let ran = conv_with(kernel, (&x, ld), dims, &g, &quant, weight, &ws, addends, post, &mut out);
                        assert_eq!(ran, Ok(()), "{isa:?}");
                        let want = want(&dense, dims, &g, &quant, &wt, &ws, (&bias, addends.1), epilogue);
                        for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                            let (got, want) = (*got as f64, *want);
                            let close = (got - want).abs() <= 1e-5 * (1.0 + want.abs());
                            assert!(close, "{isa:?} {layout:?} {g:?} ld {ld} [{i}]: {got} vs {want}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_one_by_one_weight_packs_as_its_matrix() {
        let w: Vec<i8> = (0..70 * 9).map(|i| (i % 200) as i8).collect();
        for layout in [Layout::Pairs, Layout::Quads] {
            let (mut conv, mut matrix) =
                (vec![0; layout.conv_packed_len([70, 9, 1, 1], 1, false)], vec![0; layout.packed_len([70, 9])]);
            layout.pack_conv(&w, [70, 9, 1, 1], [9, 1, 1, 1], 1, false, &mut conv);
            layout.pack(&w, [70, 9], [9, 1], &mut matrix);
            assert_eq!(conv, matrix, "{layout:?}");
        }
    }

    #[test]
    fn declines_groups_and_short_slices() {
        let Some(layout) = Layout::current() else { return };
        // Groups of 3 channels: not whole words of pairs or quads.
        let g = Conv2d::grouped([6, 3, 3, 3], [1, 1], [1, 1], 2).unwrap();
        let words = vec![0u32; layout.conv_packed_len([6, 6, 3, 3], 1, false)];
        let q = Quant { scale: 0.1, zero_point: 0, qmin: 0, qmax: 255 };
        let weight = Packed { words: &words, layout, peak: 0 };
        let run = |g: &Conv2d, out: &mut [f32]| {
            conv((&[0.0; 54], 6), [1, 3, 3], g, &q, weight, &[1.0; 6], (None, None), (Epilogue::None, None), out)
        };
        assert_eq!(run(&g, &mut [0.0; 54]), Err(Declined::Shapes));
        let dense = Conv2d::new([6, 6, 3, 3], [1, 1], [1, 1]).unwrap();
        assert_eq!(run(&dense, &mut [0.0; 53]), Err(Declined::Shapes));
        assert_eq!(run(&dense, &mut [0.0; 54]), Ok(()));
    }
}
