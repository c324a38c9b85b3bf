//! Nodes whose schema has a `Scalar`, which the dispatcher's stable stack can't carry. Two
//! ways onto the C path, each giving the same bits as the op itself:
//!
//! - a per-op shim that takes the `Scalar` as a `double` (`add.Tensor`'s `alpha`, `addmm`'s
//!   `beta` and `alpha`, `pow.Tensor_Scalar`'s exponent), where the literal is exactly a
//!   double; the shim checks its tensors on each call and falls back to the Python op for
//!   integer tensors (see `abi::shims`);
//! - the op's `Tensor` overload with the number wrapped as torch wraps it, where torch's own
//!   `Scalar` overload is defined as exactly that (`ge.Scalar` is `ge.Tensor` on a wrapped
//!   number).

use std::ffi::CString;

use kwexport_core::graph::{SlotArg, SlotNode, SlotOutputs};
use kwexport_core::schema::Arg;

use super::{CStep, ShimStep};
use crate::abi::encode::{self, Consts, Enc};
use crate::abi::shims::{Family, ShimFn};
use crate::abi::{Abi, Ty};
use crate::ops::OpSchema;

/// A shim's use: which schema arguments are its tensors and its doubles, in its order.
struct ShimUse {
    f: Option<ShimFn>,
    family: Family,
    tensors: &'static [usize],
    scalars: &'static [usize],
    in_place: bool,
}

/// Comparisons whose `Scalar` overload is the `Tensor` overload on a wrapped number.
const WRAPPING_COMPARISONS: [&str; 6] = ["aten::eq", "aten::ne", "aten::lt", "aten::le", "aten::gt", "aten::ge"];

/// The C step for a node with a `Scalar`, if one of the two ways covers it.
pub(super) fn compile(
    abi: &Abi,
    op: &OpSchema,
    node: &SlotNode,
    bound: &[&SlotArg],
    is_tensor: &dyn Fn(usize) -> bool,
    consts: &mut dyn Consts,
) -> Option<CStep> {
    let name = (op.c_name.0.to_str().ok()?, op.c_name.1.to_str().ok()?);
    if name.1 == "Scalar" && WRAPPING_COMPARISONS.contains(&name.0) && bound.len() == 2 {
        return wrapped_overload(abi, op, node, bound, is_tensor, consts);
    }
    // `masked_fill(_).Tensor` takes its 0-dim value's `item()`: the Scalar the node has.
    if name.1 == "Scalar" && matches!(name.0, "aten::masked_fill" | "aten::masked_fill_") && bound.len() == 3 {
        return wrapped_overload(abi, op, node, bound, is_tensor, consts);
    }
    let shims = abi.shims.as_ref()?;
    let cpu = |f, tensors, scalars, in_place| ShimUse { f, family: Family::Cpu, tensors, scalars, in_place };
    let uses = match name {
        ("aten::add", "Tensor") => cpu(shims.add_tensor, &[0, 1], &[2], false),
        ("aten::add_", "Tensor") => cpu(shims.add_tensor, &[0, 1], &[2], true),
        ("aten::sub", "Tensor") => {
            ShimUse { f: shims.subtract_tensor, family: Family::Aten, tensors: &[0, 1], scalars: &[2], in_place: false }
        }
        ("aten::pow", "Tensor_Scalar") => cpu(shims.pow_tensor_scalar, &[0], &[1], false),
        ("aten::addmm", "") => cpu(shims.addmm_out, &[0, 1, 2], &[3, 4], false),
        _ => return None,
    };
    if bound.len() != uses.tensors.len() + uses.scalars.len() || !matches!(node.outputs, SlotOutputs::One(_)) {
        return None;
    }
    let f = uses.f?;
    let mut args = Vec::with_capacity(uses.tensors.len());
    for &i in uses.tensors {
        let writes = uses.in_place && i == 0;
        args.push((Ty::Tensor, encode::encode(abi, &Ty::Tensor, writes, bound[i], is_tensor, consts)?));
    }
    if uses.in_place && !matches!(args[0].1, Enc::Slot(_)) {
        return None;
    }
    let scalars = uses.scalars.iter().map(|&i| exact_double(bound[i])).collect::<Option<Vec<_>>>()?;
    Some(CStep {
        name: op.c_name.clone(),
        args,
        returns: vec![Ty::Tensor],
        outputs: node.outputs.clone(),
        free: node.free.clone(),
        shim: Some(Box::new(ShimStep { f, family: uses.family, scalars, in_place: uses.in_place, fallback: None })),
    })
}

/// `op.Scalar(..., value)` as `op.Tensor(..., wrapped(value))`, for a literal last argument.
fn wrapped_overload(
    abi: &Abi,
    op: &OpSchema,
    node: &SlotNode,
    bound: &[&SlotArg],
    is_tensor: &dyn Fn(usize) -> bool,
    consts: &mut dyn Consts,
) -> Option<CStep> {
    let (last, tensors) = bound.split_last()?;
    let SlotArg::Literal(value) = last else { return None };
    let mut args = Vec::with_capacity(bound.len());
    for (param, a) in op.args.iter().zip(tensors) {
        args.push((Ty::Tensor, encode::encode(abi, &Ty::Tensor, param.writes, a, is_tensor, consts)?));
    }
    args.push((Ty::Tensor, Enc::Const(consts.number(value)?)));
    Some(CStep {
        name: (op.c_name.0.clone(), CString::new("Tensor").ok()?),
        args,
        returns: vec![Ty::Tensor],
        outputs: node.outputs.clone(),
        free: node.free.clone(),
        shim: None,
    })
}

/// A `Scalar` literal as the double a shim takes, if that double is exactly it: an int
/// within 2^53 or a float. Bools and symbolic values stay on the Python path.
fn exact_double(a: &SlotArg) -> Option<f64> {
    match a {
        SlotArg::Literal(Arg::Float(f)) => Some(f.0),
        SlotArg::Literal(Arg::Int(i)) if i.unsigned_abs() <= 1 << 53 => Some(*i as f64),
        _ => None,
    }
}
