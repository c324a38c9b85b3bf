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
        let view = match (op.c_name.0.to_str(), op.c_name.1.to_str(), args.first()) {
            (Ok(name), Ok(overload), Some((Ty::Tensor, Enc::Slot(_)))) => crate::views::ViewKind::of(name, overload),
            _ => None,
        };
        Ok(CStep {
            name: op.c_name.clone(),
            args,
            returns,
            outputs: node.outputs.clone(),
            free: node.free.clone(),
            shim: None,
            view,
            own: None,
            node: 0,
            to_caller: false,
            part: None,
            then: None,
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
            view: None,
            own: None,
            node: 0,
            to_caller: false,
            part: None,
            then: None,
        }
    }

    /// Lets a number literal of a binary op reach the kernel already cast to float32 when
    /// the other operand is float32. torch wraps the number as a float64 tensor, and
    /// TensorIterator then makes a float32 copy of it on every call (`x + 1.0` costs about
    /// twice `x + y`); casting it once at load gives the kernel the same value. Only ops
    /// whose kernels read the number as the common dtype (or as float32 through its
    /// `original_scalar_value`) qualify, and only float32: half and bfloat16 kernels read
    /// the float64 number in float32, which a cast to the tensor's dtype would round first.
    pub(super) fn cast_numbers_ahead(&mut self, abi: &Abi, consts: &mut dyn Consts) {
        const BINARY: [&str; 14] = [
            "aten::add",
            "aten::add_",
            "aten::sub",
            "aten::sub_",
            "aten::mul",
            "aten::mul_",
            "aten::div",
            "aten::div_",
            "aten::eq",
            "aten::ne",
            "aten::lt",
            "aten::le",
            "aten::gt",
            "aten::ge",
        ];
        let op = self.name.0.to_str().unwrap_or_default();
        if self.name.1.to_bytes() != b"Tensor" || !BINARY.contains(&op) || self.args.len() < 2 {
            return;
        }
        let Some(float32) = abi.dtype_code("float32") else { return };
        let (like, number) = match (&self.args[0].1, &self.args[1].1) {
            (Enc::Slot(s), Enc::Const(c)) => (*s, (1, *c)),
            (Enc::Const(c), Enc::Slot(s)) => (*s, (0, *c)),
            _ => return,
        };
        if let Some(cast) = consts.number_cast(number.1, "float32") {
            self.args[number.0].1 = Enc::Number { wrapped: number.1, cast, dtype: float32, like };
        }
    }

    /// Calls `f` with each slot the node reads.
    pub(crate) fn visit_reads(&self, f: &mut impl FnMut(usize)) {
        self.args.iter().for_each(|(_, e)| e.visit_slots(f));
    }

    /// `aten::add.Tensor`, as errors name the op.
    pub(crate) fn op_name(&self) -> String {
        let (op, overload) = (self.name.0.to_string_lossy(), self.name.1.to_string_lossy());
        format!("{op}.{}", if overload.is_empty() { "default" } else { &overload })
    }
}
