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
    /// `hardtanh(x, 0, 6)` only (`nn.ReLU6`; `F.relu6` gives `relu6(x)`, an alias): [`RELU6`].
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

/// Aten ops that compute a post-op with its scalars fixed, out of place and in place:
/// `F.relu6` exports as `aten::relu6`, which is `hardtanh(x, 0, 6)` ([`RELU6`]).
const ALIASES: &[(&str, &str, &str)] = &[("aten::relu6.default", "aten::relu6_.default", "hardtanh")];

/// An activation node matched as a post-op: what a fused node takes in its place.
#[derive(Debug, Clone, PartialEq)]
pub struct Matched {
    /// oneDNN's name for it (the fused node's `attr`).
    pub attr: &'static str,
    /// Its scalars: ReLU6's bounds for `hardtanh`, else none.
    pub scalars: Vec<Arg>,
    /// GELU's approximation (`"none"` or `"tanh"`); `None` for the others.
    pub algorithm: Arg,
}

/// The post-op among `attrs` that the activation node `a` (running `op`) computes, where a
/// fused node can take its place: its input as the only argument, but for `hardtanh` with
/// ReLU6's bounds as literals and GELU with its `approximate`. `None` for anything else.
pub fn matched(op: Option<&str>, a: &Node, attrs: &[&str]) -> Option<Matched> {
    let op = op?;
    let direct = POST_OPS.iter().find(|p| p.op == op || p.inplace == op).map(|p| p.attr);
    let alias = ALIASES.iter().find(|(out, inplace, _)| *out == op || *inplace == op).map(|(.., attr)| *attr);
    let attr = direct.or(alias).filter(|attr| attrs.contains(attr))?;
    let number = |a: &Arg| match a {
        Arg::Float(Float(v)) => Some(*v),
        Arg::Int(v) => Some(*v as f64),
        _ => None,
    };
    let relu6 = || RELU6.iter().map(|&v| Arg::Float(Float(v))).collect::<Vec<_>>();
    let only = |scalars| Some(Matched { attr, scalars, algorithm: Arg::None(()) });
    if attr == "gelu" {
        let approximate = match (a.args.as_slice(), a.kwargs.get("approximate")) {
            ([_], None) => "none",
            ([_], Some(Arg::Str(s))) if a.kwargs.len() == 1 => s.as_str(),
            ([_, Arg::Str(s)], None) if a.kwargs.is_empty() => s.as_str(),
            _ => return None,
        };
        let algorithm = Arg::Str(approximate.to_owned());
        return matches!(approximate, "none" | "tanh").then_some(Matched { attr, scalars: Vec::new(), algorithm });
    }
    if !a.kwargs.is_empty() {
        return None;
    }
    match (a.args.as_slice(), alias.is_some()) {
        ([_], true) => only(relu6()),
        ([_, lo, hi], false) if attr == "hardtanh" && [number(lo)?, number(hi)?] == RELU6 => only(relu6()),
        ([_], false) if attr != "hardtanh" => only(Vec::new()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Outputs;

    fn node(args: Vec<Arg>, kwargs: &[(&str, Arg)]) -> Node {
        let kwargs = kwargs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect();
        Node { op: 0, args, kwargs, outputs: Outputs::One("y".into()) }
    }

    #[test]
    fn each_post_op_is_named_once() {
        let x = node(vec![Arg::Ref("x".into())], &[]);
        for (i, p) in POST_OPS.iter().enumerate() {
            for q in &POST_OPS[i + 1..] {
                assert!(p.attr != q.attr && p.activation != q.activation && p.op != q.op, "{p:?} {q:?}");
            }
            assert_eq!(of_attr(p.attr), Some(p.activation));
            if p.attr != "hardtanh" {
                assert_eq!(matched(Some(p.inplace), &x, &[p.attr]).map(|m| m.attr), Some(p.attr));
            }
        }
        assert_eq!(of_attr("none"), None);
        assert_eq!(matched(Some("aten::relu.default"), &x, &["swish"]), None);
    }

    #[test]
    fn hardtanh_is_fused_with_relu6_bounds_only() {
        let f = |v: f64| Arg::Float(Float(v));
        let x = Arg::Ref("x".into());
        let relu6 = Some(Matched { attr: "hardtanh", scalars: vec![f(0.0), f(6.0)], algorithm: Arg::None(()) });
        let hardtanh = |args| matched(Some("aten::hardtanh.default"), &node(args, &[]), &["hardtanh"]);
        assert_eq!(hardtanh(vec![x.clone(), Arg::Int(0), f(6.0)]), relu6);
        assert_eq!(hardtanh(vec![x.clone(), f(-1.0), f(1.0)]), None);
        assert_eq!(hardtanh(vec![x.clone()]), None);
        let relu = |n: &Node| matched(Some("aten::relu.default"), n, &["relu"]).map(|m| m.scalars);
        assert_eq!(relu(&node(vec![x.clone()], &[])), Some(vec![]));
        assert_eq!(relu(&node(vec![x.clone(), Arg::Int(1)], &[])), None);
        // `F.relu6` exports as `aten::relu6`: ReLU6, fused as `hardtanh` with its bounds.
        for op in ["aten::relu6.default", "aten::relu6_.default"] {
            assert_eq!(matched(Some(op), &node(vec![x.clone()], &[]), &["hardtanh"]), relu6);
            assert_eq!(matched(Some(op), &node(vec![x.clone()], &[]), &["relu"]), None);
        }
    }

    #[test]
    fn gelu_takes_its_approximation() {
        let x = Arg::Ref("x".into());
        let tanh = Arg::Str("tanh".into());
        let gelu = |n: Node| matched(Some("aten::gelu.default"), &n, &["gelu"]).map(|m| m.algorithm);
        assert_eq!(gelu(node(vec![x.clone()], &[])), Some(Arg::Str("none".into())));
        assert_eq!(gelu(node(vec![x.clone()], &[("approximate", tanh.clone())])), Some(tanh.clone()));
        assert_eq!(gelu(node(vec![x.clone(), tanh.clone()], &[])), Some(tanh));
        assert_eq!(gelu(node(vec![x], &[("approximate", Arg::Str("erf".into()))])), None);
    }
}
