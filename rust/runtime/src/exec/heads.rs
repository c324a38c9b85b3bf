//! An inverted residual's head (`plan::heads`): a 1×1 expansion and the depthwise
//! convolution after it (in an int8 program, the int8 linear, its `movedim` view and the
//! depthwise convolution), run as one kernel where both qualify, else one after the other.

use super::*;

impl CStep {
    /// Runs this 1×1 convolution and the depthwise convolution it carries (`then`, which
    /// reads only its output) as one kernel (`operators::expand_depthwise`), storing the
    /// depthwise step's output and freeing what both steps read last: `true` where it ran,
    /// `false` where the step carries none or the tensors or the call don't qualify (nothing
    /// is written; the caller runs the two steps).
    pub(super) fn run_fused(
        &self,
        abi: &Abi,
        slots: &mut [Option<Native>],
        consts: &[abi::Tensor],
        direct: Direct,
    ) -> RtResult<bool> {
        let Some(dw) = self.then.as_deref() else { return Ok(false) };
        // The same conditions as each step's own kernel (`call_conv`): no autograd or autocast
        // to honour, and kwexport's kernels not switched off.
        if !(direct.no_autograd && direct.no_autocast) || choice::forced_linear_kernel() == Some(false) {
            return Ok(false);
        }
        if let Some(OwnOp::LinearInt8(linear)) = &self.own {
            return self.run_fused_int8(abi, slots, consts, linear, dw);
        }
        fn conv_of(s: &CStep) -> Option<&crate::plan::Conv> {
            s.shim.as_ref()?.conv.as_deref()
        }
        let (Some(conv), Some(dw_conv)) = (conv_of(self), conv_of(dw)) else { return Ok(false) };
        let (Some(own), Some(dw_own)) = (conv.own.as_deref(), dw_conv.own.as_deref()) else { return Ok(false) };
        let (OwnKernel::Gemm { panels, .. }, OwnKernel::Depthwise { taps, geometry }) = (&own.kernel, &dw_own.kernel)
        else {
            return Ok(false);
        };
        let tensor = |s: &CStep, i: usize| tensor_arg(&s.args.get(i)?.1, slots, consts).flatten();
        let bias = |s: &CStep, has: bool| if has { tensor(s, 2).map(Some) } else { Some(None) };
        let (Some(x), Some(b), Some(dw_b)) = (tensor(self, 0), bias(self, conv.bias), bias(dw, dw_conv.bias)) else {
            return Ok(false);
        };
        let Some(panels) = panels.get(abi, consts) else { return Ok(false) };
        let Some(taps) = consts.get(*taps) else { return Ok(false) };
        // SAFETY: live handles: the input from its slot, the biases from slots or constants,
        // the packed panels and taps constants of the plan.
        let ran = unsafe {
            Operators(abi).expand_depthwise(x, (panels, b, own.epilogue), (taps.raw(), geometry, dw_b, dw_own.epilogue))
        };
        let Some(result) = ran else { return Ok(false) };
        dw.finish(slots, result.map_err(|e| self.error(e))?);
        for &s in &self.free {
            slots[s] = None;
        }
        Ok(true)
    }
}

impl CStep {
    /// [`CStep::run_fused`] for an int8 linear over pixels (`linear`) carrying its `movedim`
    /// view (`view`), which carries the depthwise convolution.
    fn run_fused_int8(
        &self,
        abi: &Abi,
        slots: &mut [Option<Native>],
        consts: &[abi::Tensor],
        linear: &crate::plan::Int8Linear,
        view: &CStep,
    ) -> RtResult<bool> {
        let Some(dw) = view.then.as_deref() else { return Ok(false) };
        let Some(dw_conv) = dw.shim.as_ref().and_then(|s| s.conv.as_deref()) else { return Ok(false) };
        let Some(dw_own) = dw_conv.own.as_deref() else { return Ok(false) };
        let OwnKernel::Depthwise { taps, geometry } = &dw_own.kernel else { return Ok(false) };
        let Int8Params::Literal(scale, zero_point) = linear.params else { return Ok(false) };
        let [qmin, qmax] = linear.range;
        let quant = Quant { scale, zero_point, qmin, qmax };
        // A tensor argument: `Some(None)` for an optional one not given.
        let arg = |s: &CStep, i: usize| tensor_arg(&s.args.get(i)?.1, slots, consts);
        let dw_bias = if dw_conv.bias { arg(dw, 2).flatten().map(Some) } else { Some(None) };
        let (Some(Some(x)), Some(Some(w_scale)), Some(bias), Some(dw_bias)) =
            (arg(self, 0), arg(self, 6), arg(self, 8), dw_bias)
        else {
            return Ok(false);
        };
        let Some((panels, layout, peak)) = linear.panels.get(abi, consts) else { return Ok(false) };
        let Some(taps) = consts.get(*taps) else { return Ok(false) };
        let weight =
            crate::operators::Int8Weight { panels, layout, peak, n: linear.n, k: linear.k, scale: w_scale, bias };
        // SAFETY: live handles: the input from its slot, the scales and biases from slots or
        // constants, the packed panels and taps constants of the plan.
        let ran = unsafe {
            let post = (linear.epilogue, linear.output);
            let depthwise = (taps.raw(), geometry, dw_bias, dw_own.epilogue);
            Operators(abi).expand_depthwise_int8(x, &quant, weight, post, depthwise)
        };
        let Some(result) = ran else { return Ok(false) };
        dw.finish(slots, result.map_err(|e| self.error(e))?);
        for &s in self.free.iter().chain(&view.free) {
            slots[s] = None;
        }
        Ok(true)
    }
}
