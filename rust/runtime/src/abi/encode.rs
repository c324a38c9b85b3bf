//! Values on the C path. At load, each argument of a node is encoded against its op's
//! schema type (`Enc`): fixed bits for literals, a slot to read, a constant tensor (a weight,
//! or a number wrapped as torch wraps it). At call time the encodings become a stack of
//! `StableIValue`s and the returns become [`Native`] values. An argument the ABI does not
//! cover (a `Scalar`, a `Generator`) encodes to `None`, which keeps its node on Python.

use kwexport_core::graph::{SlotArg, ValueRef};
use kwexport_core::schema::Arg;

use super::{Abi, CError, StableIValue, Tensor, Ty};

/// A value computed or converted for the C path.
#[derive(Debug)]
pub enum Native {
    Tensor(Tensor),
    Int(i64),
    Float(f64),
    Bool(bool),
}

/// How one argument is built at call time.
#[derive(Debug)]
pub enum Enc {
    Bits(StableIValue),
    Slot(usize),
    /// An index into the plan's constant tensors.
    Const(usize),
    /// A number literal beside the tensor in slot `like`: the constant `cast` (the wrapped
    /// number already cast to dtype code `dtype`) when that tensor has that dtype, else the
    /// wrapped number `wrapped`. See `CStep::cast_numbers_ahead`.
    Number {
        wrapped: usize,
        cast: usize,
        dtype: i32,
        like: usize,
    },
    Some(Box<Enc>),
    List(Vec<Enc>),
    Str(String),
}

/// Constant tensors an encoded argument may name: resolved by the plan (weights, wrapped
/// numbers) and turned into handles once the whole plan is built.
pub trait Consts {
    /// The index of weight `name`.
    fn weight(&mut self, name: &str) -> usize;
    /// The index of a number wrapped as a tensor, if torch's wrapping could be reproduced.
    fn number(&mut self, lit: &Arg) -> Option<usize>;
    /// The index of weight `name`'s transpose (`weight.t()`), if it is a matrix.
    fn weight_t(&mut self, name: &str) -> Option<usize>;
    /// The shape of a float32 weight; `None` for another dtype.
    fn f32_shape(&mut self, name: &str) -> Option<Vec<i64>>;
    /// The index of the wrapped number `wrapped` (an index `number` gave) cast to `dtype`
    /// as torch's type promotion casts it.
    fn number_cast(&mut self, wrapped: usize, dtype: &str) -> Option<usize>;
}

/// Encodes one argument for a parameter of type `ty` (`writes` if the op writes to it);
/// `None` if the ABI can't pass it. `is_tensor(slot)` says whether a slot always holds a
/// tensor (else a number): the dispatcher can't take a number where the schema wants a
/// tensor, as Python ops can.
pub fn encode(
    abi: &Abi,
    ty: &Ty,
    writes: bool,
    value: &SlotArg,
    is_tensor: &dyn Fn(usize) -> bool,
    consts: &mut dyn Consts,
) -> Option<Enc> {
    Some(match (ty, value) {
        (Ty::Optional(_), SlotArg::Literal(Arg::None(()))) => Enc::Bits(0),
        (Ty::Optional(inner), v) => Enc::Some(Box::new(encode(abi, inner, writes, v, is_tensor, consts)?)),
        (Ty::List(inner), SlotArg::List(items)) => {
            Enc::List(items.iter().map(|i| encode(abi, inner, writes, i, is_tensor, consts)).collect::<Option<_>>()?)
        }
        (Ty::List(_), _) => return None,
        (Ty::Tensor, SlotArg::Value(ValueRef::Slot(s))) if is_tensor(*s) => Enc::Slot(*s),
        (Ty::Int | Ty::Float | Ty::Bool, SlotArg::Value(ValueRef::Slot(s))) if !is_tensor(*s) => Enc::Slot(*s),
        (Ty::Tensor, SlotArg::Value(ValueRef::Weight(w))) => Enc::Const(consts.weight(w)),
        // A constant the op writes to would leak one call's changes into the next.
        (Ty::Tensor, SlotArg::Literal(lit)) if !writes => Enc::Const(consts.number(lit)?),
        (Ty::Str, SlotArg::Literal(Arg::Str(s))) => Enc::Str(s.clone()),
        (_, SlotArg::Literal(lit)) => Enc::Bits(literal_bits(abi, ty, lit)?),
        _ => return None,
    })
}

impl Enc {
    /// The constant a constant tensor argument reads on this call; `None` for other
    /// encodings.
    pub fn const_index(&self, abi: &Abi, slots: &[Option<Native>]) -> Option<usize> {
        match self {
            Enc::Const(i) => Some(*i),
            Enc::Number { wrapped, cast, dtype, like } => {
                let same = match (&slots[*like], &abi.shims) {
                    (Some(Native::Tensor(t)), Some(shims)) => shims.dtype(t.raw()) == Some(*dtype),
                    _ => false,
                };
                Some(if same { *cast } else { *wrapped })
            }
            _ => None,
        }
    }

    /// Calls `f` with each slot the encoding reads.
    pub fn visit_slots(&self, f: &mut impl FnMut(usize)) {
        match self {
            Enc::Slot(s) => f(*s),
            Enc::Number { like, .. } => f(*like),
            Enc::Some(inner) => inner.visit_slots(f),
            Enc::List(items) => items.iter().for_each(|i| i.visit_slots(f)),
            Enc::Bits(_) | Enc::Const(_) | Enc::Str(_) => {}
        }
    }
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
        // Schemas print enum defaults as torch's codes (`MemoryFormat memory_format=0`).
        (Ty::ScalarType | Ty::Layout | Ty::MemoryFormat, Arg::Int(i)) if abi.is_code(ty, *i) => *i as u32 as u64,
        _ => return None,
    })
}

/// Builds one argument; owned parts (handles, lists, boxes, strings) pass to torch.
pub fn build(
    abi: &Abi,
    ty: &Ty,
    enc: &Enc,
    slots: &[Option<Native>],
    consts: &[Tensor],
) -> Result<StableIValue, CError> {
    match (ty, enc) {
        (_, Enc::Bits(b)) => Ok(*b),
        (Ty::Tensor, Enc::Const(_) | Enc::Number { .. }) => match enc.const_index(abi, slots) {
            Some(i) => abi.share(&consts[i]),
            None => Err(CError::Internal(format!("{enc:?} names no constant"))),
        },
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
            (ty, other) => Err(CError::Internal(format!(
                "slot {s} holds {} where {ty:?} is expected",
                match other {
                    None => "nothing",
                    Some(Native::Tensor(_)) => "a tensor",
                    Some(Native::Int(_)) => "an int",
                    Some(Native::Float(_)) => "a float",
                    Some(Native::Bool(_)) => "a bool",
                }
            ))),
        },
        (ty, enc) => Err(CError::Internal(format!("{enc:?} compiled for {ty:?}"))),
    }
}

/// Takes a returned value over. Return types were checked at compile time.
pub fn decode(abi: &Abi, ty: &Ty, v: StableIValue) -> Option<Native> {
    match ty {
        Ty::Tensor => Some(Native::Tensor(abi.adopt(v))),
        Ty::Int => Some(Native::Int(v as i64)),
        Ty::Float => Some(Native::Float(f64::from_bits(v))),
        Ty::Bool => Some(Native::Bool(v as u8 != 0)),
        _ => None,
    }
}
