//! Convolutions on channels-last tensors (1×1 as a GEMM, depthwise, direct, indirect,
//! Winograd) and the packing of their weights.

use super::concat::Part;
use super::{four, Operators};
use crate::abi::{CError, Raw, Tensor};
use crate::kernels;

impl Operators<'_> {
    /// A 1×1 convolution (stride 1, no padding, one group) on `x`, a float32 CPU `[N, C, H,
    /// W]` tensor laid out channels-last (`[N·H·W, C]` in memory, or a slice of a wider
    /// one's channels, as ShuffleNet's `chunk` makes), as kwexport's GEMM over
    /// its pixels with the weight's `panels` (`[ceil(n / 64), C, 64]`, the `[C, n]` transpose
    /// of the `[n, C, 1, 1]` weight packed), `bias` (`[n]`), the `residual` to add (the
    /// output's shape, channels-last) and `epilogue`: a new channels-last `[N, n, H, W]`
    /// tensor, the layout torch's convolution gives a channels-last weight (or, without a
    /// residual, its `part` of a concatenation where that has room). `None` where the
    /// tensors don't qualify or the CPU lacks the kernel.
    ///
    /// # Safety
    /// `x`, `panels`, `bias`, `residual` and the part's buffer must be live handles.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn conv1x1(
        &self,
        x: Raw,
        panels: Raw,
        n: i64,
        (bias, residual): (Option<Raw>, Option<Raw>),
        epilogue: kernels::Epilogue,
        bf16: bool,
        part: Option<Part>,
    ) -> Option<Result<Tensor, CError>> {
        let n = usize::try_from(n).ok()?;
        // SAFETY: live handles.
        unsafe {
            if self.0.shims.as_ref()?.dim(x)? != 4 {
                return None;
            }
            let c = usize::try_from(self.0.size(x, 1)?).ok()?;
            let (xs, [batch, h, w], ld) = self.channels_last_rows(x, c)?;
            let rs = self.residual_f32(residual, [batch, n, h, w])?;
            let part = part.filter(|_| residual.is_none() && !bf16);
            let out = || self.conv_output([batch, n, h, w], part);
            self.gemm((xs, ld), [batch * h * w, c, n], (panels, bf16), bias, rs, epilogue, out)
        }
    }

    /// A convolution's residual (`passes::conv_residual`) for an output of `[batch, c, h, w]`:
    /// `Some(None)` without one; `None` where it isn't a float32 CPU tensor of that shape laid
    /// out channels-last with no gaps, as the kernels' outputs are.
    ///
    /// # Safety
    /// `residual` must be a live handle, which nothing writes while the slice is used.
    pub(super) unsafe fn residual_f32<'a>(
        &self,
        residual: Option<Raw>,
        [batch, c, h, w]: [usize; 4],
    ) -> Option<Option<&'a [f32]>> {
        let Some(r) = residual else { return Some(None) };
        // SAFETY: the caller's live handle.
        let (rs, dims) = unsafe { self.channels_last_f32(r, c)? };
        (dims == [batch, h, w]).then_some(Some(rs))
    }

    /// A depthwise convolution (`kernels::depthwise_f32`) on `x`, a float32 CPU `[N, C, H, W]`
    /// tensor laid out channels-last, with the weight as `taps` (`[kh * kw, C]`), `bias`
    /// (`[C]`) and `epilogue`: a new channels-last `[N, C, Ho, Wo]` tensor, or its `part` of
    /// a concatenation where that has room. `x` may be a slice of a wider tensor's channels,
    /// that concatenation's included. `None` where the tensors don't qualify or the CPU
    /// lacks the kernel.
    ///
    /// # Safety
    /// `x`, `taps`, `bias` and the part's buffer must be live handles.
    pub unsafe fn depthwise(
        &self,
        x: Raw,
        taps: Raw,
        g: &kernels::Depthwise,
        bias: Option<Raw>,
        epilogue: kernels::Epilogue,
        part: Option<Part>,
    ) -> Option<Result<Tensor, CError>> {
        let c = g.channels;
        // SAFETY: live handles.
        let (xs, [batch, h, w], ld, ts, bs) = unsafe {
            let ts = self.contiguous_f32(taps, &[(g.kernel[0] * g.kernel[1]) as i64, c as i64])?;
            let bs = self.bias_f32(bias, c)?;
            let (xs, dims, ld) = self.channels_last_rows(x, c)?;
            (xs, dims, ld, ts, bs)
        };
        let [ho, wo] = g.output(h, w)?;
        // SAFETY: the part's live buffer.
        let out = match unsafe { self.conv_output([batch, c, ho, wo], part) }? {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // The input may be a part of the concatenation the output is part of (GhostNet's
        // cheap operation reads the channels before its own): then only other channels.
        if out.overlaps(xs, batch * ho * wo, c) && !super::concat::apart(xs.as_ptr(), ld, out.ptr, out.ld, c) {
            return None;
        }
        // SAFETY: `xs` spans the input's pixels and `out` the output's, which share no
        // element (checked); nothing else writes either while the kernel runs.
        let ran = unsafe {
            let x = (xs.as_ptr(), ld);
            kernels::depthwise_f32_strided(x, [batch, h, w], ts, g, bs, epilogue, (out.ptr, out.ld))
        };
        ran.ok().map(|()| Ok(out.tensor))
    }

    /// An inverted residual's 1×1 expansion and the depthwise convolution over its output in
    /// one kernel (`kernels::expand_depthwise`): `x` as [`Operators::conv1x1`] takes it, the
    /// expansion's `panels` (to `g.channels` channels), bias and epilogue, then the depthwise
    /// convolution's `taps`, bias and epilogue as [`Operators::depthwise`] takes them: a new
    /// channels-last `[N, C, Ho, Wo]` tensor, the depthwise convolution's output. `None`
    /// where the tensors don't qualify, the CPU lacks the kernels, or the expanded image is
    /// small enough to stay in cache between the two kernels run apart
    /// (`kernels::expand_depthwise::pays`).
    ///
    /// # Safety
    /// `x`, `panels`, `taps` and the biases must be live handles.
    pub unsafe fn expand_depthwise(
        &self,
        x: Raw,
        (panels, bias, epilogue): (Raw, Option<Raw>, kernels::Epilogue),
        (taps, g, dw_bias, dw_epilogue): (Raw, &kernels::Depthwise, Option<Raw>, kernels::Epilogue),
    ) -> Option<Result<Tensor, CError>> {
        let c = g.channels;
        // SAFETY: live handles.
        let (xs, [batch, h, w, k], ld, ps, bs, ts, dbs) = unsafe {
            if self.0.shims.as_ref()?.dim(x)? != 4 {
                return None;
            }
            let k = usize::try_from(self.0.size(x, 1)?).ok()?;
            let (xs, [batch, h, w], ld) = self.channels_last_rows(x, k)?;
            if !kernels::expand_depthwise::pays(h * w * c) {
                return None;
            }
            let ps = self.contiguous_f32(panels, &kernels::gemm::pack_size([c, k, 1, 1]).map(|s| s as i64))?;
            let ts = self.contiguous_f32(taps, &[(g.kernel[0] * g.kernel[1]) as i64, c as i64])?;
            (xs, [batch, h, w, k], ld, ps, self.bias_f32(bias, c)?, ts, self.bias_f32(dw_bias, c)?)
        };
        let [ho, wo] = g.output(h, w)?;
        // SAFETY: no part: a new tensor.
        let out = match unsafe { self.conv_output([batch, c, ho, wo], None) }? {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        let expansion = kernels::expand_depthwise::Expansion { panels: ps, bias: bs, epilogue };
        let dw = kernels::expand_depthwise::DepthwiseWeights { taps: ts, bias: dbs, epilogue: dw_epilogue };
        // SAFETY: `xs` spans the input's pixels and `out` is a new tensor of the output's;
        // nothing else writes either while the kernel runs.
        let ran = unsafe {
            let x = (xs.as_ptr(), ld);
            kernels::expand_depthwise::expand_depthwise_f32(x, [batch, h, w, k], expansion, g, dw, (out.ptr, out.ld))
        };
        ran.ok().map(|()| Ok(out.tensor))
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
        g: &kernels::Conv2d,
        bias: Option<Raw>,
        epilogue: kernels::Epilogue,
    ) -> Option<Result<Tensor, CError>> {
        let sizes = [g.taps() as i64, g.out_channels as i64];
        // SAFETY: the caller's live handles.
        unsafe {
            self.conv_any_layout(x, (taps, &sizes), g, bias, |xs, dims, strides, ts, bs, os| {
                kernels::direct_f32(xs, dims, strides, ts, g, bs, epilogue, os)
            })
        }
    }

    /// A patch embedding (`kernels::patches_f32`: a kernel that tiles the image) of `x`, a
    /// float32 CPU `[N, C, H, W]` tensor in any layout, with the weight's `panels`
    /// ([`Operators::pack_patch_panels`]), `bias` (`[out]`) and `epilogue`: a new channels-last
    /// `[N, out, Ho, Wo]` tensor, or `None` where the tensors don't qualify or the CPU lacks
    /// the kernel.
    ///
    /// # Safety
    /// `x`, `panels` and `bias` must be live handles.
    pub unsafe fn patches_conv(
        &self,
        x: Raw,
        panels: Raw,
        g: &kernels::Conv2d,
        bias: Option<Raw>,
        epilogue: kernels::Epilogue,
    ) -> Option<Result<Tensor, CError>> {
        let sizes = kernels::gemm::pack_size([g.out_channels, g.in_channels, g.kernel[0], g.kernel[1]]);
        // SAFETY: the caller's live handles.
        unsafe {
            self.conv_any_layout(x, (panels, &sizes.map(|d| d as i64)), g, bias, |xs, dims, strides, ps, bs, os| {
                kernels::patches_f32(xs, dims, strides, ps, g, bs, epilogue, os)
            })
        }
    }

    /// What the convolutions over an input of any layout share: `x` (a float32 CPU `[N, C, H,
    /// W]` tensor at any strides), the weight (contiguous float32 of `sizes`) and the bias as
    /// slices, and a new channels-last `[N, out, Ho, Wo]` output for `run` to fill (`run(x,
    /// [N, H, W], x's strides, weight, bias, out)`, or decline). `None` where a tensor doesn't
    /// qualify or `run` declines.
    ///
    /// # Safety
    /// `x`, the weight and the bias must be live handles.
    unsafe fn conv_any_layout(
        &self,
        x: Raw,
        (weight, sizes): (Raw, &[i64]),
        g: &kernels::Conv2d,
        bias: Option<Raw>,
        run: impl FnOnce(&[f32], [usize; 3], [usize; 4], &[f32], Option<&[f32]>, &mut [f32]) -> kernels::Ran,
    ) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        let (cin, cout) = (g.in_channels, g.out_channels);
        // SAFETY: live handles.
        let (ws, bs, sizes, strides) = unsafe {
            let ws = self.contiguous_f32(weight, sizes)?;
            let bs = self.bias_f32(bias, cout)?;
            if !shims.is_cpu_f32(x) {
                return None;
            }
            let (sizes, strides) = self.0.sizes_strides(x)?;
            (ws, bs, sizes, strides)
        };
        let ([batch, c, h, w], strides) = (four(&sizes)?, four(&strides)?);
        if c != cin || batch == 0 || h == 0 || w == 0 {
            return None;
        }
        let [ho, wo] = g.output(h, w)?;
        let span = kernels::span(&[batch, c, h, w], &strides);
        // SAFETY: a float32 CPU tensor spanning `span` elements from its first.
        let xs = unsafe { self.floats(x, span) }?;
        let mut out = match self.empty_channels_last([batch, cout, ho, wo]) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of that many elements.
        let os = unsafe { self.floats_mut(&mut out, batch * ho * wo * cout) }?;
        run(xs, [batch, h, w], strides, ws, bs, os).ok().map(|()| Ok(out))
    }

    /// A convolution (`kernels::indirect_f32`) on `x`, a float32 CPU `[N, C, H, W]` tensor laid
    /// out channels-last, with the weight's `panels` (`kernels::pack_conv_panels`), `bias`
    /// (`[out]`), the `residual` to add (the output's shape, channels-last) and `epilogue`: a
    /// new channels-last `[N, out, Ho, Wo]` tensor, or (float32, without a residual) its
    /// `part` of a concatenation where that has room. `None` where the tensors don't qualify
    /// or the CPU lacks the kernel.
    ///
    /// # Safety
    /// `x`, `panels`, `bias`, `residual` and the part's buffer must be live handles.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn indirect_conv(
        &self,
        x: Raw,
        panels: Raw,
        g: &kernels::Conv2d,
        adds: (Option<Raw>, Option<Raw>),
        epilogue: kernels::Epilogue,
        bf16: bool,
        part: Option<Part>,
    ) -> Option<Result<Tensor, CError>> {
        if bf16 && !kernels::bf16::available() {
            return None;
        }
        let shape = [g.out_channels, g.in_channels / g.groups, g.kernel[0], g.kernel[1]];
        let sizes =
            if bf16 { kernels::bf16::pack_size(shape) } else { kernels::gemm::grouped_pack_size(shape, g.groups) };
        // SAFETY: the caller's live handles.
        unsafe {
            let part = part.filter(|_| !bf16 && adds.1.is_none());
            self.conv_channels_last(x, (panels, sizes), g, adds, part, |xs, dims, ps, bs, rs, (os, ldo)| {
                if bf16 {
                    // SAFETY: the panels' float32 elements, read as the pairs of bfloat16 they hold.
                    let pairs = std::slice::from_raw_parts(ps.as_ptr() as *const u32, ps.len());
                    kernels::bf16::indirect(xs, dims, pairs, g, bs, rs, epilogue, os)
                } else {
                    kernels::indirect_f32_strided(xs, dims, ps, g, (bs, rs), epilogue, (os, ldo))
                }
            })
        }
    }

    /// What the channels-last convolution kernels share: `x` (a float32 CPU `[N, C, H, W]`
    /// tensor laid out channels-last), the weight's `panels` (contiguous float32 of `sizes`),
    /// the bias and the residual as slices, and a channels-last `[N, out, Ho, Wo]` output
    /// (a new tensor, or `part` of a concatenation where that has room) for `run` to fill
    /// (`run(x, [N, H, W], panels, bias, residual, (out, its pixels' stride))`, or decline).
    /// `None` where a tensor doesn't qualify or `run` declines.
    ///
    /// # Safety
    /// `x`, `panels`, the bias and residual, and the part's buffer must be live handles.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    unsafe fn conv_channels_last(
        &self,
        x: Raw,
        (panels, sizes): (Raw, [usize; 3]),
        g: &kernels::Conv2d,
        (bias, residual): (Option<Raw>, Option<Raw>),
        part: Option<Part>,
        run: impl FnOnce(&[f32], [usize; 3], &[f32], Option<&[f32]>, Option<&[f32]>, (&mut [f32], usize)) -> kernels::Ran,
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
        // SAFETY: the part's live buffer.
        let out = match unsafe { self.conv_output([batch, cout, ho, wo], part) }? {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        let pixels = batch * ho * wo;
        if out.overlaps(xs, pixels, cout) {
            return None;
        }
        // SAFETY: the output's elements, of a new tensor or of this node's channels of a
        // concatenation's, which the input doesn't share (checked) and nothing else reads or
        // writes while the kernel runs.
        let os = unsafe { std::slice::from_raw_parts_mut(out.ptr, out.span(pixels, cout)) };
        run(xs, [batch, h, w], ps, bs, rs, (os, out.ld)).ok().map(|()| Ok(out.tensor))
    }

    /// A float32 CPU `[out, in, 3, 3]` weight (any strides) transformed and packed for
    /// [`Operators::winograd_conv`] (`kernels::winograd::pack_weights`), or `None` for another tensor.
    pub fn pack_winograd(&self, weight: &Tensor) -> Option<Tensor> {
        // SAFETY: a live handle.
        let (sizes, strides) = unsafe { self.0.sizes_strides(weight.raw()) }?;
        let (shape @ [cout, cin, 3, 3], strides) = (four(&sizes)?, four(&strides)?) else { return None };
        let sizes = kernels::winograd::pack_size(cin, cout);
        self.packed(weight.raw(), shape, strides, sizes, |src, dst| {
            kernels::winograd::pack_weights(src, [cout, cin], strides, dst)
        })
    }

    /// A 3×3 convolution at stride 1 by Winograd's F(2×2, 3×3) (`kernels::winograd::conv`) on
    /// `x`, as [`Operators::indirect_conv`] takes it (its `part` too, without a residual),
    /// with the weight from [`Operators::pack_winograd`].
    ///
    /// # Safety
    /// `x`, `panels`, `bias`, `residual` and the part's buffer must be live handles.
    pub unsafe fn winograd_conv(
        &self,
        x: Raw,
        panels: Raw,
        g: &kernels::Conv2d,
        adds: (Option<Raw>, Option<Raw>),
        epilogue: kernels::Epilogue,
        part: Option<Part>,
    ) -> Option<Result<Tensor, CError>> {
        let sizes = kernels::winograd::pack_size(g.in_channels, g.out_channels);
        // SAFETY: the caller's live handles.
        unsafe {
            let part = part.filter(|_| adds.1.is_none());
            self.conv_channels_last(x, (panels, sizes), g, adds, part, |xs, dims, ps, bs, rs, (os, ldo)| {
                kernels::winograd::conv_strided(xs, dims, ps, g, (bs, rs), epilogue, (os, ldo))
            })
        }
    }

    /// A float32 CPU convolution weight (`[out, in, kh, kw]`, any strides) packed for
    /// [`Operators::indirect_conv`] (`kernels::pack_conv_panels`): a new `[ceil(out / 64), in * kh *
    /// kw, 64]` tensor (with `bf16`, `pack_bf16_panels_of`'s; of `groups` groups,
    /// `kernels::gemm::grouped_pack_size`'s), or `None` for another tensor or bfloat16
    /// groups.
    pub fn pack_conv_panels(&self, weight: &Tensor, groups: usize, bf16: bool) -> Option<Tensor> {
        // SAFETY: a live handle.
        let (sizes, strides) = unsafe { self.0.sizes_strides(weight.raw()) }?;
        let (shape, strides) = (four(&sizes)?, four(&strides)?);
        match (bf16, groups) {
            (true, 1) => self.pack_bf16_panels_of(weight.raw(), shape, strides),
            (false, 1) => self.pack_panels_of(weight.raw(), shape, strides),
            (true, _) => None,
            (false, _) => {
                let sizes = kernels::gemm::grouped_pack_size(shape, groups);
                self.packed(weight.raw(), shape, strides, sizes, |src, dst| {
                    kernels::gemm::pack_grouped_panels(src, shape, strides, groups, dst)
                })
            }
        }
    }

    /// `kernels::pack_patch_panels` of a float32 CPU `[n, cin, kh, kw]` weight (a patch
    /// embedding's, [`Operators::patches_conv`]).
    pub fn pack_patch_panels(&self, weight: &Tensor) -> Option<Tensor> {
        // SAFETY: a live handle.
        let (sizes, strides) = unsafe { self.0.sizes_strides(weight.raw()) }?;
        let (shape, strides) = (four(&sizes)?, four(&strides)?);
        let sizes = kernels::gemm::pack_size(shape);
        self.packed(weight.raw(), shape, strides, sizes, |src, dst| {
            kernels::pack_patch_panels(src, shape, strides, dst)
        })
    }

    /// `kernels::bf16::pack_panels` of a float32 CPU `[n, cin, kh, kw]` weight at `strides`:
    /// a `[ceil(n / 64), kh * kw * ceil(cin / 2), 64]` tensor whose 4-byte elements hold the
    /// pairs of bfloat16.
    pub(super) fn pack_bf16_panels_of(&self, weight: Raw, shape: [usize; 4], strides: [usize; 4]) -> Option<Tensor> {
        let sizes = kernels::bf16::pack_size(shape);
        self.packed(weight, shape, strides, sizes, |src, dst| {
            // SAFETY: the same fresh memory, as the 4-byte words the pairs are.
            let pairs = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u32, dst.len()) };
            kernels::bf16::pack_panels(src, shape, strides, pairs)
        })
    }

    /// `kernels::pack_conv_panels` of a float32 CPU `[n, cin, kh, kw]` weight at `strides`.
    pub(super) fn pack_panels_of(&self, weight: Raw, shape: [usize; 4], strides: [usize; 4]) -> Option<Tensor> {
        let sizes = kernels::gemm::pack_size(shape);
        self.packed(weight, shape, strides, sizes, |src, dst| kernels::pack_conv_panels(src, shape, strides, dst))
    }
}
