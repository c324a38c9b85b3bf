//! oneDNN's convolution weights, packed through the dispatcher for the operators that run
//! on oneDNN's fused convolution.

use super::Operators;
use crate::abi::{CError, StableIValue, Tensor, Ty};

impl Operators<'_> {
    /// A convolution's weight packed for oneDNN (`mkldnn::_reorder_convolution_weight`, through
    /// the dispatcher) for the first call's input sizes, or the plain weight where torch can't
    /// pack it: oneDNN then reorders it on each call, which gives the same values. Packed for no
    /// input size, oneDNN guesses one, and where its kernel for the real size wants another
    /// blocking it reorders the weight on every call (on an AVX2 CPU: 24- against 32-wide blocks,
    /// 70 ms a call for resnet18's 512-channel convolutions). `None` only if not even a new
    /// handle to the weight could be made (the node then runs its Python op).
    pub fn pack_onednn_conv_weight(
        &self,
        ([padding, stride, dilation], groups): ([[i64; 2]; 3], i64),
        weight: &Tensor,
        input: Option<Vec<i64>>,
    ) -> Option<Tensor> {
        let abi = self.0;
        let packed = || -> Result<Tensor, CError> {
            let ints = |v: &[i64; 2]| abi.new_list(&[v[0] as StableIValue, v[1] as StableIValue]);
            let list = Ty::List(Box::new(Ty::Int));
            let mut stack: Vec<StableIValue> = Vec::with_capacity(6);
            let parts = [&padding, &stride, &dilation];
            let built = abi.share(weight).and_then(|w| {
                stack.push(w);
                parts.iter().try_for_each(|p| ints(p).map(|l| stack.push(l)))
            });
            if let Err(e) = built {
                for (i, &v) in stack.iter().enumerate() {
                    // SAFETY: built above for these types, never handed to torch.
                    unsafe { abi.release(if i == 0 { &Ty::Tensor } else { &list }, v) };
                }
                return Err(e);
            }
            stack.push(groups as StableIValue);
            // input_size: an optional list, boxed; None (0) where the sizes are unknown or the
            // list couldn't be made.
            let sizes: Vec<StableIValue> = input.iter().flatten().map(|&v| v as StableIValue).collect();
            let boxed = input.is_some().then(|| abi.new_list(&sizes)).and_then(Result::ok).and_then(|list_handle| {
                abi.boxed(list_handle).ok().or_else(|| {
                    // SAFETY: made above for a list of ints, never handed to torch.
                    unsafe { abi.release(&list, list_handle) };
                    None
                })
            });
            stack.push(boxed.unwrap_or(0));
            // SAFETY: one value per argument of `_reorder_convolution_weight`'s schema, encoded
            // for its type; it returns one tensor.
            unsafe { abi.call(c"mkldnn::_reorder_convolution_weight", c"", &mut stack) }?;
            Ok(abi.adopt(stack[0]))
        };
        packed().or_else(|_| abi.share(weight).map(|w| abi.adopt(w))).ok()
    }
}
