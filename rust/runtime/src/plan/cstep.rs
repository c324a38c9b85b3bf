//! Nodes compiled for torch's stable C ABI: each argument encoded once against its schema
//! type. A node whose op, arguments or returns the ABI can't pass stays on Python.

use kwexport_core::graph::{SlotArg, SlotNode, SlotOutputs};

use super::{CStep, Why};
use crate::abi::encode::{self, Consts, Enc};
use crate::abi::{Abi, Ty};
use crate::ops::OpSchema;

impl CStep {
    /// Compiles a node whose arguments are already matched to the schema (`bound[i]` is the
    /// value for argument `i`: given, or its default). `None` if the ABI can't run it.
    /// `is_tensor(slot)` says whether a slot always holds a tensor (else a number).
    pub(super) fn compile(
        abi: &Abi,
        op: &OpSchema,
        node: &SlotNode,
        bound: &[&SlotArg],
        is_tensor: &dyn Fn(usize) -> bool,
        consts: &mut dyn Consts,
    ) -> Result<CStep, Why> {
        let returns = op.c_returns.clone().ok_or_else(|| Why::ReturnType(op.return_types.clone()))?;
        let outputs_fit = match &node.outputs {
            SlotOutputs::None => true,
            SlotOutputs::One(_) => returns.len() == 1 && returns[0] != Ty::List(Box::new(Ty::Tensor)),
            SlotOutputs::Many(slots) => {
                returns == [Ty::List(Box::new(Ty::Tensor))]
                    || (slots.len() <= returns.len() && !returns.iter().any(|r| matches!(r, Ty::List(_))))
            }
        };
        if !outputs_fit
            || returns.iter().any(|r| !matches!(r, Ty::Tensor | Ty::Int | Ty::Float | Ty::Bool | Ty::List(_)))
        {
            return Err(Why::ReturnType(op.return_types.clone()));
        }
        let mut args = Vec::with_capacity(bound.len());
        for (param, value) in op.args.iter().zip(bound) {
            let ty = param.ty.clone().ok_or_else(|| Why::ArgType(param.name.clone(), param.type_name.clone()))?;
            let enc = encode::encode(abi, &ty, param.writes, value, is_tensor, consts)
                .ok_or_else(|| Why::ArgValue(param.name.clone(), param.type_name.clone()))?;
            args.push((ty, enc));
        }
        Ok(CStep {
            name: op.c_name.clone(),
            args,
            returns,
            outputs: node.outputs.clone(),
            free: node.free.clone(),
            shim: None,
        })
    }

    /// A node whose result was made at load (`consts[constant]`): a clone of it per call, so
    /// each call still gets a tensor of its own.
    pub(super) fn clone_of(constant: usize, node: &SlotNode) -> CStep {
        CStep {
            name: (c"aten::clone".to_owned(), c"".to_owned()),
            args: vec![(Ty::Tensor, Enc::Const(constant)), (Ty::Optional(Box::new(Ty::MemoryFormat)), Enc::Bits(0))],
            returns: vec![Ty::Tensor],
            outputs: node.outputs.clone(),
            free: node.free.clone(),
            shim: None,
        }
    }

    /// Calls `f` with each slot the node reads.
    pub(crate) fn visit_reads(&self, f: &mut impl FnMut(usize)) {
        self.args.iter().for_each(|(_, e)| e.visit_slots(f));
    }

    /// `aten::add.Tensor`, as errors name the op.
    pub(crate) fn op_name(&self) -> String {
        let (op, overload) = (self.name.0.to_string_lossy(), self.name.1.to_string_lossy());
        if overload.is_empty() {
            op.into_owned()
        } else {
            format!("{op}.{overload}")
        }
    }
}
