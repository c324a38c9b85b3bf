//! kwexport's own kernels, for fused chains torch has no CPU kernel for at these sizes. Each
//! runs on plain slices (contiguous float32 memory the caller checked); the plan gives a node
//! one only at `optimize="fast"`, where a pass fused the chain, and runs torch's op for the
//! node wherever the tensors don't qualify.

pub mod bf16;
pub mod parallel;
pub mod winograd;

#[cfg(test)]
mod nonfinite_tests;

/// RMS normalization over rows of `n = w.len()` values: `w * (x * rsqrt(mean(x^2) + eps))`,
/// as the decomposed pattern computes it (the mean of squares, plus `eps`, its reciprocal
/// square root, times `x`, then the weight), in float32 with the sum of squares taken in
/// sixteen lanes (the order differs from torch's reduction by rounding: `docs/optimize.md`).
pub fn rms_norm_f32(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    if n == 0 {
        return;
    }
    for (row, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for (l, v) in lanes.iter_mut().zip(c) {
                *l += v * v;
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        let sum = lanes.iter().sum::<f32>() + tail;
        let scale = 1.0 / (sum / n as f32 + eps).sqrt();
        for ((d, &v), &g) in dst.iter_mut().zip(row).zip(w) {
            *d = g * (v * scale);
        }
    }
}

/// Layer normalization over rows of `n = w.len()` values: `(x - mean) / sqrt(var + eps) * w +
/// b`, the biased variance taken around the mean in a second pass (as torch's CPU kernel's
/// moments are exact to rounding), sums in sixteen lanes.
pub fn layer_norm_f32(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    if n == 0 || b.len() != n {
        return;
    }
    let lanes_sum = |row: &[f32], f: &dyn Fn(f32) -> f32| {
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for (l, &v) in lanes.iter_mut().zip(c) {
                *l += f(v);
            }
        }
        lanes.iter().sum::<f32>() + chunks.remainder().iter().map(|&v| f(v)).sum::<f32>()
    };
    for (row, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mean = lanes_sum(row, &|v| v) / n as f32;
        let var = lanes_sum(row, &|v| (v - mean) * (v - mean)) / n as f32;
        let rstd = 1.0 / (var + eps).sqrt();
        for (((d, &v), &g), &c) in dst.iter_mut().zip(row).zip(w).zip(b) {
            *d = (v - mean) * rstd * g + c;
        }
    }
}

/// The width of a weight panel: the columns one pass of the linear kernel computes.
pub const PANEL: usize = 64;

/// `out[m, n] = bias[n] + x[m, k] @ w[k, n]` for small `m` (a few rows of activations: a
/// decode step, a small batch), where torch's GEMM spends more on setup than on arithmetic.
/// `panels` is the weight packed once ([`pack_conv_panels`], its first use): `ceil(n / 64)` contiguous
/// `[k, 64]` panels, so the kernel streams each panel from memory in order (a row of a plain
/// `[k, n]` weight is a new page every few rows, which the prefetchers don't follow). Returns
/// `false` (writing nothing) where this CPU lacks AVX-512; the plan measures it against
/// torch's kernel per shape and keeps the faster (`exec`).
pub fn linear_f32(
    x: &[f32],
    m: usize,
    k: usize,
    panels: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> bool {
    gemm_f32(x, m, k, panels, n, bias, None, Epilogue::None, out)
}

/// What the GEMM applies to each result before storing it: the activation a 1×1
/// convolution absorbed (`passes::conv_pointwise`), computed as torch's CPU kernels do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    None,
    Relu,
    /// `x * min(max(x + 3, 0), 6) / 6`.
    Hardswish,
    /// `min(max(x + 3, 0), 6) / 6`.
    Hardsigmoid,
    /// `1 / (1 + e^-x)`.
    Sigmoid,
    /// `x / (1 + e^-x)` (SiLU).
    Swish,
    /// GELU, `0.5 x (1 + erf(x / sqrt 2))` (see [`gelu_f32`]).
    Gelu,
    /// GELU's tanh approximation (see [`gelu_f32`]).
    GeluTanh,
}

impl Epilogue {
    /// The epilogue for oneDNN's name of a post-op (`mkldnn::_convolution_pointwise`'s
    /// `attr`), if the kernel has it.
    pub fn of_attr(attr: &str) -> Option<Epilogue> {
        Some(match attr {
            "none" => Epilogue::None,
            "relu" => Epilogue::Relu,
            "hardswish" => Epilogue::Hardswish,
            "hardsigmoid" => Epilogue::Hardsigmoid,
            "sigmoid" => Epilogue::Sigmoid,
            "swish" => Epilogue::Swish,
            _ => return None,
        })
    }

    /// The epilogue for a fused linear's post-op (`mkldnn::_linear_pointwise`'s `attr` and
    /// `algorithm`: GELU's approximation), if the kernel has it.
    pub fn of_linear(attr: &str, algorithm: Option<&str>) -> Option<Epilogue> {
        match (attr, algorithm) {
            ("gelu", Some("none") | None) => Some(Epilogue::Gelu),
            ("gelu", Some("tanh")) => Some(Epilogue::GeluTanh),
            ("gelu", _) => None,
            _ => Epilogue::of_attr(attr),
        }
    }
}

/// `epilogue` applied to each element of `x`, in place: a fused linear's activation on the
/// result of torch's GEMM. Returns `false` (writing nothing) where this CPU lacks AVX-512.
pub fn epilogue_f32(epilogue: Epilogue, x: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present.
        unsafe { avx512::epilogue(epilogue, x) };
        return true;
    }
    let _ = (epilogue, x);
    false
}

/// Whether every element of `x` is finite (neither NaN nor infinite): `v * 0` is 0 for a
/// finite `v` and NaN otherwise, summed in sixteen independent lanes so that the loop
/// vectorizes without reassociating.
pub fn all_finite(x: &[f32]) -> bool {
    let mut lanes = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * 0.0;
        }
    }
    lanes.iter().chain(chunks.remainder()).all(|v| v.is_finite())
}

/// Whether this CPU runs kwexport's GEMM ([`gemm_f32`]), so that a plan may lower onto it.
pub fn has_gemm() -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        return true;
    }
    false
}

/// [`linear_f32`] for any number of rows, plus `residual` (`m * n`, laid out as `out`: a
/// convolution's residual add, `passes::conv_residual`), then `epilogue` on each result: also
/// a 1×1 convolution over channels-last pixels (rows are pixels, `k` and `n` channels). Tiles
/// of up to 6 rows × 64 columns, or more rows where fewer columns are left (12 × 16 for a
/// 16-channel convolution), keep every accumulator in a register across the whole `k` loop.
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
) -> bool {
    let fits = x.len() >= m * k
        && panels.len() >= k * n.div_ceil(PANEL) * PANEL
        && out.len() >= m * n
        && bias.is_none_or(|b| b.len() >= n)
        && residual.is_none_or(|r| r.len() >= m * n);
    #[cfg(target_arch = "x86_64")]
    if fits && has_gemm() {
        // SAFETY: AVX-512F is present, and every slice holds what the shapes say (checked).
        unsafe { avx512::gemm(x, m, k, panels, n, (bias, residual), epilogue, out) };
        return true;
    }
    let _ = (fits, x, m, k, panels, n, bias, residual, epilogue, out);
    false
}

/// A convolution's output height and width for an input's, `None` where the kernel doesn't
/// fit the padded input.
fn output_size(input: [usize; 2], kernel: [usize; 2], stride: [usize; 2], padding: [usize; 2]) -> Option<[usize; 2]> {
    let out = |d: usize| {
        let padded = input[d] + 2 * padding[d];
        (padded >= kernel[d]).then(|| (padded - kernel[d]) / stride[d] + 1)
    };
    Some([out(0)?, out(1)?])
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

/// A depthwise convolution over `batch` channels-last images (`x`: `[batch, h, w, c]`), with
/// the weight as `[kh * kw, c]` taps, the bias and `epilogue`, into `out` (`[batch, ho, wo,
/// c]`): for each output pixel, sixteen channels at a time, the sum over the taps that fall
/// inside the image (the padding is zeros). Returns `false` (writing nothing) where the
/// slices don't fit the shapes or this CPU lacks AVX-512.
#[allow(clippy::too_many_arguments)]
pub fn depthwise_f32(
    x: &[f32],
    [batch, h, w]: [usize; 3],
    taps: &[f32],
    g: &Depthwise,
    bias: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> bool {
    let c = g.channels;
    let Some([ho, wo]) = g.output(h, w) else { return false };
    let fits = x.len() >= batch * h * w * c
        && taps.len() >= g.kernel[0] * g.kernel[1] * c
        && out.len() >= batch * ho * wo * c
        && bias.is_none_or(|b| b.len() >= c);
    #[cfg(target_arch = "x86_64")]
    if fits && has_gemm() {
        // SAFETY: AVX-512F is present, and every slice holds what the shapes say (checked).
        unsafe { avx512::depthwise(x, [batch, h, w], taps, g, [ho, wo], bias, epilogue, out) };
        return true;
    }
    let _ = (fits, x, batch, taps, bias, epilogue, out);
    false
}

/// A convolution's geometry (one group, no dilation), checked once when the plan is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2d {
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
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
        })
    }

    /// Input channels × kernel taps: the length of one output's dot product.
    pub fn taps(&self) -> usize {
        self.in_channels * self.kernel[0] * self.kernel[1]
    }

    /// The output's height and width for an input's, `None` where the kernel doesn't fit.
    pub fn output(&self, h: usize, w: usize) -> Option<[usize; 2]> {
        output_size([h, w], self.kernel, self.stride, self.padding)
    }
}

/// An indirect convolution's table: for each of the `m` output pixels (of `[ho, wo]`
/// images) and each tap of the kernel, `row(Some(p))` for the input pixel `p` it reads (of
/// `[h, w]` images, counted across the batch), or `row(None)` for a tap in the padding.
fn tap_table<T>(
    m: usize,
    [h, w]: [usize; 2],
    [ho, wo]: [usize; 2],
    g: &Conv2d,
    row: impl Fn(Option<usize>) -> *const T,
) -> Vec<*const T> {
    let ([kh, kw], [sh, sw], [ph, pw]) = (g.kernel, g.stride, g.padding);
    let mut table = Vec::with_capacity(m * kh * kw);
    for pixel in 0..m {
        let (b, oy, ox) = (pixel / (ho * wo), pixel / wo % ho, pixel % wo);
        for i in 0..kh {
            let iy = (oy * sh + i).checked_sub(ph).filter(|&y| y < h);
            for j in 0..kw {
                table.push(row(match (iy, (ox * sw + j).checked_sub(pw).filter(|&xx| xx < w)) {
                    (Some(iy), Some(ix)) => Some((b * h + iy) * w + ix),
                    _ => None,
                }));
            }
        }
    }
    table
}

/// A convolution over channels-last images (`x`: `[batch, h, w, cin]`) as an indirect GEMM:
/// im2col's product of each output pixel's patch (`kh * kw * cin` values, zeros in the
/// padding) with the weight's `panels` (the `[kh * kw * cin, cout]` matrix of
/// [`pack_conv_panels`]), plus the bias, then `epilogue`, into `out` (`[batch, ho, wo,
/// cout]`); but the GEMM's tiles read each pixel's taps through a table of pointers (one per
/// pixel and tap: the input pixel's `cin` channels, or a row of zeros for a tap in the
/// padding), so no patch is ever copied (3–7% faster than gathering patches into a buffer
/// that stays in L2). `residual`, if any, is added before the epilogue, as [`gemm_f32`] adds
/// it. Returns `false` (writing nothing) where the slices don't fit the shapes or this CPU
/// lacks AVX-512.
#[allow(clippy::too_many_arguments)]
pub fn indirect_f32(
    x: &[f32],
    [batch, h, w]: [usize; 3],
    panels: &[f32],
    g: &Conv2d,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> bool {
    let (cin, n, k) = (g.in_channels, g.out_channels, g.taps());
    let Some([ho, wo]) = g.output(h, w) else { return false };
    let m = batch * ho * wo;
    let fits = x.len() >= batch * h * w * cin
        && panels.len() >= k * n.div_ceil(PANEL) * PANEL
        && out.len() >= m * n
        && bias.is_none_or(|b| b.len() >= n)
        && residual.is_none_or(|r| r.len() >= m * n);
    if !fits || !has_gemm() {
        return false;
    }
    let [kh, kw] = g.kernel;
    let zeros = vec![0f32; cin];
    let table = tap_table(m, [h, w], [ho, wo], g, |pixel| match pixel {
        Some(p) => x[p * cin..].as_ptr(),
        None => zeros.as_ptr(),
    });
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: AVX-512F is present; every pointer of the table starts `cin` readable
        // floats (of `x`, or of `zeros`, alive until the end of this function), and the
        // other slices hold what the shapes say (checked).
        unsafe { avx512::indirect(&table, m, kh * kw, cin, panels, n, (bias, residual), epilogue, out) };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (table, bias, epilogue, out);
        false
    }
}

/// A convolution's `[out, in, kh, kw]` weight (at element `strides`: contiguous or
/// channels-last) as the GEMM's panels of its `[kh * kw * in, out]` matrix, whose rows follow
/// [`indirect_f32`]'s patches: row `(i * kw + j) * in + c` holds the weights of input channel
/// `c` at tap `(i, j)`.
pub fn pack_conv_panels(w: &[f32], shape: [usize; 4], strides: [usize; 4], panels: &mut [f32]) {
    let [n, cin, kh, kw] = shape;
    let k = cin * kh * kw;
    for (p, panel) in panels.chunks_exact_mut(k * PANEL).take(n.div_ceil(PANEL)).enumerate() {
        for (r, row) in panel.chunks_exact_mut(PANEL).enumerate() {
            let (i, j, c) = (r / (kw * cin), r / cin % kw, r % cin);
            for (col, v) in row.iter_mut().enumerate() {
                let o = p * PANEL + col;
                *v = if o < n { w[o * strides[0] + c * strides[1] + i * strides[2] + j * strides[3]] } else { 0.0 };
            }
        }
    }
}

/// A direct convolution of `x` (`[batch, cin, h, w]` at element `strides`: any layout), with
/// the weight as `[cin * kh * kw, cout]` (its taps' output channels contiguous), the bias and
/// `epilogue`, into `out` (channels-last `[batch, ho, wo, cout]`). Returns `false` (writing
/// nothing) where the slices don't fit the shapes or this CPU lacks AVX-512.
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
) -> bool {
    let Some([ho, wo]) = g.output(h, w) else { return false };
    let last = [batch, g.in_channels, h, w].iter().zip(strides).map(|(n, s)| (n - 1) * s).sum::<usize>();
    let fits = batch > 0
        && x.len() > last
        && taps.len() >= g.in_channels * g.kernel[0] * g.kernel[1] * g.out_channels
        && out.len() >= batch * ho * wo * g.out_channels
        && bias.is_none_or(|b| b.len() >= g.out_channels);
    #[cfg(target_arch = "x86_64")]
    if fits && has_gemm() {
        // SAFETY: AVX-512F is present, and every slice holds what the shapes say (checked).
        unsafe { avx512::direct(x, [batch, h, w], strides, taps, g, [ho, wo], bias, epilogue, out) };
        return true;
    }
    let _ = (fits, x, strides, taps, bias, epilogue, out);
    false
}

/// GELU of each element: `0.5 x (1 + erf(x / sqrt 2))` (NaN at +inf, as torch's vectorized
/// kernel gives), or with `tanh`, the tanh
/// approximation `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, computed as
/// `x / (1 + exp(-2 u))`. erf is Abramowitz and Stegun's 7.1.26 (absolute error under 1.5e-7,
/// the rational form torch's vectorized erf uses too), exp a degree-7 polynomial after range
/// reduction. Returns `false` (writing nothing) where this CPU lacks AVX-512: torch's op then
/// runs.
pub fn gelu_f32(x: &[f32], tanh: bool, out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if out.len() >= x.len() && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present, and `out` holds at least `x.len()` elements.
        unsafe { avx512::gelu(x, tanh, out) };
        return true;
    }
    let _ = (x, tanh, out);
    false
}

/// What masks an attention's scores, per query row.
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    None,
    /// Query `i` sees keys `0..=i` (torch's `is_causal`: the top-left triangle).
    Causal,
    /// Whether each key takes part (nonzero bytes): `[batch, heads, l, s]` at element
    /// strides (0 where broadcast).
    Bool(&'a [u8], [usize; 4]),
    /// What is added to each key's score, laid out as `Bool`'s.
    Float(&'a [f32], [usize; 4]),
}

/// Scaled dot-product attention's sizes: queries `[batch, heads, l, e]`, keys `[batch,
/// heads, s, e]`, values `[batch, heads, s, ev]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    pub batch: usize,
    pub heads: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
    pub scale: f32,
}

impl Attention {
    /// Whether a tensor of `[batch, heads, rows, cols]` at `strides` lies in `len` elements.
    fn fits(&self, len: usize, rows: usize, cols: usize, strides: [usize; 4]) -> bool {
        let dims = [self.batch, self.heads, rows, cols];
        len > dims.iter().zip(strides).map(|(n, s)| (n - 1) * s).sum::<usize>()
    }
}

/// `softmax(q k^T scale + mask) v` for each batch and head, into `out` laid out `[batch, l,
/// heads, ev]` (as torch's CPU kernel lays out its result). `q`, `k` and `v` are at element
/// strides for their first three dimensions, their last contiguous. For the few dozen
/// tokens of a small model's call, where torch's flash kernel spends most of its time on
/// setup: keys are transposed once per head, then each block of four query rows takes its
/// scores, softmax and weighted values in registers. Returns `false` where a query row has no
/// key to attend or a score is NaN (torch decides what those give), the slices don't fit the
/// sizes, or this CPU lacks AVX-512; `out` may then be partly written.
#[allow(clippy::too_many_arguments)]
pub fn attention_f32(
    q: (&[f32], [usize; 3]),
    k: (&[f32], [usize; 3]),
    v: (&[f32], [usize; 3]),
    g: &Attention,
    mask: AttentionMask<'_>,
    out: &mut [f32],
) -> bool {
    let nonempty = [g.batch, g.heads, g.l, g.s, g.e, g.ev].iter().all(|&n| n > 0);
    let fits = nonempty
        && g.fits(q.0.len(), g.l, g.e, [q.1[0], q.1[1], q.1[2], 1])
        && g.fits(k.0.len(), g.s, g.e, [k.1[0], k.1[1], k.1[2], 1])
        && g.fits(v.0.len(), g.s, g.ev, [v.1[0], v.1[1], v.1[2], 1])
        && out.len() >= g.batch * g.l * g.heads * g.ev
        && match mask {
            AttentionMask::Bool(m, ms) => g.fits(m.len(), g.l, g.s, ms),
            AttentionMask::Float(m, ms) => g.fits(m.len(), g.l, g.s, ms),
            _ => true,
        };
    #[cfg(target_arch = "x86_64")]
    if fits && has_gemm() {
        // SAFETY: AVX-512F is present, and every slice holds what the sizes say (checked).
        return unsafe { avx512::attention(q, k, v, g, mask, out) };
    }
    let _ = (fits, q, k, v, mask, out);
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{inside, Epilogue};

    /// `e^x` in each lane: `2^n e^r` with `r = x - n ln 2` in [-ln2/2, ln2/2], `e^r` by its
    /// Taylor series to `r^7` (relative error ~1e-8, below float32's rounding). `x` is first
    /// clamped to [-104, 89], past which `scalef` gives 0 and +inf as `e^x` rounds, so ±inf
    /// give 0 and +inf; NaN stays NaN.
    #[inline(always)]
    unsafe fn exp(x: __m512) -> __m512 {
        // SAFETY (all below): register arithmetic; the caller enabled AVX-512F.
        unsafe {
            let x = _mm512_min_ps(_mm512_set1_ps(89.0), _mm512_max_ps(_mm512_set1_ps(-104.0), x));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
                x,
                _mm512_set1_ps(std::f32::consts::LOG2_E),
            ));
            // ln 2 in two parts, so that n * hi is exact.
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
            let mut p = _mm512_set1_ps(1.0 / 5040.0);
            for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
            }
            _mm512_scalef_ps(p, n)
        }
    }

    /// `epilogue` on 16 lanes, as torch's vectorized CPU kernels compute it, NaN included.
    /// `vmaxps` and `vminps` return their second operand where either is NaN, so the value
    /// clamped goes second: a NaN passes through a clamp as through torch's `clamp`.
    #[inline(always)]
    pub(super) unsafe fn apply(epilogue: Epilogue, x: __m512) -> __m512 {
        // SAFETY (all below): register arithmetic; the caller enabled AVX-512F.
        unsafe {
            let (zero, one) = (_mm512_setzero_ps(), _mm512_set1_ps(1.0));
            let relu6_of_x_plus_3 =
                || _mm512_min_ps(_mm512_set1_ps(6.0), _mm512_max_ps(zero, _mm512_add_ps(x, _mm512_set1_ps(3.0))));
            match epilogue {
                Epilogue::None => x,
                Epilogue::Relu => _mm512_max_ps(zero, x),
                Epilogue::Hardswish => _mm512_div_ps(_mm512_mul_ps(x, relu6_of_x_plus_3()), _mm512_set1_ps(6.0)),
                Epilogue::Hardsigmoid => _mm512_div_ps(relu6_of_x_plus_3(), _mm512_set1_ps(6.0)),
                Epilogue::Sigmoid => _mm512_div_ps(one, _mm512_add_ps(one, exp(_mm512_sub_ps(zero, x)))),
                Epilogue::Swish => _mm512_div_ps(x, _mm512_add_ps(one, exp(_mm512_sub_ps(zero, x)))),
                // Too long to inline into the GEMM's tile, whose registers it would take:
                // `columns` applies them in a pass of their own (`apply_any`).
                Epilogue::Gelu | Epilogue::GeluTanh => x,
            }
        }
    }

    /// `epilogue` on 16 lanes, GELU included (see `apply`).
    #[inline(always)]
    unsafe fn apply_any(epilogue: Epilogue, x: __m512) -> __m512 {
        // SAFETY: register arithmetic; the caller enabled AVX-512F.
        unsafe {
            match epilogue {
                Epilogue::Gelu => gelu16(x, false),
                Epilogue::GeluTanh => gelu16(x, true),
                _ => apply(epilogue, x),
            }
        }
    }

    /// GELU of 16 lanes (see `super::gelu_f32`).
    #[inline(always)]
    unsafe fn gelu16(x: __m512, tanh: bool) -> __m512 {
        // SAFETY (all below): register arithmetic; the caller enabled AVX-512F.
        unsafe {
            let one = _mm512_set1_ps(1.0);
            if tanh {
                let x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
                let u = _mm512_mul_ps(_mm512_fmadd_ps(x3, _mm512_set1_ps(0.044715), x), _mm512_set1_ps(0.797_884_6));
                let e = exp(_mm512_mul_ps(u, _mm512_set1_ps(-2.0)));
                return _mm512_div_ps(x, _mm512_add_ps(one, e));
            }
            // q = 1 - erf(|x| / sqrt 2), so that 1 + erf(x / sqrt 2) is 2 - q, or q itself for
            // negative x (no cancellation in the tail).
            let z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(std::f32::consts::FRAC_1_SQRT_2));
            let t = _mm512_div_ps(one, _mm512_fmadd_ps(z, _mm512_set1_ps(0.327_591_1), one));
            let mut poly = _mm512_set1_ps(1.061_405_4);
            for c in [-1.453_152_1, 1.421_413_8, -0.284_496_72, 0.254_829_6] {
                poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(c));
            }
            poly = _mm512_mul_ps(poly, t);
            let q = _mm512_mul_ps(poly, exp(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, z))));
            let negative = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_setzero_ps());
            let one_plus_erf = _mm512_mask_blend_ps(negative, _mm512_sub_ps(_mm512_set1_ps(2.0), q), q);
            let y = _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5)), one_plus_erf);
            // torch's vectorized GELU gives NaN for +inf (any tensor of two or more elements).
            let inf = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(x, _mm512_set1_ps(f32::INFINITY));
            _mm512_mask_blend_ps(inf, y, _mm512_set1_ps(f32::NAN))
        }
    }

    /// See `super::epilogue_f32`.
    ///
    /// # Safety
    /// AVX-512F must be present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn epilogue(epilogue: Epilogue, x: &mut [f32]) {
        let (n, p) = (x.len(), x.as_mut_ptr());
        let mut i = 0;
        while i < n {
            let mask = lanes(n - i);
            // SAFETY: lanes [i, min(i + 16, n)) exist; masked lanes aren't touched.
            unsafe {
                let v = _mm512_maskz_loadu_ps(mask, p.add(i));
                _mm512_mask_storeu_ps(p.add(i), mask, apply_any(epilogue, v));
            }
            i += 16;
        }
    }

    /// See `super::gelu_f32`.
    ///
    /// # Safety
    /// AVX-512F must be present; `out` must hold at least `x.len()` elements.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn gelu(x: &[f32], tanh: bool, out: &mut [f32]) {
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        while i < x.len() {
            let left = (x.len() - i).min(16);
            let mask = lanes(left);
            // SAFETY: lanes [i, i + left) of both slices exist; masked lanes aren't touched.
            unsafe {
                let v = _mm512_maskz_loadu_ps(mask, xp.add(i));
                _mm512_mask_storeu_ps(op.add(i), mask, gelu16(v, tanh));
            }
            i += 16;
        }
    }

    /// Whether the four output pixels from `ox` (of `wo`) all have every tap of their kernel
    /// row inside the image: pixel `ox`'s taps are `cols`, along a dimension of stride `sw`,
    /// padding `pw`, a `kw`-wide kernel and `w` inputs.
    fn four_inside(ox: usize, wo: usize, cols: (usize, usize), [sw, pw, kw, w]: [usize; 4]) -> bool {
        ox + 4 <= wo && cols == (0, kw) && inside(ox + 3, sw, pw, kw, w).2 == kw
    }

    /// A mask of the first `left` of 16 lanes (all of them from 16 on).
    #[inline(always)]
    pub(super) fn lanes(left: usize) -> u16 {
        ((1u32 << left.min(16)) - 1) as u16
    }

    /// See `super::attention_f32`.
    ///
    /// # Safety
    /// AVX-512F must be present; the slices must hold what the sizes say.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn attention(
        (q, qs): (&[f32], [usize; 3]),
        (k, ks): (&[f32], [usize; 3]),
        (v, vs): (&[f32], [usize; 3]),
        g: &super::Attention,
        mask: super::AttentionMask<'_>,
        out: &mut [f32],
    ) -> bool {
        use super::AttentionMask;
        const R: usize = 4;
        let (l, s, e, ev) = (g.l, g.s, g.e, g.ev);
        let sp = s.div_ceil(16) * 16;
        let nv = sp / 16;
        // Keys transposed (`kt[c][j]`), and each block's scores, then probabilities.
        let mut kt = vec![0.0f32; e * sp];
        let mut sc = vec![0.0f32; R * sp];
        let (ktp, scp, op) = (kt.as_mut_ptr(), sc.as_mut_ptr(), out.as_mut_ptr());
        // SAFETY (all below): the slices hold what the sizes say (the caller's check), and
        // every index stays within them; masked lanes aren't touched.
        unsafe {
            let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
            for b in 0..g.batch {
                for h in 0..g.heads {
                    let kb = k.as_ptr().add(b * ks[0] + h * ks[1]);
                    for j in 0..s {
                        let row = kb.add(j * ks[2]);
                        for c in 0..e {
                            *ktp.add(c * sp + j) = *row.add(c);
                        }
                    }
                    let vb = v.as_ptr().add(b * vs[0] + h * vs[1]);
                    let mut i0 = 0;
                    while i0 < l {
                        let rows = (l - i0).min(R);
                        // Rows past the last repeat it; their results aren't stored.
                        let qrow: [*const f32; R] = std::array::from_fn(|r| {
                            q.as_ptr().add(b * qs[0] + h * qs[1] + (i0 + r.min(rows - 1)) * qs[2])
                        });
                        let mut jb = 0;
                        while jb < nv {
                            let two = jb + 1 < nv;
                            let mut acc = [[_mm512_setzero_ps(); 2]; R];
                            for c in 0..e {
                                let k0 = _mm512_loadu_ps(ktp.add(c * sp + jb * 16));
                                let k1 = if two { _mm512_loadu_ps(ktp.add(c * sp + jb * 16 + 16)) } else { k0 };
                                for r in 0..R {
                                    let qv = _mm512_set1_ps(*qrow[r].add(c));
                                    acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
                                    acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
                                }
                            }
                            for (r, a) in acc.iter().enumerate() {
                                _mm512_storeu_ps(scp.add(r * sp + jb * 16), a[0]);
                                if two {
                                    _mm512_storeu_ps(scp.add(r * sp + jb * 16 + 16), a[1]);
                                }
                            }
                            jb += 2;
                        }
                        // Softmax of each row, its scale left for the weighted sum.
                        let mut inv = [0.0f32; R];
                        for (r, inv) in inv.iter_mut().enumerate().take(rows) {
                            let i = i0 + r;
                            let row = scp.add(r * sp);
                            let mut mx = neg_inf;
                            for jb in 0..nv {
                                let j0 = jb * 16;
                                let mut valid = lanes(s - j0.min(s));
                                let mut x = _mm512_mul_ps(_mm512_loadu_ps(row.add(j0)), _mm512_set1_ps(g.scale));
                                match mask {
                                    AttentionMask::None => {}
                                    AttentionMask::Causal => valid &= lanes((i + 1).saturating_sub(j0)),
                                    AttentionMask::Bool(m, ms) => {
                                        let at = m.as_ptr().add(b * ms[0] + h * ms[1] + i * ms[2] + j0 * ms[3]);
                                        let mut bytes = [0u8; 16];
                                        for (t, byte) in bytes.iter_mut().enumerate().take((s - j0).min(16)) {
                                            *byte = *at.add(t * ms[3]);
                                        }
                                        let wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes.as_ptr().cast()));
                                        valid &= _mm512_test_epi32_mask(wide, wide);
                                    }
                                    AttentionMask::Float(m, ms) => {
                                        let at = m.as_ptr().add(b * ms[0] + h * ms[1] + i * ms[2] + j0 * ms[3]);
                                        let add = if ms[3] == 1 {
                                            _mm512_maskz_loadu_ps(valid, at)
                                        } else {
                                            let mut row = [0f32; 16];
                                            for (t, a) in row.iter_mut().enumerate().take((s - j0).min(16)) {
                                                *a = *at.add(t * ms[3]);
                                            }
                                            _mm512_loadu_ps(row.as_ptr())
                                        };
                                        x = _mm512_add_ps(x, add);
                                    }
                                }
                                // A NaN score (a NaN or an infinity in the queries or keys)
                                // makes torch's softmax NaN in ways that depend on how its
                                // kernel masks and blocks: torch decides.
                                if _mm512_mask_cmp_ps_mask::<_CMP_UNORD_Q>(lanes(s - j0.min(s)), x, x) != 0 {
                                    return false;
                                }
                                // A score of -inf (masked, or a float mask's) takes no part.
                                valid &= _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(x, neg_inf);
                                x = _mm512_mask_blend_ps(valid, neg_inf, x);
                                _mm512_storeu_ps(row.add(j0), x);
                                mx = _mm512_max_ps(mx, x);
                            }
                            let m = _mm512_reduce_max_ps(mx);
                            if m == f32::NEG_INFINITY {
                                return false;
                            }
                            let mut sum = _mm512_setzero_ps();
                            for jb in 0..nv {
                                let x = _mm512_loadu_ps(row.add(jb * 16));
                                let taken = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(x, neg_inf);
                                let p = _mm512_maskz_mov_ps(taken, exp(_mm512_sub_ps(x, _mm512_set1_ps(m))));
                                _mm512_storeu_ps(row.add(jb * 16), p);
                                sum = _mm512_add_ps(sum, p);
                            }
                            *inv = 1.0 / _mm512_reduce_add_ps(sum);
                        }
                        // The weighted values, 64 columns at a time.
                        let mut c0 = 0;
                        while c0 < ev {
                            let width = (ev - c0).min(64);
                            let masks: [u16; 4] = std::array::from_fn(|t| lanes(width.saturating_sub(16 * t)));
                            let mut acc = [[_mm512_setzero_ps(); 4]; R];
                            for j in 0..s {
                                let vrow = vb.add(j * vs[2] + c0);
                                let vv: [__m512; 4] = std::array::from_fn(|t| {
                                    if masks[t] == 0 {
                                        _mm512_setzero_ps()
                                    } else {
                                        _mm512_maskz_loadu_ps(masks[t], vrow.add(16 * t))
                                    }
                                });
                                for (r, a) in acc.iter_mut().enumerate() {
                                    let p = _mm512_set1_ps(*scp.add(r * sp + j));
                                    for t in 0..4 {
                                        a[t] = _mm512_fmadd_ps(p, vv[t], a[t]);
                                    }
                                }
                            }
                            for r in 0..rows {
                                let o = op.add(((b * l + i0 + r) * g.heads + h) * ev + c0);
                                let scale = _mm512_set1_ps(inv[r]);
                                for t in 0..4 {
                                    if masks[t] != 0 {
                                        _mm512_mask_storeu_ps(o.add(16 * t), masks[t], _mm512_mul_ps(acc[r][t], scale));
                                    }
                                }
                            }
                            c0 += 64;
                        }
                        i0 += R;
                    }
                }
            }
        }
        true
    }

    /// See `super::max_pool_f32`.
    ///
    /// # Safety
    /// AVX-512F must be present; the slices must hold what the sizes say.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn max_pool(
        x: &[f32],
        [batch, h, w, c]: [usize; 4],
        pool: &super::MaxPool,
        [ho, wo]: [usize; 2],
        out: &mut [f32],
    ) {
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        let [sy, sx] = pool.stride;
        // SAFETY (all below): every pixel read is inside the image (`inside`), every lane past
        // `c` masked.
        unsafe {
            let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
            for b in 0..batch {
                let image = xp.add(b * h * w * c);
                for oy in 0..ho {
                    let (y0, ky0, ky1) = inside(oy, sy, pool.padding[0], pool.kernel[0], h);
                    for ox in 0..wo {
                        let (x0, kx0, kx1) = inside(ox, sx, pool.padding[1], pool.kernel[1], w);
                        let o = op.add(((b * ho + oy) * wo + ox) * c);
                        let mut ch = 0;
                        while ch < c {
                            let mask = lanes(c - ch);
                            let mut m = neg_inf;
                            for ky in ky0..ky1 {
                                let row = image.add((y0 + ky as isize) as usize * w * c);
                                for kx in kx0..kx1 {
                                    let v = _mm512_maskz_loadu_ps(mask, row.add((x0 + kx as isize) as usize * c + ch));
                                    // NaN wins, as in torch's comparison (`v > m || isnan(v)`).
                                    let take = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, m)
                                        | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
                                    m = _mm512_mask_mov_ps(m, take, v);
                                }
                            }
                            _mm512_mask_storeu_ps(o.add(ch), mask, m);
                            ch += 16;
                        }
                    }
                }
            }
        }
    }

    /// See `super::depthwise_f32`.
    ///
    /// # Safety
    /// AVX-512F must be present; the slices must hold what the shapes say.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn depthwise(
        x: &[f32],
        [batch, h, w]: [usize; 3],
        taps: &[f32],
        g: &super::Depthwise,
        [ho, wo]: [usize; 2],
        bias: Option<&[f32]>,
        epilogue: Epilogue,
        out: &mut [f32],
    ) {
        let c = g.channels;
        let ([kh, kw], [sh, sw], [ph, pw]) = (g.kernel, g.stride, g.padding);
        let (xp, tp, op) = (x.as_ptr(), taps.as_ptr(), out.as_mut_ptr());
        let bp = bias.map_or(std::ptr::null(), |b| b.as_ptr());
        for b in 0..batch {
            for oy in 0..ho {
                let (iy, i0, i1) = inside(oy, sh, ph, kh, h);
                let mut ox = 0;
                while ox < wo {
                    let (ix, j0, j1) = inside(ox, sw, pw, kw, w);
                    // A 3- or 5-wide kernel at stride 1 or 2 slides over up to four pixels at
                    // once, borders included: each input vector of a kernel row is loaded once
                    // for every pixel and tap that reads it (a 512-bit load takes both of this
                    // core's load ports, so loads, not FMAs, bound the general tile).
                    let slides = matches!((kw, sw), (3 | 5, 1 | 2));
                    // Otherwise four pixels at once where each has every tap of its row inside
                    // the image: four independent sums per weight vector loaded.
                    let pixels = if slides {
                        (wo - ox).min(4)
                    } else if four_inside(ox, wo, (j0, j1), [sw, pw, kw, w]) {
                        4
                    } else {
                        1
                    };
                    // SAFETY: taps inside the image only are read: rows from `i0`, columns
                    // from `j0` (or, sliding, the columns inside the image), each address
                    // formed with wrapping arithmetic from an origin that may lie in the
                    // padding; and the output pixels.
                    unsafe {
                        let first_tap = ((b * h) as isize + iy) * w as isize + ix;
                        let (x0, o) =
                            (xp.wrapping_offset(first_tap * c as isize), op.add(((b * ho + oy) * wo + ox) * c));
                        let d = Taps { rows: [i0, i1], cols: [j0, j1], kw, c, row: w * c, step: sw * c };
                        let mut c0 = 0;
                        if slides {
                            let row = Slide { origin: x0, column: ix, width: w, pixels };
                            while c0 < c {
                                match (kw, sw) {
                                    (3, 1) => dw_slide::<3, 1>(&row, tp, bp, o, c0, &d, epilogue),
                                    (3, _) => dw_slide::<3, 2>(&row, tp, bp, o, c0, &d, epilogue),
                                    (_, 1) => dw_slide::<5, 1>(&row, tp, bp, o, c0, &d, epilogue),
                                    _ => dw_slide::<5, 2>(&row, tp, bp, o, c0, &d, epilogue),
                                }
                                c0 += 16;
                            }
                        }
                        while c0 < c {
                            let blocks = (c - c0).div_ceil(16).min(4);
                            match (pixels, blocks) {
                                (4, 4) => dw_tile::<4, 4>(x0, tp, bp, o, c0, &d, epilogue),
                                (4, 3) => dw_tile::<4, 3>(x0, tp, bp, o, c0, &d, epilogue),
                                (4, 2) => dw_tile::<4, 2>(x0, tp, bp, o, c0, &d, epilogue),
                                (4, _) => dw_tile::<4, 1>(x0, tp, bp, o, c0, &d, epilogue),
                                (_, 4) => dw_tile::<1, 4>(x0, tp, bp, o, c0, &d, epilogue),
                                (_, 3) => dw_tile::<1, 3>(x0, tp, bp, o, c0, &d, epilogue),
                                (_, 2) => dw_tile::<1, 2>(x0, tp, bp, o, c0, &d, epilogue),
                                _ => dw_tile::<1, 1>(x0, tp, bp, o, c0, &d, epilogue),
                            }
                            c0 += blocks * 16;
                        }
                    }
                    ox += pixels;
                }
            }
        }
    }

    /// Where a depthwise tile's taps are: the kernel rows and columns inside the image, the
    /// kernel's width, the channels, and the strides (in elements) of an input row and of
    /// one output pixel's step along it.
    struct Taps {
        rows: [usize; 2],
        cols: [usize; 2],
        kw: usize,
        c: usize,
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

    /// Up to four neighbouring output pixels × 16 channels from `c0` (masked past `c`), for a
    /// kernel `KW` wide at stride `S`: per kernel row inside the image, the `3 S + KW` input
    /// vectors the four pixels read are loaded once (zeros where they fall in the padding),
    /// with the row's `KW` weight vectors, for `4 KW` FMAs.
    #[inline(always)]
    unsafe fn dw_slide<const KW: usize, const S: usize>(
        row: &Slide,
        taps: *const f32,
        bias: *const f32,
        out: *mut f32,
        c0: usize,
        d: &Taps,
        epilogue: Epilogue,
    ) {
        let mask = lanes(d.c.saturating_sub(c0));
        // SAFETY (all below): rows inside the image (`d.rows`), columns checked against the
        // width before each load, channels masked past `c`; outputs for `row.pixels` pixels.
        unsafe {
            let start = if bias.is_null() { _mm512_setzero_ps() } else { _mm512_maskz_loadu_ps(mask, bias.add(c0)) };
            let mut acc = [start; 4];
            for i in d.rows[0]..d.rows[1] {
                let (xr, wr) = (row.origin.wrapping_add(i * d.row + c0), taps.add(i * KW * d.c + c0));
                let ws: [__m512; KW] = std::array::from_fn(|j| _mm512_maskz_loadu_ps(mask, wr.add(j * d.c)));
                // Positions 0 .. 3 S + KW of the row, `d.c` apart (S = 2: at most 11).
                let mut xs = [_mm512_setzero_ps(); 11];
                let inside = row.column >= 0 && row.column as usize + 3 * S + KW <= row.width;
                for (q, v) in xs.iter_mut().enumerate().take(3 * S + KW) {
                    if inside || (0..row.width as isize).contains(&(row.column + q as isize)) {
                        *v = _mm512_maskz_loadu_ps(mask, xr.wrapping_add(q * d.c));
                    }
                }
                for (p, a) in acc.iter_mut().enumerate() {
                    for (j, wv) in ws.iter().enumerate() {
                        *a = _mm512_fmadd_ps(xs[p * S + j], *wv, *a);
                    }
                }
            }
            for (p, a) in acc.iter().enumerate().take(row.pixels) {
                _mm512_mask_storeu_ps(out.add(p * d.c + c0), mask, apply(epilogue, *a));
            }
        }
    }

    /// `P` neighbouring output pixels × `B` blocks of 16 channels from `c0` (masked past
    /// `c`): `P * B` independent sums over the taps, so the FMAs' latency overlaps. `x0` is
    /// the first pixel's kernel origin (row and column of tap (0, 0), which may lie in the
    /// padding: only taps inside are read).
    #[inline(always)]
    unsafe fn dw_tile<const P: usize, const B: usize>(
        x0: *const f32,
        taps: *const f32,
        bias: *const f32,
        out: *mut f32,
        c0: usize,
        d: &Taps,
        epilogue: Epilogue,
    ) {
        let masks: [u16; B] = std::array::from_fn(|v| lanes(d.c.saturating_sub(c0 + v * 16)));
        // SAFETY (all below): taps inside the image and channels masked past `c` (see the
        // caller).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); B]; P];
            if !bias.is_null() {
                for v in 0..B {
                    let b = _mm512_maskz_loadu_ps(masks[v], bias.add(c0 + v * 16));
                    acc.iter_mut().for_each(|px| px[v] = b);
                }
            }
            for i in d.rows[0]..d.rows[1] {
                for j in d.cols[0]..d.cols[1] {
                    let (xt, wt) = (x0.wrapping_add(i * d.row + j * d.c + c0), taps.add((i * d.kw + j) * d.c + c0));
                    let wv: [__m512; B] = std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], wt.add(v * 16)));
                    for (p, px) in acc.iter_mut().enumerate() {
                        for v in 0..B {
                            let xv = _mm512_maskz_loadu_ps(masks[v], xt.wrapping_add(p * d.step + v * 16));
                            px[v] = _mm512_fmadd_ps(xv, wv[v], px[v]);
                        }
                    }
                }
            }
            for (p, px) in acc.iter().enumerate() {
                for v in 0..B {
                    _mm512_mask_storeu_ps(out.add(p * d.c + c0 + v * 16), masks[v], apply(epilogue, px[v]));
                }
            }
        }
    }

    /// See `super::direct_f32`.
    ///
    /// # Safety
    /// AVX-512F must be present; the slices must hold what the shapes and strides say.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn direct(
        x: &[f32],
        [batch, h, w]: [usize; 3],
        [sb, sc, sy, sx]: [usize; 4],
        taps: &[f32],
        g: &super::Conv2d,
        [ho, wo]: [usize; 2],
        bias: Option<&[f32]>,
        epilogue: Epilogue,
        out: &mut [f32],
    ) {
        let (cin, cout) = (g.in_channels, g.out_channels);
        let ([kh, kw], [sh, sw], [ph, pw]) = (g.kernel, g.stride, g.padding);
        let (xp, tp, op) = (x.as_ptr(), taps.as_ptr(), out.as_mut_ptr());
        let bp = bias.map_or(std::ptr::null(), |b| b.as_ptr());
        for b in 0..batch {
            for oy in 0..ho {
                let (iy, i0, i1) = inside(oy, sh, ph, kh, h);
                let mut ox = 0;
                while ox < wo {
                    let (ix, j0, j1) = inside(ox, sw, pw, kw, w);
                    let pixels = if four_inside(ox, wo, (j0, j1), [sw, pw, kw, w]) { 4 } else { 1 };
                    // SAFETY: the pixel's kernel origin (offset by `i0`, `j0` where it lies in
                    // the padding) and its output pixel.
                    unsafe {
                        let origin = (b * sb) as isize + iy * sy as isize + ix * sx as isize;
                        let (x0, o) = (xp.wrapping_offset(origin), op.add(((b * ho + oy) * wo + ox) * cout));
                        let d = Patch { rows: [i0, i1], cols: [j0, j1], kh, kw, cin, cout, sc, sy, sx, step: sw * sx };
                        let mut c0 = 0;
                        while c0 < cout {
                            let blocks = (cout - c0).div_ceil(16).min(2);
                            match (pixels, blocks) {
                                (4, 2) => direct_tile::<4, 2>(x0, tp, bp, o, c0, &d, epilogue),
                                (4, _) => direct_tile::<4, 1>(x0, tp, bp, o, c0, &d, epilogue),
                                (_, 2) => direct_tile::<1, 2>(x0, tp, bp, o, c0, &d, epilogue),
                                _ => direct_tile::<1, 1>(x0, tp, bp, o, c0, &d, epilogue),
                            }
                            c0 += blocks * 16;
                        }
                    }
                    ox += pixels;
                }
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

    /// `P` neighbouring output pixels × `B` blocks of 16 output channels from `c0` (masked
    /// past `cout`): each input value broadcast against each block's weights.
    #[inline(always)]
    unsafe fn direct_tile<const P: usize, const B: usize>(
        x0: *const f32,
        taps: *const f32,
        bias: *const f32,
        out: *mut f32,
        c0: usize,
        d: &Patch,
        epilogue: Epilogue,
    ) {
        let masks: [u16; B] = std::array::from_fn(|v| lanes(d.cout.saturating_sub(c0 + v * 16)));
        // SAFETY (all below): taps inside the image, output channels masked past `cout` (see
        // the caller).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); B]; P];
            if !bias.is_null() {
                for v in 0..B {
                    let b = _mm512_maskz_loadu_ps(masks[v], bias.add(c0 + v * 16));
                    acc.iter_mut().for_each(|px| px[v] = b);
                }
            }
            for ci in 0..d.cin {
                for i in d.rows[0]..d.rows[1] {
                    for j in d.cols[0]..d.cols[1] {
                        let xt = x0.wrapping_add(ci * d.sc + i * d.sy + j * d.sx);
                        let wt = taps.add(((ci * d.kh + i) * d.kw + j) * d.cout + c0);
                        let wv: [__m512; B] = std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], wt.add(v * 16)));
                        for (p, px) in acc.iter_mut().enumerate() {
                            let xv = _mm512_set1_ps(*xt.wrapping_add(p * d.step));
                            for v in 0..B {
                                px[v] = _mm512_fmadd_ps(xv, wv[v], px[v]);
                            }
                        }
                    }
                }
            }
            for (p, px) in acc.iter().enumerate() {
                for v in 0..B {
                    _mm512_mask_storeu_ps(out.add(p * d.cout + c0 + v * 16), masks[v], apply(epilogue, px[v]));
                }
            }
        }
    }

    /// Where a GEMM tile reads each row's values: `taps` runs of `cin` floats per row, which
    /// the weight's panel rows follow in order.
    trait Rows: Copy {
        /// The first of row `r`'s values for tap `t`.
        ///
        /// # Safety
        /// Row `r` and tap `t` must exist.
        unsafe fn at(self, r: usize, t: usize) -> *const f32;
    }

    /// The rows of a dense `[m, k]` matrix: one tap of `k` values each.
    #[derive(Clone, Copy)]
    struct Dense {
        x: *const f32,
        k: usize,
    }

    impl Rows for Dense {
        #[inline(always)]
        unsafe fn at(self, r: usize, _: usize) -> *const f32 {
            // SAFETY: row `r` exists (the caller's).
            unsafe { self.x.add(r * self.k) }
        }
    }

    /// Rows read through a table of pointers, `taps` per row (`super::indirect_f32`).
    #[derive(Clone, Copy)]
    struct Table {
        table: *const *const f32,
        taps: usize,
    }

    impl Rows for Table {
        #[inline(always)]
        unsafe fn at(self, r: usize, t: usize) -> *const f32 {
            // SAFETY: entry `(r, t)` exists (the caller's).
            unsafe { *self.table.add(r * self.taps + t) }
        }
    }

    /// A GEMM's shape besides its rows: taps and values per tap of each row, the output's
    /// width, the bias (or null) and the epilogue.
    struct Shape {
        taps: usize,
        cin: usize,
        n: usize,
        bias: *const f32,
        /// `m * n` values added to the results before the epilogue, or null.
        residual: *const f32,
        epilogue: Epilogue,
    }

    /// A bias and a residual as the tiles read them (null where absent).
    fn addends((bias, residual): (Option<&[f32]>, Option<&[f32]>)) -> (*const f32, *const f32) {
        let at = |s: Option<&[f32]>| s.map_or(std::ptr::null(), |s| s.as_ptr());
        (at(bias), at(residual))
    }

    /// See `super::gemm_f32`.
    ///
    /// # Safety
    /// AVX-512F must be present; the slices must hold `m * k`, `ceil(n / 64) * k * 64`, `n`
    /// and `m * n` elements.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        x: &[f32],
        m: usize,
        k: usize,
        panels: &[f32],
        n: usize,
        add: (Option<&[f32]>, Option<&[f32]>),
        epilogue: Epilogue,
        out: &mut [f32],
    ) {
        let (bias, residual) = addends(add);
        let shape = Shape { taps: 1, cin: k, n, bias, residual, epilogue };
        // SAFETY: as the caller guarantees.
        unsafe { columns(Dense { x: x.as_ptr(), k }, m, &shape, panels, out) }
    }

    /// See `super::indirect_f32`: the GEMM with each row's taps read through `table`.
    ///
    /// # Safety
    /// AVX-512F must be present; `table` holds `m * taps` pointers to `cin` readable floats
    /// each; the other slices hold `ceil(n / 64) * taps * cin * 64`, `n` and `m * n` elements.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn indirect(
        table: &[*const f32],
        m: usize,
        taps: usize,
        cin: usize,
        panels: &[f32],
        n: usize,
        add: (Option<&[f32]>, Option<&[f32]>),
        epilogue: Epilogue,
        out: &mut [f32],
    ) {
        let (bias, residual) = addends(add);
        let shape = Shape { taps, cin, n, bias, residual, epilogue };
        // SAFETY: as the caller guarantees.
        unsafe { columns(Table { table: table.as_ptr(), taps }, m, &shape, panels, out) }
    }

    /// The output's first element, shared by the threads of one GEMM: each writes the rows
    /// and columns of its own blocks only.
    #[derive(Clone, Copy)]
    struct Out(*mut f32);

    // SAFETY: the threads of one call write disjoint elements through it (`columns`), and the
    // call returns only once every thread has finished.
    unsafe impl Sync for Out {}
    // SAFETY: the tables and shapes point at memory the caller keeps alive and unwritten for
    // the whole call; the threads only read through them.
    unsafe impl Sync for Dense {}
    // SAFETY: as for `Dense`.
    unsafe impl Sync for Table {}
    // SAFETY: as for `Dense`.
    unsafe impl Sync for Shape {}

    /// The rows per chunk, a multiple of every tile's height, where a GEMM splits its rows.
    const ROW_CHUNK: usize = 24;

    /// The GEMM's column blocks, outermost: a block's `k x 64` panel of the weight stays in
    /// cache while every group of rows reads it, so the weight streams from memory once per
    /// call. On several threads (`super::parallel`), each takes whole column blocks (its own
    /// share of the weight), and where there are fewer blocks than threads, chunks of rows too.
    #[inline(always)]
    unsafe fn columns<S: Rows + Sync>(rows_of: S, m: usize, s: &Shape, panels: &[f32], out: &mut [f32]) {
        let (k, op) = (s.taps * s.cin, Out(out.as_mut_ptr()));
        let blocks = s.n.div_ceil(super::PANEL);
        let threads =
            super::parallel::share(2 * m * k * s.n, blocks * m.div_ceil(ROW_CHUNK), super::parallel::threads());
        // Rows are split only where there are fewer column blocks than threads.
        let per = m.div_ceil(threads.div_ceil(blocks)).next_multiple_of(ROW_CHUNK);
        let chunks = m.div_ceil(per.max(1));
        super::parallel::for_each(blocks * chunks, threads, &|begin, end| {
            for item in begin..end {
                let (j, r0) = (item % blocks * super::PANEL, item / blocks * per);
                // SAFETY: AVX-512F is present (the callers'); the block's rows and columns
                // exist and no other item writes them.
                unsafe { column_block_rows(rows_of, r0..(r0 + per).min(m), s, panels, op, j, k) };
            }
        });
    }

    /// Rows `range` times the column block from `j`, then GELU over their results while they
    /// are in cache (the other epilogues are applied as the tiles store).
    ///
    /// # Safety
    /// AVX-512F must be present; the rows, the block's columns and its panel exist.
    #[target_feature(enable = "avx512f")]
    unsafe fn column_block_rows<S: Rows>(
        rows_of: S,
        range: std::ops::Range<usize>,
        s: &Shape,
        panels: &[f32],
        op: Out,
        j: usize,
        k: usize,
    ) {
        if !matches!(s.epilogue, Epilogue::Gelu | Epilogue::GeluTanh) {
            // SAFETY: as the caller guarantees.
            unsafe { columns_block(rows_of, range, s, panels, op.0, j, k) };
            return;
        }
        let width = (s.n - j).min(64);
        // SAFETY: as the caller guarantees.
        unsafe { columns_block(rows_of, range.clone(), &Shape { epilogue: Epilogue::None, ..*s }, panels, op.0, j, k) };
        for r in range {
            // SAFETY: this row's part of the block, written above and by no other thread.
            let row = unsafe { std::slice::from_raw_parts_mut(op.0.add(r * s.n + j), width) };
            // SAFETY: AVX-512F is present.
            unsafe { epilogue(s.epilogue, row) };
        }
    }

    /// Rows `range` times the column block from `j` (of `k`-deep panels).
    #[inline(always)]
    unsafe fn columns_block<S: Rows>(
        rows_of: S,
        range: std::ops::Range<usize>,
        s: &Shape,
        panels: &[f32],
        op: *mut f32,
        j: usize,
        k: usize,
    ) {
        // A block narrower than 64 columns (the last, or a small `n`: a 1x1 convolution's
        // 16-48 channels) holds fewer vectors per row, so more rows fit the registers.
        let vectors = (s.n - j).min(64).div_ceil(16);
        // SAFETY: columns from j and their panel exist (see the callers).
        unsafe {
            let wp = panels.as_ptr().add(j / 64 * k * 64);
            match vectors {
                4 => rows::<S, 6, 4>(rows_of, range, wp, op, s, j),
                3 => rows::<S, 8, 3>(rows_of, range, wp, op, s, j),
                2 => rows::<S, 12, 2>(rows_of, range, wp, op, s, j),
                _ => rows::<S, 12, 1>(rows_of, range, wp, op, s, j),
            }
        }
    }

    /// Rows `range` times `V` vectors of the panel at `wp` (columns from `j`): tiles of `R`
    /// rows, then the remainder in tiles of 4, 2 and 1.
    #[inline(always)]
    unsafe fn rows<S: Rows, const R: usize, const V: usize>(
        rows_of: S,
        range: std::ops::Range<usize>,
        wp: *const f32,
        op: *mut f32,
        s: &Shape,
        j: usize,
    ) {
        let (mut i, m) = (range.start, range.end);
        // SAFETY (all below): rows [i, i + tile) and their outputs exist (see the callers).
        unsafe {
            while i + R <= m {
                tile::<S, R, V>(rows_of, i, wp, op.add(i * s.n), s, j);
                i += R;
            }
            while i + 4 <= m {
                tile::<S, 4, V>(rows_of, i, wp, op.add(i * s.n), s, j);
                i += 4;
            }
            if i + 2 <= m {
                tile::<S, 2, V>(rows_of, i, wp, op.add(i * s.n), s, j);
                i += 2;
            }
            if i < m {
                tile::<S, 1, V>(rows_of, i, wp, op.add(i * s.n), s, j);
            }
        }
    }

    /// Rows `[i, i + R)` times the panel of columns `[j, j + 16 V)` (zero past `n`), plus the
    /// bias, then the epilogue, into `out` (row stride `n`, masked past `n`): `R * V`
    /// accumulators held in registers across all the rows' taps and values, each weight
    /// vector loaded once per value.
    #[inline(always)]
    unsafe fn tile<S: Rows, const R: usize, const V: usize>(
        rows_of: S,
        i: usize,
        panel: *const f32,
        out: *mut f32,
        s: &Shape,
        j: usize,
    ) {
        let masks: [u16; V] = std::array::from_fn(|v| lanes(s.n.saturating_sub(j + v * 16)));
        // SAFETY (all below): R rows with `taps` runs of `cin` values; the panel holds `taps *
        // cin` rows of 64; masked lanes past `n` are neither read nor written.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); V]; R];
            if !s.bias.is_null() {
                for v in 0..V {
                    let b = _mm512_maskz_loadu_ps(masks[v], s.bias.add(j + v * 16));
                    acc.iter_mut().for_each(|row| row[v] = b);
                }
            }
            for t in 0..s.taps {
                let rows: [*const f32; R] = std::array::from_fn(|r| rows_of.at(i + r, t));
                let wt = panel.add(t * s.cin * super::PANEL);
                for c in 0..s.cin {
                    let w: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(wt.add(c * super::PANEL + v * 16)));
                    for (r, row) in acc.iter_mut().enumerate() {
                        let a = _mm512_set1_ps(*rows[r].add(c));
                        for v in 0..V {
                            row[v] = _mm512_fmadd_ps(a, w[v], row[v]);
                        }
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for v in 0..V {
                    let mut y = row[v];
                    if !s.residual.is_null() {
                        let at = s.residual.add((i + r) * s.n + j + v * 16);
                        y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(masks[v], at));
                    }
                    let y = apply(s.epilogue, y);
                    _mm512_mask_storeu_ps(out.add(r * s.n + j + v * 16), masks[v], y);
                }
            }
        }
    }
}

/// A max pooling's window: `[kh, kw]` taps at `stride`, the input padded by `padding` (which
/// takes no part: torch pads with -inf), no dilation, output sizes rounded down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl MaxPool {
    /// The output's height and width for an input's; `None` where torch would refuse the
    /// window (padding over half the kernel, an empty output).
    pub fn output(&self, h: usize, w: usize) -> Option<[usize; 2]> {
        let half = |k: usize, p: usize| 2 * p <= k;
        if !half(self.kernel[0], self.padding[0]) || !half(self.kernel[1], self.padding[1]) {
            return None;
        }
        output_size([h, w], self.kernel, self.stride, self.padding).filter(|o| o[0] > 0 && o[1] > 0)
    }
}

/// Max pooling of `x` (channels-last `[batch, h, w, c]`) into `out` (channels-last `[batch,
/// ho, wo, c]`): each output the largest of its window's inputs inside the image, NaN where
/// any is (as torch's kernel). Returns `false` where the slices don't fit the sizes or this
/// CPU lacks AVX-512.
pub fn max_pool_f32(x: &[f32], dims: [usize; 4], pool: &MaxPool, out: &mut [f32]) -> bool {
    let [batch, h, w, c] = dims;
    let Some([ho, wo]) = pool.output(h, w) else { return false };
    let fits = x.len() >= batch * h * w * c && out.len() >= batch * ho * wo * c;
    #[cfg(target_arch = "x86_64")]
    if fits && has_gemm() {
        // SAFETY: AVX-512F is present, and both slices hold what the sizes say (checked).
        unsafe { avx512::max_pool(x, dims, pool, [ho, wo], out) };
        return true;
    }
    let _ = (fits, x, out);
    false
}

/// Along one dimension, for output `o` at stride `s` and padding `p` of a `k`-tap window over
/// `size` inputs: the first tap's input position (negative in the padding), and the range of
/// taps inside the input.
fn inside(o: usize, s: usize, p: usize, k: usize, size: usize) -> (isize, usize, usize) {
    let start = (o * s) as isize - p as isize;
    let first = (-start).max(0) as usize;
    let last = ((size as isize - start).min(k as isize)).max(0) as usize;
    (start, first, last.max(first))
}

/// The mean of each of `out.len()` channels over `pixels` channels-last pixels (`x`: `[pixels,
/// c]`): summed pixel by pixel from zero, then divided by the count. torch's `mean` sums in a
/// cascade of partial sums past 16 pixels, so the two differ by float32 rounding there.
pub fn mean_pixels_f32(x: &[f32], pixels: usize, out: &mut [f32]) {
    let c = out.len();
    out.fill(0.0);
    if c == 0 {
        return;
    }
    for pixel in x.chunks_exact(c).take(pixels) {
        for (o, v) in out.iter_mut().zip(pixel) {
            *o += v;
        }
    }
    let n = pixels as f32;
    out.iter_mut().for_each(|o| *o /= n);
}

/// `a + b` over int64 values, where each operand has `out.len()` elements or one (broadcast):
/// integer addition, exact, wrapping on overflow as torch's kernel does.
pub fn add_i64(a: &[i64], b: &[i64], out: &mut [i64]) {
    let at = |x: &[i64], i: usize| if x.len() == 1 { x[0] } else { x[i] };
    for (i, o) in out.iter_mut().enumerate() {
        *o = at(a, i).wrapping_add(at(b, i));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_i64_broadcasts_one_element() {
        let mut out = [0; 3];
        add_i64(&[1, 2, 3], &[10], &mut out);
        assert_eq!(out, [11, 12, 13]);
        add_i64(&[i64::MAX], &[1, 2, 3], &mut out);
        assert_eq!(out, [i64::MIN, i64::MIN + 1, i64::MIN + 2]);
    }

    #[test]
    fn linear_matches_a_double_precision_reference() {
        for (m, k, n) in [
            (1usize, 64usize, 128usize),
            (3, 100, 70),
            (4, 256, 256),
            (9, 17, 5),
            (2, 1, 1),
            (33, 40, 200),
            (50, 16, 16),
            (31, 24, 40),
            (101, 20, 130),
        ] {
            let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.01).sin()).collect();
            let wt: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.013).cos()).collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.001).collect();
            let mut panels = vec![f32::NAN; k * n.div_ceil(PANEL) * PANEL];
            pack_conv_panels(&wt, [n, k, 1, 1], [1, n, 0, 0], &mut panels);
            for bias in [Some(&b[..]), None] {
                let mut out = vec![f32::NAN; m * n];
                if !linear_f32(&x, m, k, &panels, n, bias, &mut out) {
                    return; // no AVX-512 here: the plan keeps torch's kernel
                }
                for r in 0..m {
                    for j in 0..n {
                        let dot: f64 = (0..k).map(|kk| x[r * k + kk] as f64 * wt[kk * n + j] as f64).sum();
                        let want = dot + bias.map_or(0.0, |b| b[j] as f64);
                        assert!((out[r * n + j] as f64 - want).abs() < 1e-5 * (k as f64).sqrt(), "{m}x{k}x{n} {r} {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn max_pool_takes_each_windows_largest_inside_the_image() {
        if !has_gemm() {
            return;
        }
        for (pool, [h, w]) in [
            (MaxPool { kernel: [3, 3], stride: [2, 2], padding: [1, 1] }, [8, 7]),
            (MaxPool { kernel: [2, 3], stride: [1, 2], padding: [0, 1] }, [5, 6]),
            (MaxPool { kernel: [3, 3], stride: [3, 3], padding: [0, 0] }, [3, 3]),
        ] {
            let (batch, c) = (2, 19);
            let mut x: Vec<f32> = (0..batch * h * w * c).map(|i| ((i * 7919) % 1013) as f32 - 500.0).collect();
            x[c + 3] = f32::NAN;
            let [ho, wo] = pool.output(h, w).unwrap();
            let mut out = vec![0.0; batch * ho * wo * c];
            assert!(max_pool_f32(&x, [batch, h, w, c], &pool, &mut out));
            for b in 0..batch {
                for (oy, ox, ch) in (0..ho).flat_map(|y| (0..wo).flat_map(move |x| (0..c).map(move |ch| (y, x, ch)))) {
                    let mut want = f32::NEG_INFINITY;
                    let mut nan = false;
                    for ky in 0..pool.kernel[0] {
                        for kx in 0..pool.kernel[1] {
                            let iy = (oy * pool.stride[0] + ky) as isize - pool.padding[0] as isize;
                            let ix = (ox * pool.stride[1] + kx) as isize - pool.padding[1] as isize;
                            if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                continue;
                            }
                            let v = x[((b * h + iy as usize) * w + ix as usize) * c + ch];
                            nan |= v.is_nan();
                            want = want.max(v);
                        }
                    }
                    let got = out[((b * ho + oy) * wo + ox) * c + ch];
                    assert!(if nan { got.is_nan() } else { got == want }, "{pool:?} {b} {oy} {ox} {ch}");
                }
            }
        }
        let bad = MaxPool { kernel: [2, 2], stride: [1, 1], padding: [2, 2] };
        assert_eq!(bad.output(4, 4), None, "padding over half the kernel");
    }

    #[test]
    fn layer_norm_matches_a_double_precision_reference() {
        for n in [1usize, 7, 16, 256, 771] {
            let rows = 3;
            // Rows far from zero: the variance is taken around the mean, not from E[x^2].
            let x: Vec<f32> = (0..rows * n).map(|i| 100.0 + (i as f32 * 0.37).sin() * 3.0).collect();
            let w: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32 * 0.11).cos()).collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.01 - 0.5).collect();
            let mut out = vec![f32::NAN; rows * n];
            layer_norm_f32(&x, &w, &b, 1e-5, &mut out);
            for (r, row) in x.chunks(n).enumerate() {
                let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
                let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
                for j in 0..n {
                    let want = (row[j] as f64 - mean) / (var + 1e-5).sqrt() * w[j] as f64 + b[j] as f64;
                    let got = out[r * n + j] as f64;
                    assert!((got - want).abs() < 2e-5, "n={n} row {r} col {j}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn gemm_epilogues_match_torchs_definitions() {
        // 1x1-convolution shapes: many rows (pixels), few columns (channels), each tile width.
        type Definition = (Epilogue, fn(f64) -> f64);
        let defs: [Definition; 8] = [
            (Epilogue::None, |v| v),
            (Epilogue::Relu, |v| v.max(0.0)),
            (Epilogue::Hardswish, |v| v * (v + 3.0).clamp(0.0, 6.0) / 6.0),
            (Epilogue::Hardsigmoid, |v| (v + 3.0).clamp(0.0, 6.0) / 6.0),
            (Epilogue::Sigmoid, |v| 1.0 / (1.0 + (-v).exp())),
            (Epilogue::Swish, |v| v / (1.0 + (-v).exp())),
            (Epilogue::Gelu, |v| 0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2))),
            (Epilogue::GeluTanh, |v| {
                0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
            }),
        ];
        for (m, k, n) in [(49usize, 24usize, 16usize), (23, 16, 40), (7, 9, 72), (196, 40, 240)] {
            let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let wt: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.01 - 0.2).collect();
            let mut panels = vec![0.0; k * n.div_ceil(PANEL) * PANEL];
            pack_conv_panels(&wt, [n, k, 1, 1], [1, n, 0, 0], &mut panels);
            for (epilogue, f) in defs {
                let mut out = vec![f32::NAN; m * n];
                if !gemm_f32(&x, m, k, &panels, n, Some(&b), None, epilogue, &mut out) {
                    return; // no AVX-512 here
                }
                // And the epilogue alone, in place over the plain product (torch's result).
                let mut plain = vec![f32::NAN; m * n];
                assert!(gemm_f32(&x, m, k, &panels, n, Some(&b), None, Epilogue::None, &mut plain));
                assert!(epilogue_f32(epilogue, &mut plain));
                // And with a residual added before the epilogue (`passes::conv_residual`).
                let res: Vec<f32> = (0..m * n).map(|i| (i as f32 * 0.23).cos()).collect();
                let mut added = vec![f32::NAN; m * n];
                assert!(gemm_f32(&x, m, k, &panels, n, Some(&b), Some(&res), epilogue, &mut added));
                for r in 0..m {
                    for j in 0..n {
                        let dot: f64 = (0..k).map(|kk| x[r * k + kk] as f64 * wt[kk * n + j] as f64).sum();
                        let want = f(dot + b[j] as f64);
                        for (how, got) in [("fused", out[r * n + j]), ("after", plain[r * n + j])] {
                            let close = (got as f64 - want).abs() < 2e-6 * (k as f64).sqrt();
                            assert!(close, "{epilogue:?} {how} {m}x{k}x{n} {r} {j}");
                        }
                        let want = f(dot + b[j] as f64 + res[r * n + j] as f64);
                        let close = (added[r * n + j] as f64 - want).abs() < 2e-6 * (k as f64).sqrt();
                        assert!(close, "{epilogue:?} residual {m}x{k}x{n} {r} {j}");
                    }
                }
            }
        }
        assert_eq!(Epilogue::of_attr("swish"), Some(Epilogue::Swish));
        assert_eq!(Epilogue::of_attr("tanh"), None);
        assert_eq!(Epilogue::of_linear("gelu", Some("tanh")), Some(Epilogue::GeluTanh));
        assert_eq!(Epilogue::of_linear("gelu", None), Some(Epilogue::Gelu));
        assert_eq!(Epilogue::of_linear("gelu", Some("sigmoid")), None);
        assert_eq!(Epilogue::of_linear("swish", None), Some(Epilogue::Swish));
    }

    #[test]
    fn depthwise_matches_a_direct_convolution() {
        // (c, kernel, stride, padding, h, w): mobilenet's shapes, odd sizes, a kernel larger
        // than the image with padding, channels that aren't a multiple of 16.
        for (c, k, s, p, h, w) in [(16, 3, 2, 1, 9, 9), (24, 5, 1, 2, 7, 6), (5, 3, 1, 1, 4, 5), (40, 5, 2, 2, 3, 3)] {
            let g = Depthwise::new([c as i64, k as i64, k as i64], [s as i64; 2], [p as i64; 2]).unwrap();
            let [ho, wo] = g.output(h, w).unwrap();
            let x: Vec<f32> = (0..2 * h * w * c).map(|i| (i as f32 * 0.29).sin()).collect();
            let taps: Vec<f32> = (0..k * k * c).map(|i| (i as f32 * 0.07).cos()).collect();
            let bias: Vec<f32> = (0..c).map(|i| i as f32 * 0.1).collect();
            let mut out = vec![f32::NAN; 2 * ho * wo * c];
            if !depthwise_f32(&x, [2, h, w], &taps, &g, Some(&bias), Epilogue::Relu, &mut out) {
                return; // no AVX-512 here
            }
            for b in 0..2 {
                for (oy, ox, ch) in (0..ho).flat_map(|y| (0..wo).flat_map(move |x| (0..c).map(move |ch| (y, x, ch)))) {
                    let mut want = bias[ch] as f64;
                    for (i, j) in (0..k).flat_map(|i| (0..k).map(move |j| (i, j))) {
                        let (y, xx) = ((oy * s + i) as isize - p as isize, (ox * s + j) as isize - p as isize);
                        if (0..h as isize).contains(&y) && (0..w as isize).contains(&xx) {
                            let v = x[((b * h + y as usize) * w + xx as usize) * c + ch] as f64;
                            want += v * taps[(i * k + j) * c + ch] as f64;
                        }
                    }
                    let got = out[((b * ho + oy) * wo + ox) * c + ch] as f64;
                    assert!((got - want.max(0.0)).abs() < 1e-5, "c{c} k{k} s{s} p{p} ({b}, {oy}, {ox}, {ch})");
                }
            }
        }
        assert_eq!(Depthwise::new([4, 3, 3], [0, 1], [0, 0]), None);
        assert_eq!(Depthwise::new([4, 5, 5], [1, 1], [0, 0]).unwrap().output(3, 3), None);
    }

    #[test]
    fn direct_and_indirect_match_a_reference_convolution() {
        // (cin, cout, k, stride, padding, h, w): an RGB stem, odd sizes, 40 outputs (a masked
        // block), a kernel larger than the image with padding, a strided 1×1, 70 outputs
        // over 20 channels (two panels), many pixels.
        let cases = [
            (3, 16, 3, 2, 1, 11, 9),
            (3, 40, 3, 1, 1, 6, 7),
            (2, 8, 5, 2, 2, 3, 4),
            (6, 10, 1, 2, 0, 5, 5),
            (20, 70, 3, 1, 1, 5, 4),
            (1, 4, 3, 1, 1, 120, 100),
        ];
        for (ci, co, k, s, p, h, w) in cases {
            let g = Conv2d::new([co as i64, ci as i64, k as i64, k as i64], [s as i64; 2], [p as i64; 2]).unwrap();
            let [ho, wo] = g.output(h, w).unwrap();
            let x: Vec<f32> = (0..2 * ci * h * w).map(|i| (i as f32 * 0.31).sin()).collect();
            let wts: Vec<f32> = (0..co * ci * k * k).map(|i| (i as f32 * 0.05).cos()).collect(); // [co, ci, k, k]
            let taps: Vec<f32> = (0..ci * k * k * co).map(|t| wts[(t % co) * ci * k * k + t / co]).collect();
            let mut panels = vec![f32::NAN; g.taps() * co.div_ceil(PANEL) * PANEL];
            pack_conv_panels(&wts, [co, ci, k, k], [ci * k * k, k * k, k, 1], &mut panels);
            let bias: Vec<f32> = (0..co).map(|i| i as f32 * 0.1).collect();
            // NCHW, and the same values laid out channels-last.
            let nchw = [ci * h * w, h * w, w, 1];
            let nhwc: Vec<f32> = (0..2 * h * w * ci)
                .map(|i| {
                    let (b, y, xx, c) = (i / (h * w * ci), i / (w * ci) % h, i / ci % w, i % ci);
                    x[b * ci * h * w + c * h * w + y * w + xx]
                })
                .collect();
            type Run<'a> = (&'a str, &'a dyn Fn(&mut [f32]) -> bool);
            let runs: [Run; 3] = [
                ("direct nchw", &|out| direct_f32(&x, [2, h, w], nchw, &taps, &g, Some(&bias), Epilogue::None, out)),
                ("direct nhwc", &|out| {
                    let cl = [h * w * ci, 1, w * ci, ci];
                    direct_f32(&nhwc, [2, h, w], cl, &taps, &g, Some(&bias), Epilogue::None, out)
                }),
                ("indirect", &|out| {
                    indirect_f32(&nhwc, [2, h, w], &panels, &g, Some(&bias), None, Epilogue::None, out)
                }),
            ];
            for (name, run) in runs {
                let mut out = vec![f32::NAN; 2 * ho * wo * co];
                if !run(&mut out) {
                    return; // no AVX-512 here
                }
                for (b, oy, ox, o) in (0..2).flat_map(|b| {
                    (0..ho).flat_map(move |y| (0..wo).flat_map(move |xx| (0..co).map(move |o| (b, y, xx, o))))
                }) {
                    let mut want = bias[o] as f64;
                    for (c, i, j) in (0..ci).flat_map(|c| (0..k).flat_map(move |i| (0..k).map(move |j| (c, i, j)))) {
                        let (y, xx) = ((oy * s + i) as isize - p as isize, (ox * s + j) as isize - p as isize);
                        if (0..h as isize).contains(&y) && (0..w as isize).contains(&xx) {
                            let v = x[((b * ci + c) * h + y as usize) * w + xx as usize] as f64;
                            want += v * wts[((o * ci + c) * k + i) * k + j] as f64;
                        }
                    }
                    let got = out[((b * ho + oy) * wo + ox) * co + o] as f64;
                    let tolerance = 1e-6 * g.taps() as f64;
                    assert!(
                        (got - want).abs() < tolerance,
                        "{name} {ci}->{co} k{k} s{s} ({b}, {oy}, {ox}, {o}): {got} {want}"
                    );
                }
            }
        }
    }

    /// erf in double: its Taylor series below 2.5, else 1 - erfc by erfc's continued fraction.
    fn erf(z: f64) -> f64 {
        if z.abs() >= 2.5 {
            let a = z.abs();
            let f = (1..80).rev().fold(a, |f, n| a + (n as f64 / 2.0) / f);
            return z.signum() * (1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * f));
        }
        let (mut term, mut sum) = (z, z);
        for n in 1..200 {
            term *= -z * z / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn gelu_matches_a_double_precision_reference() {
        let x: Vec<f32> = (0..301).map(|i| (i as f32 - 150.0) * 0.07).chain([-90.0, 90.0, 0.0]).collect();
        for tanh in [false, true] {
            let mut out = vec![f32::NAN; x.len()];
            if !gelu_f32(&x, tanh, &mut out) {
                return; // no AVX-512 here: torch's op runs
            }
            for (&v, &got) in x.iter().zip(&out) {
                let v = v as f64;
                let want = if tanh {
                    0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
                } else {
                    0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2))
                };
                assert!((got as f64 - want).abs() <= 2e-7 * v.abs().max(1.0), "tanh={tanh} x={v}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn rms_norm_normalizes_each_row() {
        let x: Vec<f32> = (0..70).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let w: Vec<f32> = (0..35).map(|i| 0.5 + i as f32 * 0.01).collect();
        let mut out = vec![0.0; 70];
        rms_norm_f32(&x, &w, 1e-6, &mut out);
        for r in 0..2 {
            let row = &x[r * 35..(r + 1) * 35];
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 35.0;
            for i in 0..35 {
                let want = w[i] as f64 * row[i] as f64 / (ms + 1e-6).sqrt();
                assert!((out[r * 35 + i] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0), "{r} {i}");
            }
        }
    }
}

#[cfg(test)]
mod attention_tests {
    use super::*;

    /// `[batch, heads, rows, cols]` values of `f`, laid out `[batch, rows, heads, cols]` (the
    /// transposed view attention reads from a projection), and that layout's strides.
    fn transposed(g: &Attention, rows: usize, cols: usize, f: impl Fn(usize) -> f32) -> (Vec<f32>, [usize; 3]) {
        let data = (0..g.batch * rows * g.heads * cols).map(f).collect();
        (data, [rows * g.heads * cols, cols, g.heads * cols])
    }

    /// The reference in double precision, `None` where a row has no key.
    fn reference(
        g: &Attention,
        (q, qs): (&[f32], [usize; 3]),
        (k, ks): (&[f32], [usize; 3]),
        (v, vs): (&[f32], [usize; 3]),
        mask: &dyn Fn(usize, usize, usize, usize) -> Option<f64>,
    ) -> Option<Vec<f64>> {
        let mut out = vec![0.0; g.batch * g.l * g.heads * g.ev];
        for b in 0..g.batch {
            for h in 0..g.heads {
                for i in 0..g.l {
                    let scores: Vec<Option<f64>> = (0..g.s)
                        .map(|j| {
                            let dot: f64 = (0..g.e)
                                .map(|c| {
                                    q[b * qs[0] + h * qs[1] + i * qs[2] + c] as f64
                                        * k[b * ks[0] + h * ks[1] + j * ks[2] + c] as f64
                                })
                                .sum();
                            mask(b, h, i, j).map(|m| dot * g.scale as f64 + m).filter(|x| x.is_finite())
                        })
                        .collect();
                    let max = scores.iter().flatten().cloned().fold(f64::NEG_INFINITY, f64::max);
                    if max == f64::NEG_INFINITY {
                        return None;
                    }
                    let p: Vec<f64> = scores.iter().map(|s| s.map_or(0.0, |s| (s - max).exp())).collect();
                    let sum: f64 = p.iter().sum();
                    for c in 0..g.ev {
                        let acc: f64 = (0..g.s).map(|j| p[j] * v[b * vs[0] + h * vs[1] + j * vs[2] + c] as f64).sum();
                        out[((b * g.l + i) * g.heads + h) * g.ev + c] = acc / sum;
                    }
                }
            }
        }
        Some(out)
    }

    #[test]
    fn attention_matches_a_double_precision_reference() {
        if !has_gemm() {
            return;
        }
        for (batch, heads, l, s, e, ev) in
            [(1, 4, 32, 32, 64, 64), (2, 3, 5, 37, 24, 80), (1, 1, 1, 1, 1, 1), (2, 2, 9, 16, 16, 130)]
        {
            let g = Attention { batch, heads, l, s, e, ev, scale: 1.0 / (e as f32).sqrt() };
            let (q, qs) = transposed(&g, l, e, |i| (i as f32 * 0.37).sin());
            let (k, ks) = transposed(&g, s, e, |i| (i as f32 * 0.11).cos());
            let (v, vs) = transposed(&g, s, ev, |i| (i as f32 * 0.07).sin() * 3.0);
            // A padding-style bool mask over [batch, 1, 1, s] (zero strides where broadcast), a
            // float mask over [l, s] with some -inf, and the causal triangle.
            let keep: Vec<u8> = (0..batch * s).map(|i| u8::from(i % s == 0 || i % 3 != 1)).collect();
            let add: Vec<f32> = (0..l * s)
                .map(|i| if i % s != 0 && i % 5 == 2 { f32::NEG_INFINITY } else { (i as f32).sin() })
                .collect();
            // And masks that vary along the queries only (BERT's: keys at stride 0).
            let rows: Vec<u8> = (0..l).map(|i| u8::from(i % 4 != 3)).collect();
            let row_add: Vec<f32> = (0..l).map(|i| (i as f32).cos()).collect();
            type Case<'a> = (AttentionMask<'a>, &'a dyn Fn(usize, usize, usize, usize) -> Option<f64>);
            let cases: [Case; 6] = [
                (AttentionMask::None, &|_, _, _, _| Some(0.0)),
                (AttentionMask::Causal, &|_, _, i, j| (j <= i).then_some(0.0)),
                (AttentionMask::Bool(&keep, [s, 0, 0, 1]), &|b, _, _, j| (keep[b * s + j] != 0).then_some(0.0)),
                (AttentionMask::Float(&add, [0, 0, s, 1]), &|_, _, i, j| Some(add[i * s + j] as f64)),
                (AttentionMask::Float(&row_add, [0, 0, 1, 0]), &|_, _, i, _| Some(row_add[i] as f64)),
                (AttentionMask::Bool(&rows, [0, 0, 1, 0]), &|_, _, i, _| (rows[i] != 0).then_some(0.0)),
            ];
            for (mask, want_mask) in cases {
                let mut out = vec![f32::NAN; batch * l * heads * ev];
                let ok = attention_f32((&q, qs), (&k, ks), (&v, vs), &g, mask, &mut out);
                let want = reference(&g, (&q, qs), (&k, ks), (&v, vs), want_mask);
                assert_eq!(ok, want.is_some(), "{g:?} {mask:?}");
                let Some(want) = want else { continue };
                let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                for (got, want) in out.iter().zip(&want) {
                    assert!((*got as f64 - want).abs() <= 1e-5 * scale, "{g:?} {mask:?}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn a_query_with_no_key_is_left_to_torch() {
        if !has_gemm() {
            return;
        }
        let g = Attention { batch: 1, heads: 1, l: 2, s: 3, e: 2, ev: 2, scale: 1.0 };
        let x = [0.5f32; 6];
        let keep = [1u8, 1, 1, 0, 0, 0];
        let mut out = [0.0f32; 4];
        let ok = attention_f32(
            (&x[..4], [4, 4, 2]),
            (&x, [6, 6, 2]),
            (&x, [6, 6, 2]),
            &g,
            AttentionMask::Bool(&keep, [0, 0, 3, 1]),
            &mut out,
        );
        assert!(!ok);
    }
}
