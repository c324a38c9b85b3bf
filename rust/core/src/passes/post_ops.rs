//! The activations oneDNN's fused convolution and linear apply after their product (their
//! "post-ops"): the one table of them. The passes that fuse an activation read it here; the
//! runtime maps each [`Activation`] to its kernels' epilogue; Python reads it (`_rt.POST_OPS`)
//! for the fused ops' Python forms, which run each post-op as its aten op.

use crate::schema::{Arg, Float, Node};

/// An activation a fused op may apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// `hardtanh(x, 0, 6)` only: MobileNetV2's ([`RELU6`]).
    Relu6,
    /// `x * relu6(x + 3) / 6`.
    Hardswish,
    /// `relu6(x + 3) / 6`.
    Hardsigmoid,
    /// SiLU, `x * sigmoid(x)`.
    Swish,
    /// `1 / (1 + e^-x)`.
    Sigmoid,
    /// `tanh(x)`.
    Tanh,
    /// With its approximation in the fused node's `algorithm` argument.
    Gelu,
}

/// One post-op: the activation, oneDNN's name for it (the fused node's `attr`), and the aten
/// op that computes it (its input first, then the post-op's scalars), out of place and in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostOp {
    /// What it computes.
    pub activation: Activation,
    /// oneDNN's name for it.
    pub attr: &'static str,
    /// The aten op that computes it.
    pub op: &'static str,
    /// That op's in-place form.
    pub inplace: &'static str,
}

/// Every post-op the passes fuse.
pub const POST_OPS: &[PostOp] = &[
    PostOp { activation: Activation::Relu, attr: "relu", op: "aten::relu.default", inplace: "aten::relu_.default" },
    PostOp {
        activation: Activation::Relu6,
        attr: "hardtanh",
        op: "aten::hardtanh.default",
        inplace: "aten::hardtanh_.default",
    },
    PostOp {
        activation: Activation::Hardswish,
        attr: "hardswish",
        op: "aten::hardswish.default",
        inplace: "aten::hardswish_.default",
    },
    PostOp {
        activation: Activation::Hardsigmoid,
        attr: "hardsigmoid",
        op: "aten::hardsigmoid.default",
        inplace: "aten::hardsigmoid_.default",
    },
    PostOp { activation: Activation::Swish, attr: "swish", op: "aten::silu.default", inplace: "aten::silu_.default" },
    PostOp {
        activation: Activation::Sigmoid,
        attr: "sigmoid",
        op: "aten::sigmoid.default",
        inplace: "aten::sigmoid_.default",
    },
    PostOp { activation: Activation::Tanh, attr: "tanh", op: "aten::tanh.default", inplace: "aten::tanh_.default" },
    PostOp { activation: Activation::Gelu, attr: "gelu", op: "aten::gelu.default", inplace: "aten::gelu_.default" },
];

/// The bounds of the one `hardtanh` post-op the passes fuse, ReLU6's: `[min, max]`, the
/// post-op's scalars in oneDNN's fused ops.
pub const RELU6: [f64; 2] = [0.0, 6.0];

/// The activation oneDNN's `attr` names (`"none"` is none).
pub fn of_attr(attr: &str) -> Option<Activation> {
    POST_OPS.iter().find(|p| p.attr == attr).map(|p| p.activation)
}

/// oneDNN's name for the activation op `op` (out of place or in place), where it is one of
/// `attrs`.
pub fn attr_of_op(op: Option<&str>, attrs: &[&str]) -> Option<&'static str> {
    let op = op?;
    POST_OPS.iter().find(|p| (p.op == op || p.inplace == op) && attrs.contains(&p.attr)).map(|p| p.attr)
}

/// The scalars an activation node gives its post-op `attr` (`[]` for all but `hardtanh`),
/// `None` where the node's arguments aren't ones the post-op takes: the input alone, or for
/// `hardtanh`, the input and ReLU6's bounds as literals.
pub fn scalars(attr: &str, args: &[Arg]) -> Option<Vec<Arg>> {
    let number = |a: &Arg| match a {
        Arg::Float(Float(v)) => Some(*v),
        Arg::Int(v) => Some(*v as f64),
        _ => None,
    };
    match (attr, args) {
        ("hardtanh", [_, lo, hi]) if [number(lo)?, number(hi)?] == RELU6 => {
            Some(RELU6.iter().map(|&v| Arg::Float(Float(v))).collect())
        }
        ("hardtanh", _) => None,
        (_, [_]) => Some(Vec::new()),
        _ => None,
    }
}

/// A fused op's `algorithm` for an activation node: GELU's `approximate` (`"none"` or
/// `"tanh"`), `None` for the others, which take only their input. `None` (no fusion) for
/// anything else.
pub fn algorithm(attr: &str, a: &Node) -> Option<Arg> {
    if attr != "gelu" {
        return (a.args.len() == 1 && a.kwargs.is_empty()).then_some(Arg::None(()));
    }
    let approximate = match (a.args.as_slice(), a.kwargs.get("approximate")) {
        ([_], None) => "none",
        ([_], Some(Arg::Str(s))) if a.kwargs.len() == 1 => s.as_str(),
        ([_, Arg::Str(s)], None) if a.kwargs.is_empty() => s.as_str(),
        _ => return None,
    };
    matches!(approximate, "none" | "tanh").then(|| Arg::Str(approximate.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_post_op_is_named_once() {
        for (i, p) in POST_OPS.iter().enumerate() {
            for q in &POST_OPS[i + 1..] {
                assert!(p.attr != q.attr && p.activation != q.activation && p.op != q.op, "{p:?} {q:?}");
            }
            assert_eq!(of_attr(p.attr), Some(p.activation));
            assert_eq!(attr_of_op(Some(p.inplace), &[p.attr]), Some(p.attr));
        }
        assert_eq!(of_attr("none"), None);
        assert_eq!(attr_of_op(Some("aten::relu.default"), &["swish"]), None);
    }

    #[test]
    fn hardtanh_is_fused_with_relu6_bounds_only() {
        let f = |v: f64| Arg::Float(Float(v));
        let x = Arg::Ref("x".into());
        assert_eq!(scalars("hardtanh", &[x.clone(), Arg::Int(0), f(6.0)]), Some(vec![f(0.0), f(6.0)]));
        assert_eq!(scalars("hardtanh", &[x.clone(), f(-1.0), f(1.0)]), None);
        assert_eq!(scalars("relu", std::slice::from_ref(&x)), Some(vec![]));
        assert_eq!(scalars("relu", &[x, Arg::Int(1)]), None);
    }
}
