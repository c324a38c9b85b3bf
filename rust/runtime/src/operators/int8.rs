//! The int8 linear and convolution (`kwexport::linear_int8`, `kwexport::conv_int8`,
//! `passes::linear_int8`) on `kernels::int8`: the weight packed on the node's first call, the
//! input quantized and multiplied per call.

use std::sync::OnceLock;

use super::Operators;
use crate::abi::{Abi, CError, Raw, Tensor};
use crate::kernels::{
    self,
    int8::{Layout, Packed, Quant},
};

/// How an int8 linear's input is quantized: by the scale and zero point given, or by those
/// `Quant::choose` picks for it (dynamic quantization).
#[derive(Debug, Clone, Copy)]
pub enum Int8Input {
    Given(Quant),
    Chosen { qmin: i64, qmax: i64, eps: f64 },
}

/// An int8 linear's weight as a call hands it to the kernel: its panels (`Int8Panels`),
/// their layout and the weight's greatest magnitude, its `[n, k]`, its float32 `[n]` scales
/// and its bias.
#[derive(Debug, Clone, Copy)]
pub struct Int8Weight {
    pub panels: Raw,
    pub layout: Layout,
    pub peak: u8,
    pub n: i64,
    pub k: i64,
    pub scale: Raw,
    pub bias: Option<Raw>,
}

/// An int8 linear's or convolution's weight packed for the kernel on its first call (as
/// [`super::Panels`]): the int8 weight and its zero points, as constants of the plan, the
/// convolution's groups (1 for a linear), and its input's levels (`qmax - qmin`), which with
/// the weight's values choose the layout (`Layout::choose`).
#[derive(Debug)]
pub struct Int8Panels {
    weight: usize,
    zero_point: usize,
    groups: usize,
    levels: i64,
    packed: OnceLock<Option<(Tensor, Layout, u8)>>,
    winograd: OnceLock<Option<Tensor>>,
}

impl Int8Panels {
    pub fn new(weight: usize, zero_point: usize, groups: usize, levels: i64) -> Int8Panels {
        Int8Panels { weight, zero_point, groups, levels, packed: OnceLock::new(), winograd: OnceLock::new() }
    }

    /// The packed panels, their layout (one the kernels that run here read) and the weight's
    /// greatest magnitude, packed now if no call did yet; `None` where the weight isn't one
    /// the kernel takes or kwexport's kernels don't run here (then every call runs the op's
    /// Python form).
    pub fn get(&self, abi: &Abi, consts: &[Tensor]) -> Option<(Raw, Layout, u8)> {
        let packed = self.packed.get_or_init(|| {
            let (weight, zero_point) = (consts.get(self.weight)?.raw(), consts.get(self.zero_point)?.raw());
            Operators(abi).pack_int8_panels(weight, zero_point, self.levels, self.groups)
        });
        packed.as_ref().map(|(t, layout, peak)| (t.raw(), *layout, *peak))
    }

    /// The weight as the int8 Winograd kernel's panels (`kernels::int8::winograd::pack`), for
    /// a convolution of geometry `g` on `[h, w]` images that the transforms pay on
    /// (`kernels::int8::winograd::pays`: pairs, which [`get`] chose, with enough channels and
    /// pixels), packed now if no call did yet; `None` elsewhere.
    ///
    /// [`get`]: Int8Panels::get
    pub fn winograd(&self, abi: &Abi, consts: &[Tensor], g: &kernels::Conv2d, hw: [usize; 2]) -> Option<Raw> {
        let (_, layout, _) = self.get(abi, consts)?;
        if !kernels::int8::winograd::pays(g, layout, hw) {
            return None;
        }
        let packed = self.winograd.get_or_init(|| Operators(abi).pack_int8_winograd(consts.get(self.weight)?.raw()));
        packed.as_ref().map(Tensor::raw)
    }
}

impl Operators<'_> {
    /// An int8 CPU `[n, k]` weight or `[n, k, kh, kw]` convolution weight of `groups` groups
    /// (any strides) as `kernels::int8`'s panels (`Layout::pack_conv`'s for a convolution,
    /// which for 1×1 are the matrix's) in the layout chosen for it and an input of `levels`
    /// levels, held in a float32 tensor's bytes, with the layout and the weight's greatest
    /// magnitude; `None` unless its zero points (a CPU `[n]` int64 or int32 tensor) are all
    /// 0, the kernel's symmetric weights, and the groups divide `n`.
    fn pack_int8_panels(
        &self,
        weight: Raw,
        zero_point: Raw,
        levels: i64,
        groups: usize,
    ) -> Option<(Tensor, Layout, u8)> {
        let shims = self.0.shims.as_ref()?;
        let (int8, int64, int32) = (self.0.dtype_code("int8")?, self.0.dtype_code("int64"), self.0.dtype_code("int32"));
        // SAFETY: live handles (the plan's constants).
        let ((sizes, strides), zp_sizes) =
            unsafe { (self.0.sizes_strides(weight)?, self.0.contiguous_sizes(zero_point)?) };
        let (shape, st) = match (sizes.as_slice(), strides.as_slice()) {
            (&[n, k], &[s0, s1]) => ([n, k, 1, 1], [s0, s1, 0, 0]),
            (&[n, k, kh, kw], &[s0, s1, s2, s3]) => ([n, k, kh, kw], [s0, s1, s2, s3]),
            _ => return None,
        };
        let n = shape[0];
        // SAFETY: live handles.
        let on_cpu = |t: Raw| unsafe { shims.is_cpu(t) };
        let zp_dtype = shims.dtype(zero_point);
        let zp_int = zp_dtype.is_some() && (zp_dtype == int64 || zp_dtype == int32);
        if shims.dtype(weight) != Some(int8) || !on_cpu(weight) || !on_cpu(zero_point) || !zp_int || zp_sizes != [n] {
            return None;
        }
        let (shape, st) = (unsigned(shape)?, unsigned(st)?);
        let n = shape[0];
        if shape.contains(&0) || !n.is_multiple_of(groups) {
            return None;
        }
        // SAFETY: an int8 CPU tensor spanning these elements from its first at these strides
        // (checked above).
        let src =
            unsafe { std::slice::from_raw_parts(shims.data_ptr(weight)? as *const i8, kernels::span(&shape, &st)) };
        let [sn, sc, sh, sw] = st;
        let [_, c, h, w] = shape;
        let values =
            (0..n * c * h * w).map(|i| src[i / (c * h * w) * sn + i / (h * w) % c * sc + i / w % h * sh + i % w * sw]);
        let peak = kernels::int8::peak(values);
        let layout = Layout::choose(levels, peak)?;
        if layout.conv_depth(shape) > kernels::int8::MAX_K {
            return None;
        }
        // SAFETY: the zero points are `n` contiguous integers of the dtype just checked.
        let zeros = unsafe {
            let p = shims.data_ptr(zero_point)?;
            match zp_dtype == int64 {
                true => std::slice::from_raw_parts(p as *const i64, n).iter().all(|&z| z == 0),
                false => std::slice::from_raw_parts(p as *const i32, n).iter().all(|&z| z == 0),
            }
        };
        if !zeros {
            return None;
        }
        let paired = kernels::int8::pairs_groups(layout, shape, groups);
        let len = layout.conv_packed_len(shape, groups, paired);
        let out = self.owned(shims.empty_f32(&[i64::try_from(len).ok()?])).ok()?;
        // SAFETY: the fresh output, which aliases nothing, as 4-byte words.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(shims.data_ptr(out.raw())? as *mut u32, len);
            layout.pack_conv(src, shape, st, groups, paired, dst);
        }
        Some((out, layout, peak))
    }

    /// An int8 CPU `[n, cin, 3, 3]` weight (any strides; its zero points checked by
    /// `pack_int8_panels`) as the int8 Winograd kernel's panels, held in a float32 tensor's
    /// bytes.
    fn pack_int8_winograd(&self, weight: Raw) -> Option<Tensor> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: a live handle (the plan's constant).
        let (sizes, strides) = unsafe { self.0.sizes_strides(weight)? };
        let (shape, st): ([i64; 4], [i64; 4]) = (sizes.try_into().ok()?, strides.try_into().ok()?);
        let (shape, st) = (unsigned(shape)?, unsigned(st)?);
        if shims.dtype(weight) != self.0.dtype_code("int8") || shape[2..] != [3, 3] {
            return None;
        }
        // SAFETY: an int8 CPU tensor (checked by `pack_int8_panels` before) spanning these
        // elements from its first at these strides.
        let src =
            unsafe { std::slice::from_raw_parts(shims.data_ptr(weight)? as *const i8, kernels::span(&shape, &st)) };
        let len = kernels::int8::winograd::packed_len([shape[0], shape[1]]);
        let out = self.owned(shims.empty_f32(&[i64::try_from(len).ok()?])).ok()?;
        // SAFETY: the fresh output, which aliases nothing, as 4-byte words.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(shims.data_ptr(out.raw())? as *mut u32, len);
            kernels::int8::winograd::pack(src, [shape[0], shape[1]], st, dst);
        }
        Some(out)
    }

    /// The value of a one-element CPU tensor of float32, float64, int64 or int32 (a dynamic
    /// quantization's scale or zero point), as a double.
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn scalar(&self, t: Raw) -> Option<f64> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: a live handle.
        let sizes = unsafe { self.0.sizes_strides(t) }?.0;
        // SAFETY: a live handle.
        if sizes.iter().product::<i64>() != 1 || !unsafe { shims.is_cpu(t) } {
            return None;
        }
        let (dtype, code) = (shims.dtype(t)?, |name| self.0.dtype_code(name));
        // SAFETY: one element of the dtype just read, at the tensor's first element.
        unsafe {
            let p = shims.data_ptr(t)?;
            Some(match Some(dtype) {
                d if d == code("float32") => *(p as *const f32) as f64,
                d if d == code("float64") => *(p as *const f64),
                d if d == code("int64") => *(p as *const i64) as f64,
                d if d == code("int32") => *(p as *const i32) as f64,
                _ => return None,
            })
        }
    }

    /// `fake_quantize_per_tensor_affine(x, ...)` with `quant`'s parameters on kwexport's kernel:
    /// a new tensor laid out as `x` (a dense float32 CPU tensor in any order of its
    /// dimensions: channels-last stays so), or `None` where `x` doesn't qualify (torch's op
    /// then runs).
    ///
    /// # Safety
    /// `x` must be a live handle.
    pub unsafe fn fake_quantize(&self, x: Raw, quant: &Quant) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: a live handle; a dense tensor's `len` elements from its first.
        let (xs, (sizes, strides)) = unsafe {
            let len = self.dense_f32_len(x)?;
            (self.floats(x, len)?, self.0.sizes_strides(x)?)
        };
        // Laid out as `x`: element `i` of both buffers is the same element of the tensors.
        let mut out = match self.owned(shims.empty_f32_strided(&sizes, &strides)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output, as dense as `x`, of as many elements.
        let os = unsafe { self.floats_mut(&mut out, xs.len()) }?;
        kernels::int8::fake_quantize_f32(xs, quant, os).ok().map(|()| Ok(out))
    }

    /// kwexport's int8 linear of `x` (float32 on the CPU, `[..., k]`: contiguous, or rows of
    /// `k` evenly apart, as a slice of a channels-last tensor's channels is), quantized as
    /// `input` says, with `weight`, then `epilogue` (the activation fused with it) and the
    /// `output` quantization fused with it, if any: a new `[..., n]` tensor, or `None` where
    /// the tensors or the quantizations don't qualify (the caller runs the op's Python form).
    ///
    /// # Safety
    /// Every handle must be live.
    pub unsafe fn linear_int8(
        &self,
        x: Raw,
        input: Int8Input,
        weight: Int8Weight,
        (epilogue, output): (kernels::Epilogue, Option<Quant>),
    ) -> Option<Result<Tensor, CError>> {
        let Int8Weight { panels, layout, peak, n, k, scale: w_scale, bias } = weight;
        let shims = self.0.shims.as_ref()?;
        // SAFETY: live handles.
        let (xs, ld, ws, bias, mut sizes) = unsafe {
            let (sizes, strides) = self.0.sizes_strides(x)?;
            if *sizes.last()? != k || !shims.is_cpu_f32(x) {
                return None;
            }
            let (m, ld) = rows_of(&sizes, &strides)?;
            let n = usize::try_from(n).ok()?;
            let span = if m == 0 { 0 } else { (m - 1) * ld + k as usize };
            (self.floats(x, span)?, ld, self.contiguous_f32(w_scale, &[n as i64])?, self.bias_f32(bias, n)?, sizes)
        };
        let [n, k] = [n as usize, k as usize];
        let m = if xs.is_empty() { 0 } else { (xs.len() - k) / ld + 1 };
        let quant = match input {
            Int8Input::Given(q) => q,
            // Chosen from the rows' elements: a gap between rows would take part.
            Int8Input::Chosen { .. } if ld != k => return None,
            Int8Input::Chosen { qmin, qmax, eps } => Quant::choose(xs, qmin, qmax, eps)?,
        };
        *sizes.last_mut()? = n as i64;
        let mut out = match self.owned(shims.empty_f32(&sizes)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the panels are `layout.packed_len([n, k])` words (`pack_int8_panels` made
        // them), and the new output has `m * n` floats, which nothing else holds.
        let ran = unsafe {
            let len = layout.packed_len([n, k]);
            let words = std::slice::from_raw_parts(shims.data_ptr(panels)? as *const u32, len);
            let os = self.floats_mut(&mut out, m * n)?;
            let post = (epilogue, output.as_ref());
            kernels::int8::linear((xs, ld), [m, k, n], &quant, Packed { words, layout, peak }, ws, bias, post, os)
        };
        ran.ok().map(|()| Ok(out))
    }
}

impl Operators<'_> {
    /// An int8 1×1 expansion and the float32 depthwise convolution of its result as one
    /// kernel (`kernels::int8::expand_depthwise`; `plan::heads`): `x` is the linear's input,
    /// a float32 CPU `[N, H, W, K]` tensor whose pixels' channels are rows evenly apart (the
    /// `movedim` of a channels-last image), quantized by `quant`; `weight`, `epilogue` and
    /// `output` are the linear's, `taps` (`[kh * kw, C]`), `g`, `dw_bias` and `dw_epilogue`
    /// the depthwise convolution's. A new channels-last `[N, C, Ho, Wo]` tensor, or `None`
    /// where the tensors don't qualify, the expanded image is too small for the fused kernel
    /// to pay (`kernels::expand_depthwise::pays`) or the kernel declines (nothing written:
    /// the caller runs the two nodes).
    ///
    /// # Safety
    /// Every handle must be live.
    pub unsafe fn expand_depthwise_int8(
        &self,
        x: Raw,
        quant: &Quant,
        weight: Int8Weight,
        (epilogue, output): (kernels::Epilogue, Option<Quant>),
        (taps, g, dw_bias, dw_epilogue): (Raw, &kernels::Depthwise, Option<Raw>, kernels::Epilogue),
    ) -> Option<Result<Tensor, CError>> {
        let Int8Weight { panels, layout, peak, n, k, scale: w_scale, bias } = weight;
        let shims = self.0.shims.as_ref()?;
        let c = g.channels;
        let [n, k] = [usize::try_from(n).ok()?, usize::try_from(k).ok()?];
        // SAFETY: live handles.
        let (xs, [batch, h, w], ld, ws, bias, ts, dbs) = unsafe {
            let (sizes, strides) = self.0.sizes_strides(x)?;
            let &[batch, h, w, kx] = sizes.as_slice() else { return None };
            if kx != k as i64 || n != c || batch * h * w == 0 || !shims.is_cpu_f32(x) {
                return None;
            }
            let dims = [batch, h, w].map(|d| d as usize);
            if !kernels::expand_depthwise::pays(dims[1] * dims[2] * c) {
                return None;
            }
            let ld = usize::try_from(super::copy::row_stride(&[0, 1, 2, 3], 3, &sizes, &strides)?).ok()?;
            let pixels = dims.iter().product::<usize>();
            let xs = self.floats(x, (pixels - 1) * ld + k)?;
            let ts = self.contiguous_f32(taps, &[(g.kernel[0] * g.kernel[1]) as i64, c as i64])?;
            let ws = self.contiguous_f32(w_scale, &[n as i64])?;
            (xs, dims, ld, ws, self.bias_f32(bias, n)?, ts, self.bias_f32(dw_bias, c)?)
        };
        let [ho, wo] = g.output(h, w)?;
        // SAFETY: no part: a new tensor.
        let out = match unsafe { self.conv_output([batch, c, ho, wo], None) }? {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        let dw = kernels::expand_depthwise::DepthwiseWeights { taps: ts, bias: dbs, epilogue: dw_epilogue };
        // SAFETY: the panels are `layout.packed_len([n, k])` words (`pack_int8_panels` made
        // them); `xs` spans the input's pixels and `out` is a new tensor of the output's,
        // which nothing else writes while the kernel runs.
        let ran = unsafe {
            let len = layout.packed_len([n, k]);
            let words = std::slice::from_raw_parts(shims.data_ptr(panels)? as *const u32, len);
            kernels::int8::expand_depthwise(
                (xs.as_ptr(), ld),
                [batch, h, w, k],
                quant,
                Packed { words, layout, peak },
                (ws, bias),
                (epilogue, output.as_ref()),
                g,
                dw,
                (out.ptr, out.ld),
            )
        };
        ran.ok().map(|()| Ok(out.tensor))
    }

    /// kwexport's int8 convolution (`kernels::int8::conv`) of `x`, a float32 CPU `[N, C, H,
    /// W]` tensor (channels-last, or a slice of a wider one's channels; a contiguous one is
    /// transposed to that first: an image), quantized as `input` says (parameters chosen from
    /// a dense tensor's values only: a slice's gaps would take part), with `weight` (its panels
    /// packed for `g`), then `epilogue` and the `output` quantization fused with it: a new
    /// channels-last `[N, n, Ho, Wo]` tensor, or `None` where the tensors don't qualify (the
    /// caller runs the op's Python form). A `residual` (`passes::conv_residual`: the output's
    /// shape, channels-last, float32) is added to each result before the epilogue.
    /// `winograd` gives, for the input's `[H, W]`, the weight's panels for the Winograd kernel
    /// where that kernel pays (`Int8Panels::winograd`), which then runs it.
    ///
    /// # Safety
    /// Every handle must be live, and nothing writes the residual during the call.
    pub unsafe fn conv_int8(
        &self,
        x: Raw,
        input: Int8Input,
        weight: Int8Weight,
        (g, residual): (&kernels::Conv2d, Option<Raw>),
        (epilogue, output): (kernels::Epilogue, Option<Quant>),
        winograd: impl FnOnce([usize; 2]) -> Option<Raw>,
    ) -> Option<Result<Tensor, CError>> {
        let Int8Weight { panels, layout, peak, scale: w_scale, bias, .. } = weight;
        let (cin, n) = (g.in_channels, g.out_channels);
        let shims = self.0.shims.as_ref()?;
        let image: Vec<f32>;
        // SAFETY: live handles.
        let ((xs, [batch, h, w], ld), ws, bias) = unsafe {
            let rows = match self.channels_last_rows(x, cin) {
                Some(rows) => rows,
                None => {
                    let sizes = self.0.contiguous_sizes(x)?;
                    let &[batch, c, h, w] = sizes.as_slice() else { return None };
                    let dims = [batch, c, h * w].map(|v| usize::try_from(v).ok());
                    let [Some(batch), Some(c), Some(pixels)] = dims else { return None };
                    let xs = self.contiguous_f32(x, &sizes)?;
                    let mut copy = vec![0f32; xs.len()];
                    kernels::copy::swap_axes(xs, [batch, c, pixels, 1], &mut copy);
                    image = copy;
                    (&image[..], [batch, h as usize, w as usize], cin)
                }
            };
            (rows, self.contiguous_f32(w_scale, &[n as i64])?, self.bias_f32(bias, n)?)
        };
        let input = match input {
            Int8Input::Given(q) => q,
            Int8Input::Chosen { .. } if ld != cin => return None,
            Int8Input::Chosen { qmin, qmax, eps } => Quant::choose(&xs[..batch * h * w * cin], qmin, qmax, eps)?,
        };
        let [ho, wo] = g.output(h, w)?;
        // SAFETY: a live handle, which nothing writes during the call (the caller's).
        let rs = unsafe { self.residual_f32(residual, [batch, n, ho, wo]) }?;
        let mut out = match self.empty_channels_last([batch, n, ho, wo]) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the panels are `layout.conv_packed_len` words for this weight
        // (`pack_int8_panels` made them), and the new output has its floats, which nothing
        // else holds.
        let ran = unsafe {
            let shape = [n, cin / g.groups, g.kernel[0], g.kernel[1]];
            let paired = kernels::int8::pairs_groups(layout, shape, g.groups);
            let len = layout.conv_packed_len(shape, g.groups, paired);
            let words = std::slice::from_raw_parts(shims.data_ptr(panels)? as *const u32, len);
            let os = self.floats_mut(&mut out, batch * ho * wo * n)?;
            let post = (epilogue, output.as_ref());
            let by_winograd = winograd([h, w]).and_then(|p| {
                let len = kernels::int8::winograd::packed_len([n, cin]);
                let panels = std::slice::from_raw_parts(shims.data_ptr(p)? as *const u32, len);
                let dims = [batch, h, w];
                Some(kernels::int8::winograd::conv((xs, ld), dims, g, &input, panels, ws, (bias, rs), post, os))
            });
            match by_winograd {
                Some(Ok(())) => Ok(()),
                _ => {
                    let weight = Packed { words, layout, peak };
                    kernels::int8::conv((xs, ld), [batch, h, w], g, &input, weight, ws, (bias, rs), post, os)
                }
            }
        };
        ran.ok().map(|()| Ok(out))
    }
}

/// Four sizes or strides as `usize`s, `None` where one is negative.
fn unsigned(v: [i64; 4]) -> Option<[usize; 4]> {
    let u = |i: usize| usize::try_from(v[i]).ok();
    Some([u(0)?, u(1)?, u(2)?, u(3)?])
}

/// The rows of a `[..., k]` view whose last dimension is contiguous and whose other
/// dimensions lay rows out evenly (`copy::row_stride` in their order): how many, and how far
/// apart in elements. `None` for any other view.
fn rows_of(sizes: &[i64], strides: &[i64]) -> Option<(usize, usize)> {
    let (_, lead) = sizes.split_last()?;
    let m = usize::try_from(lead.iter().product::<i64>()).ok()?;
    let order: Vec<usize> = (0..sizes.len()).collect();
    Some((m, usize::try_from(super::copy::row_stride(&order, sizes.len() - 1, sizes, strides)?).ok()?))
}

#[cfg(test)]
mod tests {
    use super::rows_of;

    #[test]
    fn rows_of_contiguous_and_sliced_views() {
        assert_eq!(rows_of(&[2, 3, 4], &[12, 4, 1]), Some((6, 4)));
        // A chunk of 4 of 10 channels-last channels, moved last: [N, H, W, 4] at row 10.
        assert_eq!(rows_of(&[2, 5, 7, 4], &[350, 70, 10, 1]), Some((70, 10)));
        // A gap between images too, or a strided last dimension: not evenly apart.
        assert_eq!(rows_of(&[2, 5, 7, 4], &[400, 70, 10, 1]), None);
        assert_eq!(rows_of(&[3, 4], &[8, 2]), None);
    }
}
