//! Nodes that run through torch's stable C ABI, without Python.
//!
//! At load, each argument of a node is compiled against its op's schema type into an
//! encoding (`Enc`): fixed bits for literals, a slot to read, a constant tensor (a weight, or
//! a number wrapped as torch wraps it). At call time the encodings become a stack of
//! `StableIValue`s, the dispatcher runs the op with the GIL released, and the returns become
//! native values in the slots. A node whose schema or arguments the ABI does not cover
//! (a `Scalar`, a `Generator`, a Python operator) stays on the Python path.

use std::ffi::CString;

use crate::abi::{Abi, StableIValue, Tensor, Ty};
use crate::graph::{ArgPlan, OutPlan, StepPlan, ValueRef};
use crate::schema::Arg;

/// A value computed or converted for the C path.
pub enum Native {
    Tensor(Tensor),
    Int(i64),
    Float(f64),
    Bool(bool),
}

/// How one argument is built at call time.
#[derive(Debug)]
enum Enc {
    Bits(StableIValue),
    Slot(usize),
    /// An index into the plan's constant tensors.
    Const(usize),
    Some(Box<Enc>),
    List(Vec<Enc>),
    Str(String),
}

/// What compiling a node needs of the op's schema, read once per load.
pub struct AbiOp {
    pub op: CString,
    pub overload: CString,
    /// Per schema argument: its type, if the ABI covers it, and whether the op writes to it.
    pub params: Vec<(Option<Ty>, bool)>,
    /// `None` if some return type is not covered.
    pub returns: Option<Vec<Ty>>,
}

/// Constant tensors a compiled node may name: resolved by the caller (weights, wrapped
/// numbers), turned into handles once the whole plan is compiled.
pub trait Consts {
    fn weight(&mut self, name: &str) -> usize;
    fn number(&mut self, lit: &Arg) -> Option<usize>;
}

pub struct AbiStep {
    op: CString,
    overload: CString,
    args: Vec<(Ty, Enc)>,
    returns: Vec<Ty>,
    outputs: OutPlan,
    pub free: Vec<usize>,
}

impl AbiStep {
    /// Compiles a node whose arguments are already matched to the schema (`bound[i]` is
    /// the value for parameter `i`: given, or its default). `None` if the ABI can't run it.
    /// `is_tensor(slot)` says whether a slot always holds a tensor (else a number): the
    /// dispatcher can't take a number where the schema wants a tensor, as Python ops can.
    pub fn compile(
        abi: &Abi,
        op: &AbiOp,
        step: &StepPlan,
        bound: &[&ArgPlan],
        is_tensor: &dyn Fn(usize) -> bool,
        consts: &mut dyn Consts,
    ) -> Option<AbiStep> {
        let returns = op.returns.clone()?;
        let outputs_fit = match &step.outputs {
            OutPlan::None => true,
            OutPlan::One(_) => returns.len() == 1 && returns[0] != Ty::List(Box::new(Ty::Tensor)),
            OutPlan::Many(slots) => {
                returns == [Ty::List(Box::new(Ty::Tensor))]
                    || (slots.len() <= returns.len() && !returns.iter().any(|r| matches!(r, Ty::List(_))))
            }
        };
        if !outputs_fit
            || returns.iter().any(|r| !matches!(r, Ty::Tensor | Ty::Int | Ty::Float | Ty::Bool | Ty::List(_)))
        {
            return None;
        }
        let mut args = Vec::with_capacity(bound.len());
        for ((ty, writes), value) in op.params.iter().zip(bound) {
            let ty = ty.clone()?;
            let enc = encode_arg(abi, &ty, *writes, value, is_tensor, consts)?;
            args.push((ty, enc));
        }
        Some(AbiStep {
            op: op.op.clone(),
            overload: op.overload.clone(),
            args,
            returns,
            outputs: step.outputs.clone(),
            free: step.free.clone(),
        })
    }

    /// Every slot the node reads.
    pub fn reads(&self, out: &mut Vec<usize>) {
        fn walk(e: &Enc, out: &mut Vec<usize>) {
            match e {
                Enc::Slot(s) => out.push(*s),
                Enc::Some(inner) => walk(inner, out),
                Enc::List(items) => items.iter().for_each(|i| walk(i, out)),
                _ => {}
            }
        }
        self.args.iter().for_each(|(_, e)| walk(e, out));
    }

    /// Every slot the node defines.
    pub fn writes(&self) -> impl Iterator<Item = usize> + '_ {
        self.outputs.defined().map(|(_, s)| s)
    }

    /// Runs the node. `stack` is scratch space reused across nodes.
    pub fn run(
        &self,
        abi: &Abi,
        slots: &mut [Option<Native>],
        consts: &[Tensor],
        stack: &mut Vec<StableIValue>,
    ) -> Result<(), String> {
        stack.clear();
        for (ty, enc) in &self.args {
            match build(abi, ty, enc, slots, consts) {
                Ok(v) => stack.push(v),
                Err(e) => {
                    for ((ty, _), &v) in self.args.iter().zip(stack.iter()) {
                        // SAFETY: built for `ty` just above, never handed to torch.
                        unsafe { abi.release(ty, v) };
                    }
                    return Err(e);
                }
            }
        }
        stack.resize(stack.len().max(self.returns.len()), 0);
        // SAFETY: one value per schema argument, encoded for its type; room for the returns.
        unsafe { abi.call(&self.op, &self.overload, stack) }.map_err(|e| {
            format!(
                "{}{}{}: {e}",
                self.op.to_string_lossy(),
                if self.overload.is_empty() { "" } else { "." },
                self.overload.to_string_lossy()
            )
        })?;
        let returned = &stack[..self.returns.len()];
        match &self.outputs {
            OutPlan::One(Some(s)) => slots[*s] = decode(abi, &self.returns[0], returned[0]),
            OutPlan::None | OutPlan::One(None) => {
                for (ty, &v) in self.returns.iter().zip(returned) {
                    // SAFETY: an owned return no one reads.
                    unsafe { abi.release(ty, v) };
                }
            }
            OutPlan::Many(targets) => {
                let values: Vec<Option<Native>> = if let [Ty::List(inner)] = self.returns.as_slice() {
                    // SAFETY: the dispatcher returned an owned list for a list return.
                    unsafe { abi.take_list(returned[0])? }.into_iter().map(|item| decode(abi, inner, item)).collect()
                } else {
                    self.returns.iter().zip(returned).map(|(ty, &v)| decode(abi, ty, v)).collect()
                };
                // Values without a target drop here, which frees their tensors.
                for (value, target) in values.into_iter().zip(targets.iter().chain(std::iter::repeat(&None))) {
                    if let Some(s) = target {
                        slots[*s] = value;
                    }
                }
            }
        }
        for &s in &self.free {
            slots[s] = None;
        }
        Ok(())
    }
}

fn encode_arg(
    abi: &Abi,
    ty: &Ty,
    writes: bool,
    value: &ArgPlan,
    is_tensor: &dyn Fn(usize) -> bool,
    consts: &mut dyn Consts,
) -> Option<Enc> {
    Some(match (ty, value) {
        (Ty::Optional(_), ArgPlan::Literal(Arg::None(()))) => Enc::Bits(0),
        (Ty::Optional(inner), v) => Enc::Some(Box::new(encode_arg(abi, inner, writes, v, is_tensor, consts)?)),
        (Ty::List(inner), ArgPlan::List(items)) => Enc::List(
            items.iter().map(|i| encode_arg(abi, inner, writes, i, is_tensor, consts)).collect::<Option<_>>()?,
        ),
        (Ty::List(_), _) => return None,
        (Ty::Tensor, ArgPlan::Value(ValueRef::Slot(s))) if is_tensor(*s) => Enc::Slot(*s),
        (Ty::Int | Ty::Float | Ty::Bool, ArgPlan::Value(ValueRef::Slot(s))) if !is_tensor(*s) => Enc::Slot(*s),
        (Ty::Tensor, ArgPlan::Value(ValueRef::Weight(w))) => Enc::Const(consts.weight(w)),
        // A constant the op writes to would leak one call's changes into the next.
        (Ty::Tensor, ArgPlan::Literal(lit)) if !writes => Enc::Const(consts.number(lit)?),
        (Ty::Str, ArgPlan::Literal(Arg::Str(s))) => Enc::Str(s.clone()),
        (_, ArgPlan::Literal(lit)) => Enc::Bits(literal_bits(abi, ty, lit)?),
        _ => return None,
    })
}

/// A literal's bits for a scalar schema type, where the dispatcher reads it without
/// conversion (`int` as i64, `float` as f64, enums as torch's codes).
fn literal_bits(abi: &Abi, ty: &Ty, lit: &Arg) -> Option<StableIValue> {
    Some(match (ty, lit) {
        (Ty::Int, Arg::Int(i)) => *i as u64,
        (Ty::Float, Arg::Float(f)) => f.0.to_bits(),
        (Ty::Float, Arg::Int(i)) => (*i as f64).to_bits(),
        (Ty::Bool, Arg::Bool(b)) => *b as u64,
        (Ty::ScalarType, Arg::Dtype(d)) => abi.dtype_code(d)? as u32 as u64,
        (Ty::Layout, Arg::Layout(l)) => abi.layout_code(l)? as u32 as u64,
        (Ty::MemoryFormat, Arg::MemoryFormat(m)) => abi.memory_format_code(m)? as u32 as u64,
        (Ty::Device, Arg::Device(d)) => abi.device_bits(d)?,
        _ => return None,
    })
}

/// Builds one argument; owned parts (handles, lists, boxes, strings) pass to torch.
fn build(abi: &Abi, ty: &Ty, enc: &Enc, slots: &[Option<Native>], consts: &[Tensor]) -> Result<StableIValue, String> {
    match (ty, enc) {
        (_, Enc::Bits(b)) => Ok(*b),
        (Ty::Tensor, Enc::Const(i)) => abi.share(&consts[*i]),
        (_, Enc::Str(s)) => abi.new_string(s),
        (Ty::Optional(inner), Enc::Some(e)) => {
            let v = build(abi, inner, e, slots, consts)?;
            abi.boxed(v).inspect_err(|_| unsafe { abi.release(inner, v) })
        }
        (Ty::List(inner), Enc::List(items)) => {
            let mut built = Vec::with_capacity(items.len());
            for item in items {
                match build(abi, inner, item, slots, consts) {
                    Ok(v) => built.push(v),
                    Err(e) => {
                        // SAFETY: built for `inner` above, not yet handed to torch.
                        built.into_iter().for_each(|v| unsafe { abi.release(inner, v) });
                        return Err(e);
                    }
                }
            }
            abi.new_list(&built)
        }
        (ty, Enc::Slot(s)) => match (ty, &slots[*s]) {
            (Ty::Tensor, Some(Native::Tensor(t))) => abi.share(t),
            (Ty::Int, Some(Native::Int(i))) => Ok(*i as u64),
            (Ty::Float, Some(Native::Float(f))) => Ok(f.to_bits()),
            (Ty::Float, Some(Native::Int(i))) => Ok((*i as f64).to_bits()),
            (Ty::Bool, Some(Native::Bool(b))) => Ok(*b as u64),
            (ty, other) => Err(format!(
                "kwexport internal error: slot {s} holds {} where {ty:?} is expected",
                match other {
                    None => "nothing",
                    Some(Native::Tensor(_)) => "a tensor",
                    Some(Native::Int(_)) => "an int",
                    Some(Native::Float(_)) => "a float",
                    Some(Native::Bool(_)) => "a bool",
                }
            )),
        },
        (ty, enc) => Err(format!("kwexport internal error: {enc:?} compiled for {ty:?}")),
    }
}

/// Takes a returned value over. Return types were checked at compile time.
fn decode(abi: &Abi, ty: &Ty, v: StableIValue) -> Option<Native> {
    match ty {
        Ty::Tensor => Some(Native::Tensor(abi.adopt(v))),
        Ty::Int => Some(Native::Int(v as i64)),
        Ty::Float => Some(Native::Float(f64::from_bits(v))),
        Ty::Bool => Some(Native::Bool(v as u8 != 0)),
        _ => None,
    }
}
