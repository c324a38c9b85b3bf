//! kwexport's kernels as operators on torch's tensors: each checks that the handles qualify
//! (dtype, device, layout, sizes), allocates the output, packs weights, and runs the kernel
//! on the tensors' memory; `None` where the tensors don't qualify (the caller runs torch's
//! op). The binding to torch's C ABI itself is `super` (`mod.rs`).

use super::*;

impl Abi {
    /// A tensor a shim made (`empty_strided`), owned here, or the error torch reported.
    fn owned(&self, made: Result<Raw, Status>) -> Result<Tensor, CError> {
        match made {
            Ok(raw) => Ok(Tensor(raw, self.delete_tensor)),
            Err(status) => Err(self.check(status).err().unwrap_or_else(|| CError::Internal("empty_strided".into()))),
        }
    }

    /// kwexport's RMS norm of `x` (`[..., n]`) with weight `w` (`[n]`), both contiguous
    /// float32 CPU tensors: a new tensor, or `None` where they don't qualify (the caller runs
    /// torch's op, which also raises for a size that isn't `n`).
    ///
    /// # Safety
    /// Both must be live handles.
    pub unsafe fn rms_norm(&self, x: Raw, w: Raw, eps: f64, normalized: i64) -> Option<Result<Tensor, CError>> {
        let shims = self.shims.as_ref()?;
        // SAFETY: live handles.
        let (xs, ws) = unsafe {
            if !shims.is_cpu_f32(x) || !shims.is_cpu_f32(w) {
                return None;
            }
            (self.contiguous_sizes(x)?, self.contiguous_sizes(w)?)
        };
        let (&n, [wn]) = (xs.last()?, ws.as_slice()) else { return None };
        if n != *wn || n != normalized || n == 0 {
            return None;
        }
        let len = usize::try_from(xs.iter().product::<i64>()).ok()?;
        let out = match self.owned(shims.empty_f32(&xs)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: contiguous float32 CPU tensors of `len` and `n` elements (checked above), and
        // the fresh output of `len`; none aliases another (the output is new).
        unsafe {
            let (px, pw, po) = (shims.data_ptr(x)?, shims.data_ptr(w)?, shims.data_ptr(out.0)?);
            let xs = std::slice::from_raw_parts(px as *const f32, len);
            let ws = std::slice::from_raw_parts(pw as *const f32, n as usize);
            let os = std::slice::from_raw_parts_mut(po as *mut f32, len);
            crate::kernels::rms_norm_f32(xs, ws, eps as f32, os);
        }
        Some(Ok(out))
    }

    /// kwexport's layer norm of `x` (`[..., n]`) with weight `w` and bias `b` (`[n]`), all
    /// contiguous float32 CPU tensors: a new tensor, or `None` where they don't qualify (the
    /// caller runs torch's op, which also raises for a size that isn't `n`).
    ///
    /// # Safety
    /// All must be live handles.
    pub unsafe fn layer_norm(
        &self,
        x: Raw,
        w: Raw,
        b: Raw,
        eps: f64,
        normalized: i64,
    ) -> Option<Result<Tensor, CError>> {
        let shims = self.shims.as_ref()?;
        // SAFETY: live handles.
        let (sizes, ws, bs) = unsafe {
            let sizes = self.contiguous_sizes(x)?;
            let n = usize::try_from(*sizes.last()?).ok()?;
            if !shims.is_cpu_f32(x) || n == 0 || i64::try_from(n).ok()? != normalized {
                return None;
            }
            (sizes, self.contiguous_f32(w, &[normalized])?, self.contiguous_f32(b, &[normalized])?)
        };
        let len = usize::try_from(sizes.iter().product::<i64>()).ok()?;
        // SAFETY: a contiguous float32 CPU tensor of `len` elements (checked above).
        let xs = unsafe { self.floats(x, len) }?;
        let mut out = match self.owned(shims.empty_f32(&sizes)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of `len` elements.
        let os = unsafe { self.floats_mut(&mut out, len) }?;
        crate::kernels::layer_norm_f32(xs, ws, bs, eps as f32, os);
        Some(Ok(out))
    }

    /// kwexport's GELU of `x`, a contiguous float32 CPU tensor: a new tensor, or `None` where
    /// it doesn't qualify or the CPU lacks the kernel's instructions.
    ///
    /// # Safety
    /// `x` must be a live handle.
    pub unsafe fn gelu(&self, x: Raw, tanh: bool) -> Option<Result<Tensor, CError>> {
        let shims = self.shims.as_ref()?;
        // SAFETY: a live handle.
        let sizes = unsafe {
            if shims.is_cpu_f32(x) {
                self.contiguous_sizes(x)?
            } else {
                return None;
            }
        };
        let len = usize::try_from(sizes.iter().product::<i64>()).ok()?;
        let out = match self.owned(shims.empty_f32(&sizes)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: a contiguous float32 CPU tensor of `len` elements (checked above) and the
        // fresh output of `len`, which aliases nothing.
        let done = unsafe {
            let (px, po) = (shims.data_ptr(x)?, shims.data_ptr(out.0)?);
            let xs = std::slice::from_raw_parts(px as *const f32, len);
            let os = std::slice::from_raw_parts_mut(po as *mut f32, len);
            crate::kernels::gelu_f32(xs, tanh, os)
        };
        done.then_some(Ok(out))
    }

    /// A matrix weight as the GEMM's panels (`[ceil(n / 64), k, 64]`, `kernels::PANEL`): a
    /// linear's `[n, k]` (`transpose`, also a 1×1 convolution's `[n, k, 1, 1]`) or an `addmm`'s
    /// `[k, n]` second matrix, float32 on the CPU at any strides. With `bf16`, the bfloat16
    /// GEMM's (`kernels::bf16::pack_panels`): `[ceil(n / 64), ceil(k / 2), 64]` pairs of
    /// bfloat16, each pair held in one float32 element's bytes. `None` for anything else.
    pub fn pack_matrix_panels(&self, weight: &Tensor, transpose: bool, bf16: bool) -> Option<Tensor> {
        // SAFETY: a live handle.
        let (sizes, strides) = unsafe { self.sizes_strides(weight.raw()) }?;
        // As the `[n, k, 1, 1]` weight of a 1×1 convolution, whose panels are the matrix's.
        let (shape, strides) = match (sizes.as_slice(), strides.as_slice(), transpose) {
            ([n, k], [s0, s1], true) => ([*n, *k, 1, 1], [*s0, *s1, 0, 0]),
            ([k, n], [s0, s1], false) => ([*n, *k, 1, 1], [*s1, *s0, 0, 0]),
            ([n, k, 1, 1], [s0, s1, ..], true) => ([*n, *k, 1, 1], [*s0, *s1, 0, 0]),
            _ => return None,
        };
        if bf16 {
            return self.pack_bf16_panels_of(weight.raw(), four(&shape)?, four(&strides)?);
        }
        self.pack_panels_of(weight.raw(), four(&shape)?, four(&strides)?)
    }

    /// kwexport's linear kernel on `x` (`[m, k]`), the weight's `panels` (`[ceil(n / 64), k,
    /// 64]`, `Abi::pack_matrix_panels`, or its bfloat16 panels with `bf16`) and `bias` (`[n]`),
    /// all contiguous float32 CPU tensors: a new `[m, n]` tensor, or `None` where they don't
    /// qualify or the CPU lacks the kernel's instructions.
    ///
    /// # Safety
    /// `x`, `panels` and `bias` must be live handles.
    pub unsafe fn linear(
        &self,
        x: Raw,
        panels: Raw,
        n: i64,
        bias: Option<Raw>,
        epilogue: crate::kernels::Epilogue,
        bf16: bool,
    ) -> Option<Result<Tensor, CError>> {
        let shims = self.shims.as_ref()?;
        // SAFETY: live handles.
        let (xs, [m, k]) = unsafe {
            let &[m, k] = self.contiguous_sizes(x)?.as_slice() else { return None };
            (self.contiguous_f32(x, &[m, k])?, [usize::try_from(m).ok()?, usize::try_from(k).ok()?])
        };
        let n = usize::try_from(n).ok()?;
        let out = || self.owned(shims.empty_f32(&[m as i64, n as i64]));
        // SAFETY: the caller's live handles.
        unsafe { self.gemm(xs, [m, k, n], (panels, bf16), bias, None, epilogue, out) }
    }

    /// `epilogue` applied in place to `t`, a dense float32 CPU tensor torch's kernel just made
    /// (a fused linear's or convolution's activation, `kernels::epilogue_f32`).
    pub fn apply_epilogue(&self, t: &mut Tensor, epilogue: crate::kernels::Epilogue) -> Result<(), CError> {
        if epilogue == crate::kernels::Epilogue::None {
            return Ok(());
        }
        let fail = || CError::Internal("a fused activation on torch's result".into());
        // SAFETY: a live handle, then its dense float32 elements: a new tensor nothing else
        // holds.
        unsafe {
            let len = self.dense_f32_len(t.raw()).ok_or_else(fail)?;
            let xs = self.floats_mut(t, len).ok_or_else(fail)?;
            crate::kernels::epilogue_f32(epilogue, xs).then_some(()).ok_or_else(fail)
        }
    }

    /// Whether every element of `t` is finite; `false` also where `t` isn't a dense float32
    /// CPU tensor (the caller then takes the path that is right for any values).
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn all_finite(&self, t: Raw) -> bool {
        // SAFETY: the caller's live handle, then its dense elements.
        unsafe {
            let Some(len) = self.dense_f32_len(t) else { return false };
            self.floats(t, len).is_some_and(crate::kernels::all_finite)
        }
    }

    /// The number of elements of a float32 CPU tensor whose memory is dense (any order of
    /// its dimensions: `views::dense_len`), `None` for another tensor.
    ///
    /// # Safety
    /// `t` must be a live handle.
    unsafe fn dense_f32_len(&self, t: Raw) -> Option<usize> {
        // SAFETY: the caller's live handle.
        unsafe {
            if !self.shims.as_ref()?.is_cpu_f32(t) {
                return None;
            }
            let (sizes, strides) = self.sizes_strides(t)?;
            crate::views::dense_len(&sizes, &strides)
        }
    }

    /// A 1×1 convolution (stride 1, no padding, one group) on `x`, a float32 CPU `[N, C, H,
    /// W]` tensor laid out channels-last (`[N·H·W, C]` in memory), as kwexport's GEMM over
    /// its pixels with the weight's `panels` (`[ceil(n / 64), C, 64]`, the `[C, n]` transpose
    /// of the `[n, C, 1, 1]` weight packed), `bias` (`[n]`), the `residual` to add (the
    /// output's shape, channels-last) and `epilogue`: a new channels-last `[N, n, H, W]`
    /// tensor, the layout torch's convolution gives a channels-last weight. `None` where the
    /// tensors don't qualify or the CPU lacks the kernel.
    ///
    /// # Safety
    /// `x`, `panels`, `bias` and `residual` must be live handles.
    pub unsafe fn conv1x1(
        &self,
        x: Raw,
        panels: Raw,
        n: i64,
        (bias, residual): (Option<Raw>, Option<Raw>),
        epilogue: crate::kernels::Epilogue,
        bf16: bool,
    ) -> Option<Result<Tensor, CError>> {
        let n = usize::try_from(n).ok()?;
        // SAFETY: live handles.
        unsafe {
            if self.shims.as_ref()?.dim(x)? != 4 {
                return None;
            }
            let c = usize::try_from(self.size(x, 1)?).ok()?;
            let (xs, [batch, h, w]) = self.channels_last_f32(x, c)?;
            let rs = self.residual_f32(residual, [batch, n, h, w])?;
            let out = || self.empty_channels_last([batch, n, h, w]);
            self.gemm(xs, [batch * h * w, c, n], (panels, bf16), bias, rs, epilogue, out)
        }
    }

    /// A convolution's residual (`passes::conv_residual`) for an output of `[batch, c, h, w]`:
    /// `Some(None)` without one; `None` where it isn't a float32 CPU tensor of that shape laid
    /// out channels-last with no gaps, as the kernels' outputs are.
    ///
    /// # Safety
    /// `residual` must be a live handle, which nothing writes while the slice is used.
    unsafe fn residual_f32<'a>(
        &self,
        residual: Option<Raw>,
        [batch, c, h, w]: [usize; 4],
    ) -> Option<Option<&'a [f32]>> {
        let Some(r) = residual else { return Some(None) };
        // SAFETY: the caller's live handle.
        let (rs, dims) = unsafe { self.channels_last_f32(r, c)? };
        (dims == [batch, h, w]).then_some(Some(rs))
    }

    /// kwexport's GEMM (`kernels::gemm_f32`) of `xs` (`m` rows of `k`) with the weight's
    /// `panels` (`[ceil(n / 64), k, 64]`; or, with `bf16`, `kernels::bf16::gemm` on its
    /// `[ceil(n / 64), ceil(k / 2), 64]` pairs), `bias` (`[n]`), `residual` (`m * n`) and
    /// `epilogue` into the tensor `out` makes (`m * n` elements in row order), once the weight
    /// and bias qualify; `None` where they don't or the CPU lacks the kernel.
    ///
    /// # Safety
    /// `panels` and `bias` must be live handles; `out` must make a new float32 CPU tensor.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        &self,
        xs: &[f32],
        [m, k, n]: [usize; 3],
        (panels, bf16): (Raw, bool),
        bias: Option<Raw>,
        residual: Option<&[f32]>,
        epilogue: crate::kernels::Epilogue,
        out: impl FnOnce() -> Result<Tensor, CError>,
    ) -> Option<Result<Tensor, CError>> {
        let panel = crate::kernels::PANEL;
        if m == 0 || n == 0 || (bf16 && !crate::kernels::bf16::available()) {
            return None;
        }
        let rows = if bf16 { k.div_ceil(2) } else { k };
        // SAFETY: the caller's live handles.
        let (ps, bs) = unsafe {
            let ps = self.contiguous_f32(panels, &[n.div_ceil(panel) as i64, rows as i64, panel as i64])?;
            (ps, self.bias_f32(bias, n)?)
        };
        let mut out = match out() {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of `m * n` elements.
        let os = unsafe { self.floats_mut(&mut out, m * n) }?;
        let done = if bf16 {
            // The panels' float32 elements hold pairs of bfloat16 (`pack_bf16_panels_of`).
            // SAFETY: the same memory, read as the 4-byte words it is.
            let pairs = unsafe { std::slice::from_raw_parts(ps.as_ptr() as *const u32, ps.len()) };
            crate::kernels::bf16::gemm(xs, m, k, pairs, n, bs, residual, epilogue, os)
        } else {
            crate::kernels::gemm_f32(xs, m, k, ps, n, bs, residual, epilogue, os)
        };
        done.then_some(Ok(out))
    }

    /// A depthwise convolution (`kernels::depthwise_f32`) on `x`, a float32 CPU `[N, C, H, W]`
    /// tensor laid out channels-last, with the weight as `taps` (`[kh * kw, C]`), `bias`
    /// (`[C]`) and `epilogue`: a new channels-last `[N, C, Ho, Wo]` tensor. `None` where the
    /// tensors don't qualify or the CPU lacks the kernel.
    ///
    /// # Safety
    /// `x`, `taps` and `bias` must be live handles.
    pub unsafe fn depthwise(
        &self,
        x: Raw,
        taps: Raw,
        g: &crate::kernels::Depthwise,
        bias: Option<Raw>,
        epilogue: crate::kernels::Epilogue,
    ) -> Option<Result<Tensor, CError>> {
        let c = g.channels;
        // SAFETY: live handles.
        let (xs, [batch, h, w], ts, bs) = unsafe {
            let ts = self.contiguous_f32(taps, &[(g.kernel[0] * g.kernel[1]) as i64, c as i64])?;
            let bs = self.bias_f32(bias, c)?;
            let (xs, dims) = self.channels_last_f32(x, c)?;
            (xs, dims, ts, bs)
        };
        let [ho, wo] = g.output(h, w)?;
        let mut out = match self.empty_channels_last([batch, c, ho, wo]) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of that many elements.
        let os = unsafe { self.floats_mut(&mut out, batch * ho * wo * c) }?;
        crate::kernels::depthwise_f32(xs, [batch, h, w], ts, g, bs, epilogue, os).then_some(Ok(out))
    }

    /// `adaptive_avg_pool2d(x, [1, 1])` for a float32 CPU `[N, C, H, W]` tensor laid out
    /// channels-last (`kernels::mean_pixels_f32`): a new channels-last `[N, C, 1, 1]` tensor,
    /// as torch's kernel returns. `None` for any other tensor.
    ///
    /// # Safety
    /// `x` must be a live handle.
    pub unsafe fn global_avg_pool(&self, x: Raw) -> Option<Result<Tensor, CError>> {
        // SAFETY: a live handle.
        let (xs, [batch, h, w], c) = unsafe {
            if self.shims.as_ref()?.dim(x)? != 4 {
                return None;
            }
            let c = usize::try_from(self.size(x, 1)?).ok()?;
            let (xs, dims) = self.channels_last_f32(x, c)?;
            (xs, dims, c)
        };
        let mut out = match self.empty_channels_last([batch, c, 1, 1]) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of that many elements.
        let os = unsafe { self.floats_mut(&mut out, batch * c) }?;
        for (image, o) in xs.chunks_exact(h * w * c).zip(os.chunks_exact_mut(c)) {
            crate::kernels::mean_pixels_f32(image, h * w, o);
        }
        Some(Ok(out))
    }

    /// Scaled dot-product attention (`kernels::attention_f32`) over float32 CPU `[batch,
    /// heads, rows, cols]` queries, keys and values whose last dimension is contiguous, with
    /// `mask` (bool or float32, broadcast to `[batch, heads, l, s]`)
    /// or the causal triangle, and `scale` (`1 / sqrt(e)` where `None`, as torch computes it):
    /// a new `[batch, heads, l, ev]` tensor laid out `[batch, l, heads, ev]`, as torch's CPU
    /// kernel returns it. `None` where the tensors don't qualify, the keys are many (torch's
    /// blocked kernel is the faster there), a query has no key, or the CPU lacks the kernel.
    ///
    /// # Safety
    /// `q`, `k`, `v` and `mask` must be live handles.
    pub unsafe fn attention(
        &self,
        [q, k, v]: [Raw; 3],
        mask: Option<Raw>,
        causal: bool,
        scale: Option<f64>,
    ) -> Option<Result<Tensor, CError>> {
        use crate::kernels::{Attention, AttentionMask};
        let shims = self.shims.as_ref()?;
        let dims = |t: Raw| -> Option<([usize; 4], [usize; 4])> {
            // SAFETY: the caller's live handles.
            let (sizes, strides) = unsafe { self.sizes_strides(t) }?;
            let (sizes, strides) = (four(&sizes)?, four(&strides)?);
            (strides[3] == 1 || sizes[3] == 1).then_some((sizes, strides))
        };
        // SAFETY: the caller's live handles.
        if !unsafe { shims.is_cpu_f32(q) && shims.is_cpu_f32(k) && shims.is_cpu_f32(v) } || (causal && mask.is_some()) {
            return None;
        }
        let ((qd, qs), (kd, ks), (vd, vs)) = (dims(q)?, dims(k)?, dims(v)?);
        let [batch, heads, l, e] = qd;
        let (s, ev) = (kd[2], e);
        // Values as wide as keys: torch's flash kernel then runs, whose output's strides the
        // kernel's match (torch's math kernel returns a contiguous one).
        if kd != [batch, heads, s, e]
            || vd != kd
            || s > crate::kernels::attention::max_keys()
            || qd.contains(&0)
            || s == 0
        {
            return None;
        }
        let scale = scale.unwrap_or(1.0 / (e as f64).sqrt()) as f32;
        let g = Attention { batch, heads, l, s, e, ev, scale };
        let span = |d: [usize; 4], st: [usize; 4]| 1 + d.iter().zip(st).map(|(n, s)| (n - 1) * s).sum::<usize>();
        let three = |st: [usize; 4]| [st[0], st[1], st[2]];
        // SAFETY: float32 CPU tensors spanning that many elements from their first.
        let (qx, kx, vx) =
            unsafe { (self.floats(q, span(qd, qs))?, self.floats(k, span(kd, ks))?, self.floats(v, span(vd, vs))?) };
        let mask = match mask {
            None if causal => AttentionMask::Causal,
            None => AttentionMask::None,
            Some(m) => {
                // SAFETY: the caller's live handle.
                let (sizes, strides) = unsafe { self.sizes_strides(m) }?;
                if sizes.len() > 4 {
                    return None;
                }
                // Broadcast to [batch, heads, l, s]: missing leading dimensions and size-1 ones
                // read at stride 0.
                let pad = 4 - sizes.len();
                let target = [batch, heads, l, s];
                let mut st = [0usize; 4];
                for (i, (&n, &stride)) in sizes.iter().zip(&strides).enumerate() {
                    let (n, stride) = (usize::try_from(n).ok()?, usize::try_from(stride).ok()?);
                    match n {
                        _ if n == target[pad + i] && (n > 1 || pad + i == 3) => st[pad + i] = stride,
                        1 => st[pad + i] = 0,
                        _ => return None,
                    }
                }
                let span = span(target, st);
                // SAFETY: the caller's live handle, of that dtype, spanning `span` elements.
                unsafe {
                    if shims.is_cpu_bool(m) {
                        let p = shims.data_ptr(m)? as *const u8;
                        AttentionMask::Bool(std::slice::from_raw_parts(p, span), st)
                    } else if shims.is_cpu_f32(m) {
                        AttentionMask::Float(self.floats(m, span)?, st)
                    } else {
                        return None;
                    }
                }
            }
        };
        let [b, h, l_, ev_] = [batch, heads, l, ev].map(|d| d as i64);
        let mut out = match self.owned(shims.empty_f32_strided(&[b, h, l_, ev_], &[l_ * h * ev_, ev_, h * ev_, 1])) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of that many elements.
        let os = unsafe { self.floats_mut(&mut out, batch * l * heads * ev) }?;
        crate::kernels::attention_f32((qx, three(qs)), (kx, three(ks)), (vx, three(vs)), &g, mask, os)
            .then_some(Ok(out))
    }

    /// kwexport's max pooling (`kernels::max_pool_f32`) of `x`, a float32 CPU `[N, C, H, W]`
    /// tensor laid out channels-last: a new channels-last tensor, or `None` where `x` doesn't
    /// qualify (the caller runs torch's op, which also says why a window doesn't fit).
    ///
    /// # Safety
    /// `x` must be a live handle.
    pub unsafe fn max_pool(&self, x: Raw, pool: &crate::kernels::MaxPool) -> Option<Result<Tensor, CError>> {
        // SAFETY: a live handle.
        let (xs, [batch, h, w], c) = unsafe {
            if self.shims.as_ref()?.dim(x)? != 4 {
                return None;
            }
            let c = usize::try_from(self.size(x, 1)?).ok()?;
            let (xs, dims) = self.channels_last_f32(x, c)?;
            (xs, dims, c)
        };
        let [ho, wo] = pool.output(h, w)?;
        let mut out = match self.empty_channels_last([batch, c, ho, wo]) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of that many elements.
        let os = unsafe { self.floats_mut(&mut out, batch * ho * wo * c) }?;
        crate::kernels::max_pool_f32(xs, [batch, h, w, c], pool, os).then_some(Ok(out))
    }

    /// A direct convolution (`kernels::direct_f32`) on `x`, a float32 CPU `[N, C, H, W]`
    /// tensor of any layout, with the weight as `taps` (`[C * kh * kw, out]`), `bias`
    /// (`[out]`) and `epilogue`: a new channels-last `[N, out, Ho, Wo]` tensor. `None` where
    /// the tensors don't qualify or the CPU lacks the kernel.
    ///
    /// # Safety
    /// `x`, `taps` and `bias` must be live handles.
    pub unsafe fn direct_conv(
        &self,
        x: Raw,
        taps: Raw,
        g: &crate::kernels::Conv2d,
        bias: Option<Raw>,
        epilogue: crate::kernels::Epilogue,
    ) -> Option<Result<Tensor, CError>> {
        let shims = self.shims.as_ref()?;
        let (cin, cout) = (g.in_channels, g.out_channels);
        // SAFETY: live handles.
        let (ts, bs, sizes, strides) = unsafe {
            let ts = self.contiguous_f32(taps, &[g.taps() as i64, cout as i64])?;
            let bs = self.bias_f32(bias, cout)?;
            if !shims.is_cpu_f32(x) {
                return None;
            }
            let (sizes, strides) = self.sizes_strides(x)?;
            (ts, bs, sizes, strides)
        };
        let ([batch, c, h, w], strides) = (four(&sizes)?, four(&strides)?);
        if c != cin || batch == 0 || h == 0 || w == 0 {
            return None;
        }
        let [ho, wo] = g.output(h, w)?;
        // The elements the input spans: its last one's offset, plus one.
        let span = 1 + [batch, c, h, w].iter().zip(strides).map(|(n, s)| (n - 1) * s).sum::<usize>();
        // SAFETY: a float32 CPU tensor spanning `span` elements from its first.
        let xs = unsafe { self.floats(x, span) }?;
        let mut out = match self.empty_channels_last([batch, cout, ho, wo]) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of that many elements.
        let os = unsafe { self.floats_mut(&mut out, batch * ho * wo * cout) }?;
        crate::kernels::direct_f32(xs, [batch, h, w], strides, ts, g, bs, epilogue, os).then_some(Ok(out))
    }

    /// A convolution (`kernels::indirect_f32`) on `x`, a float32 CPU `[N, C, H, W]` tensor laid
    /// out channels-last, with the weight's `panels` (`kernels::pack_conv_panels`), `bias`
    /// (`[out]`), the `residual` to add (the output's shape, channels-last) and `epilogue`: a
    /// new channels-last `[N, out, Ho, Wo]` tensor. `None` where the tensors don't qualify or
    /// the CPU lacks the kernel.
    ///
    /// # Safety
    /// `x`, `panels`, `bias` and `residual` must be live handles.
    pub unsafe fn indirect_conv(
        &self,
        x: Raw,
        panels: Raw,
        g: &crate::kernels::Conv2d,
        adds: (Option<Raw>, Option<Raw>),
        epilogue: crate::kernels::Epilogue,
        bf16: bool,
    ) -> Option<Result<Tensor, CError>> {
        if bf16 && !crate::kernels::bf16::available() {
            return None;
        }
        let rows = if bf16 { g.kernel[0] * g.kernel[1] * g.in_channels.div_ceil(2) } else { g.taps() };
        let sizes = [g.out_channels.div_ceil(crate::kernels::PANEL), rows, crate::kernels::PANEL];
        // SAFETY: the caller's live handles.
        unsafe {
            self.conv_channels_last(x, (panels, sizes), g, adds, |xs, dims, ps, bs, rs, os| {
                if bf16 {
                    // SAFETY: the panels' float32 elements, read as the pairs of bfloat16 they hold.
                    let pairs = std::slice::from_raw_parts(ps.as_ptr() as *const u32, ps.len());
                    crate::kernels::bf16::indirect(xs, dims, pairs, g, bs, rs, epilogue, os)
                } else {
                    crate::kernels::indirect_f32(xs, dims, ps, g, bs, rs, epilogue, os)
                }
            })
        }
    }

    /// What the channels-last convolution kernels share: `x` (a float32 CPU `[N, C, H, W]`
    /// tensor laid out channels-last), the weight's `panels` (contiguous float32 of `sizes`),
    /// the bias and the residual as slices, and a new channels-last `[N, out, Ho, Wo]` output
    /// for `run` to fill (`run(x, [N, H, W], panels, bias, residual, out)`, `false` where it
    /// can't). `None` where a tensor doesn't qualify or `run` declines.
    ///
    /// # Safety
    /// `x`, `panels` and the bias and residual must be live handles.
    #[allow(clippy::type_complexity)]
    unsafe fn conv_channels_last(
        &self,
        x: Raw,
        (panels, sizes): (Raw, [usize; 3]),
        g: &crate::kernels::Conv2d,
        (bias, residual): (Option<Raw>, Option<Raw>),
        run: impl FnOnce(&[f32], [usize; 3], &[f32], Option<&[f32]>, Option<&[f32]>, &mut [f32]) -> bool,
    ) -> Option<Result<Tensor, CError>> {
        let cout = g.out_channels;
        // SAFETY: the caller's live handles.
        let (xs, [batch, h, w], ps, bs) = unsafe {
            let ps = self.contiguous_f32(panels, &sizes.map(|s| s as i64))?;
            let bs = self.bias_f32(bias, cout)?;
            let (xs, dims) = self.channels_last_f32(x, g.in_channels)?;
            (xs, dims, ps, bs)
        };
        let [ho, wo] = g.output(h, w)?;
        // SAFETY: a live handle.
        let rs = unsafe { self.residual_f32(residual, [batch, cout, ho, wo]) }?;
        let mut out = match self.empty_channels_last([batch, cout, ho, wo]) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of that many elements.
        let os = unsafe { self.floats_mut(&mut out, batch * ho * wo * cout) }?;
        run(xs, [batch, h, w], ps, bs, rs, os).then_some(Ok(out))
    }

    /// A float32 CPU `[out, in, 3, 3]` weight (any strides) transformed and packed for
    /// [`Abi::winograd_conv`] (`kernels::winograd::pack_weights`), or `None` for another tensor.
    pub fn pack_winograd(&self, weight: &Tensor) -> Option<Tensor> {
        // SAFETY: a live handle.
        let (sizes, strides) = unsafe { self.sizes_strides(weight.raw()) }?;
        let (shape @ [cout, cin, 3, 3], strides) = (four(&sizes)?, four(&strides)?) else { return None };
        let sizes = crate::kernels::winograd::panels_sizes(cin, cout);
        self.packed(weight.raw(), shape, strides, sizes, |src, dst| {
            crate::kernels::winograd::pack_weights(src, [cout, cin], strides, dst)
        })
    }

    /// A 3×3 convolution at stride 1 by Winograd's F(2×2, 3×3) (`kernels::winograd::conv`) on
    /// `x`, as [`Abi::indirect_conv`] takes it, with the weight from [`Abi::pack_winograd`].
    ///
    /// # Safety
    /// `x`, `panels`, `bias` and `residual` must be live handles.
    pub unsafe fn winograd_conv(
        &self,
        x: Raw,
        panels: Raw,
        g: &crate::kernels::Conv2d,
        adds: (Option<Raw>, Option<Raw>),
        epilogue: crate::kernels::Epilogue,
    ) -> Option<Result<Tensor, CError>> {
        let sizes = crate::kernels::winograd::panels_sizes(g.in_channels, g.out_channels);
        // SAFETY: the caller's live handles.
        unsafe {
            self.conv_channels_last(x, (panels, sizes), g, adds, |xs, dims, ps, bs, rs, os| {
                crate::kernels::winograd::conv(xs, dims, ps, g, bs, rs, epilogue, os)
            })
        }
    }

    /// A float32 CPU convolution weight (`[out, in, kh, kw]`, any strides) packed for
    /// [`Abi::indirect_conv`] (`kernels::pack_conv_panels`): a new `[ceil(out / 64), in * kh *
    /// kw, 64]` tensor (with `bf16`, `pack_bf16_panels_of`'s), or `None` for another tensor.
    pub fn pack_conv_panels(&self, weight: &Tensor, bf16: bool) -> Option<Tensor> {
        // SAFETY: a live handle.
        let (sizes, strides) = unsafe { self.sizes_strides(weight.raw()) }?;
        if bf16 {
            return self.pack_bf16_panels_of(weight.raw(), four(&sizes)?, four(&strides)?);
        }
        self.pack_panels_of(weight.raw(), four(&sizes)?, four(&strides)?)
    }

    /// `kernels::bf16::pack_panels` of a float32 CPU `[n, cin, kh, kw]` weight at `strides`:
    /// a `[ceil(n / 64), kh * kw * ceil(cin / 2), 64]` tensor whose 4-byte elements hold the
    /// pairs of bfloat16.
    fn pack_bf16_panels_of(&self, weight: Raw, shape: [usize; 4], strides: [usize; 4]) -> Option<Tensor> {
        let [n, cin, kh, kw] = shape;
        let sizes = [n.div_ceil(crate::kernels::PANEL), kh * kw * cin.div_ceil(2), crate::kernels::PANEL];
        self.packed(weight, shape, strides, sizes, |src, dst| {
            // SAFETY: the same fresh memory, as the 4-byte words the pairs are.
            let pairs = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u32, dst.len()) };
            crate::kernels::bf16::pack_panels(src, shape, strides, pairs)
        })
    }

    /// `kernels::pack_conv_panels` of a float32 CPU `[n, cin, kh, kw]` weight at `strides`.
    fn pack_panels_of(&self, weight: Raw, shape: [usize; 4], strides: [usize; 4]) -> Option<Tensor> {
        let [n, cin, kh, kw] = shape;
        let sizes = [n.div_ceil(crate::kernels::PANEL), cin * kh * kw, crate::kernels::PANEL];
        self.packed(weight, shape, strides, sizes, |src, dst| {
            crate::kernels::pack_conv_panels(src, shape, strides, dst)
        })
    }

    /// A new float32 tensor of `sizes` that `pack` fills from the elements of `weight`, a
    /// float32 CPU tensor of `shape` at `strides` with no empty dimension (the elements its
    /// strides span); `None` for another tensor.
    fn packed(
        &self,
        weight: Raw,
        shape: [usize; 4],
        strides: [usize; 4],
        sizes: [usize; 3],
        pack: impl FnOnce(&[f32], &mut [f32]),
    ) -> Option<Tensor> {
        let shims = self.shims.as_ref()?;
        // SAFETY: a live handle.
        if !unsafe { shims.is_cpu_f32(weight) } || shape.contains(&0) {
            return None;
        }
        let span = 1 + shape.iter().zip(strides).map(|(n, s)| (n - 1) * s).sum::<usize>();
        let out = self.owned(shims.empty_f32(&sizes.map(|s| s as i64))).ok()?;
        // SAFETY: a float32 CPU tensor spanning `span` elements from its first (checked
        // above), and the fresh output, which aliases nothing.
        unsafe {
            let src = std::slice::from_raw_parts(shims.data_ptr(weight)? as *const f32, span);
            let dst = std::slice::from_raw_parts_mut(shims.data_ptr(out.0)? as *mut f32, sizes.iter().product());
            pack(src, dst);
        }
        Some(out)
    }

    /// The elements and `[N, H, W]` of `x` where it is a float32 CPU `[N, c, H, W]` tensor
    /// laid out channels-last with no gaps (`[N, H, W, c]` in memory; a stride only matters
    /// where its dimension has more than one element) and no empty dimension.
    ///
    /// # Safety
    /// `x` must be a live handle, which nothing writes while the slice is used.
    unsafe fn channels_last_f32<'a>(&self, x: Raw, c: usize) -> Option<(&'a [f32], [usize; 3])> {
        // SAFETY: the caller's live handle.
        let (sizes, strides) = unsafe {
            if !self.shims.as_ref()?.is_cpu_f32(x) {
                return None;
            }
            self.sizes_strides(x)?
        };
        let (&[batch, channels, h, w], c) = (sizes.as_slice(), c as i64) else { return None };
        let want = [h * w * c, 1, w * c, c];
        let dense = sizes.iter().zip(&strides).zip(want).all(|((&size, &stride), want)| size <= 1 || stride == want);
        if channels != c || !dense || batch * h * w == 0 {
            return None;
        }
        let dims = [usize::try_from(batch).ok()?, usize::try_from(h).ok()?, usize::try_from(w).ok()?];
        // SAFETY: a float32 CPU tensor of that many elements from its first, densely.
        Some((unsafe { self.floats(x, dims.iter().product::<usize>() * c as usize) }?, dims))
    }

    /// The elements of `t` where it is a contiguous float32 CPU tensor of exactly `sizes`.
    ///
    /// # Safety
    /// `t` must be a live handle, which nothing writes while the slice is used.
    unsafe fn contiguous_f32<'a>(&self, t: Raw, sizes: &[i64]) -> Option<&'a [f32]> {
        // SAFETY: the caller's live handle.
        unsafe {
            if !self.shims.as_ref()?.is_cpu_f32(t) || self.contiguous_sizes(t)? != sizes {
                return None;
            }
            self.floats(t, usize::try_from(sizes.iter().product::<i64>()).ok()?)
        }
    }

    /// A bias of `n` elements: `Some(None)` without one, `None` where it isn't a contiguous
    /// float32 CPU `[n]` tensor.
    ///
    /// # Safety
    /// `bias` must be a live handle, which nothing writes while the slice is used.
    unsafe fn bias_f32<'a>(&self, bias: Option<Raw>, n: usize) -> Option<Option<&'a [f32]>> {
        match bias {
            None => Some(None),
            // SAFETY: the caller's live handle.
            Some(b) => unsafe { self.contiguous_f32(b, &[n as i64]) }.map(Some),
        }
    }

    /// `len` floats from a tensor's first element.
    ///
    /// # Safety
    /// `t` must be a live float32 CPU tensor with `len` elements from its first in its
    /// storage, which nothing writes while the slice is used.
    unsafe fn floats<'a>(&self, t: Raw, len: usize) -> Option<&'a [f32]> {
        // SAFETY: the caller's live handle, and `len` floats there.
        unsafe { Some(std::slice::from_raw_parts(self.shims.as_ref()?.data_ptr(t)? as *const f32, len)) }
    }

    /// A tensor this call made, as its `len` floats to write.
    ///
    /// # Safety
    /// `t` must be a new dense float32 CPU tensor of `len` elements that nothing else
    /// reads or writes while the slice is used.
    unsafe fn floats_mut<'a>(&self, t: &'a mut Tensor, len: usize) -> Option<&'a mut [f32]> {
        // SAFETY: the caller's new tensor of `len` floats.
        unsafe { Some(std::slice::from_raw_parts_mut(self.shims.as_ref()?.data_ptr(t.0)? as *mut f32, len)) }
    }

    /// A new float32 CPU `[n, c, h, w]` tensor laid out channels-last.
    fn empty_channels_last(&self, [n, c, h, w]: [usize; 4]) -> Result<Tensor, CError> {
        let shims = self.shims.as_ref().ok_or_else(|| CError::Internal("no shims".into()))?;
        let [n, c, h, w] = [n, c, h, w].map(|v| v as i64);
        self.owned(shims.empty_f32_strided(&[n, c, h, w], &[h * w * c, 1, w * c, c]))
    }

    /// `a + b` for int64 CPU tensors, contiguous, of one shape or one of them a single element
    /// (torch's broadcasting for these cases): kwexport's kernel, exact. `None` for anything
    /// else (the caller runs torch's op).
    ///
    /// # Safety
    /// Both must be live handles.
    pub unsafe fn add_i64(&self, a: Raw, b: Raw) -> Option<Result<Tensor, CError>> {
        let shims = self.shims.as_ref()?;
        // SAFETY: live handles.
        let (asz, bsz) = unsafe {
            if !shims.is_cpu_i64(a) || !shims.is_cpu_i64(b) {
                return None;
            }
            (self.contiguous_sizes(a)?, self.contiguous_sizes(b)?)
        };
        let (an, bn) = (asz.iter().product::<i64>(), bsz.iter().product::<i64>());
        // The broadcast shape where the shapes are equal or one side has one element: the
        // other side's, padded on the left with ones to the longer rank.
        if asz != bsz && an != 1 && bn != 1 {
            return None;
        }
        let (big, small) = if an == 1 { (&bsz, &asz) } else { (&asz, &bsz) };
        let mut sizes = big.clone();
        sizes.splice(0..0, std::iter::repeat_n(1, small.len().saturating_sub(big.len())));
        let n = usize::try_from(sizes.iter().product::<i64>()).ok()?;
        let (an, bn) = (usize::try_from(an).ok()?, usize::try_from(bn).ok()?);
        if n == 0 || (an != n && an != 1) || (bn != n && bn != 1) {
            return None;
        }
        let out = match self.owned(shims.empty_i64(&sizes)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: contiguous int64 CPU tensors of `an`, `bn` and `n` elements; the output is new.
        unsafe {
            let xa = std::slice::from_raw_parts(shims.data_ptr(a)? as *const i64, an);
            let xb = std::slice::from_raw_parts(shims.data_ptr(b)? as *const i64, bn);
            let o = std::slice::from_raw_parts_mut(shims.data_ptr(out.0)? as *mut i64, n);
            crate::kernels::add_i64(xa, xb, o);
        }
        Some(Ok(out))
    }
}
