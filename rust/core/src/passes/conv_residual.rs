//! A lowered convolution's residual add, and the ReLU after it, as the convolution's own
//! post-ops (`optimize="fast"`, at load, after [`conv_pointwise`](super::conv_pointwise) and
//! [`linear_int8`](super::linear_int8)): `mkldnn::_convolution_pointwise.binary`, which adds
//! the other tensor to each result and applies the activation as the result is stored, or, for
//! kwexport's int8 convolution with a static scale, `kwexport::conv_int8.residual`, which does
//! the same before its output's quantization (which `linear_int8_output` then moves into it).
//! A ResNet block's `out += identity; relu(out)` then costs no pass of its own over memory: at
//! 224×224, resnet18's eight adds and ReLUs took ~2.5% of its float32 call, and ~10% of its
//! int8 one (with the fake quantization after them).
//!
//! The fused node takes the add's place, where the other tensor exists; the convolution's
//! inputs must then be unchanged since the convolution read them, so every node between the
//! two must write nothing (a pure aten op, or another lowered convolution). Only an add of
//! two tensors with `alpha` 1, whose other operand isn't the convolution's output, qualifies;
//! whether the other tensor has the output's shape and layout is the runtime's check on each
//! call (it runs torch's ops where it hasn't, broadcasting as the add did).

use std::collections::HashMap;

use super::linear_int8::{CONV, CONV_RESIDUAL, FUSED as LINEAR, FUSED_OPS};
use super::pass::{Ctx, Pass};
use super::readers::{one, sole_reader, weight_inputs, Readers, OUTSIDE};
use super::{Level, Target};
use crate::schema::{Arg, Document, Method, Node, Outputs, Weights};

/// The view that makes a 1×1 convolution an int8 linear over its pixels (`linear_int8`).
const MOVEDIM: &str = "aten::movedim.int";

/// The op a convolution with its residual add runs.
pub const FUSED: &str = crate::tables::PASS_OPS[2];

/// The adds a convolution absorbs: out-of-place, or in place into the convolution's output.
const ADDS: &[&str] = &["aten::add.Tensor", "aten::add_.Tensor"];

/// A lowered convolution that absorbs its residual add: its op, the index of its `attr`
/// argument (`"none"` where it has no activation yet), how many arguments it has then, and
/// the fused op.
struct Lowered {
    op: &'static str,
    attr: usize,
    args: usize,
    fused: &'static str,
}

/// oneDNN's float32 convolution (`conv_pointwise`).
const ONEDNN: Lowered = Lowered { op: super::conv_pointwise::FUSED, attr: 7, args: 10, fused: FUSED };

/// kwexport's int8 convolution with a static scale (`linear_int8`), before its output's
/// quantization moves into it.
const INT8: Lowered = Lowered { op: CONV, attr: 12, args: 14, fused: CONV_RESIDUAL };

impl Lowered {
    /// The fused node: the convolution's arguments with `other` added and the ReLU, if any.
    fn fused(&self, conv: &[Arg], other: &Arg, relu: bool) -> Vec<Arg> {
        let activation = |none: Arg| if relu { Arg::Str("relu".to_owned()) } else { none };
        match self.fused {
            // `_convolution_pointwise.binary(x, other, w, b, padding, stride, dilation, groups,
            // "add", alpha, unary_attr, unary_scalars, unary_algorithm)`.
            FUSED => [&conv[..1], std::slice::from_ref(other), &conv[1..7]]
                .concat()
                .into_iter()
                .chain([Arg::Str("add".to_owned()), Arg::None(()), activation(Arg::None(())), Arg::List(Vec::new())])
                .chain([Arg::None(())])
                .collect(),
            // `conv_int8.residual(x, ..., groups, other, attr, algorithm)`.
            _ => [&conv[..self.attr], std::slice::from_ref(other)]
                .concat()
                .into_iter()
                .chain([activation(Arg::Str("none".to_owned())), Arg::None(())])
                .collect(),
        }
    }
}

/// Fuses every qualifying convolution of each method's top-level graph with its residual add
/// (and the ReLU after it); returns how many.
pub fn apply(doc: &mut Document) -> usize {
    ConvResidual.apply(&mut Ctx::new(doc, Target { onednn: true, gemm: true, ..Target::default() }))
}

/// The pass (`fast`, after `conv_pointwise`).
pub struct ConvResidual;

impl Pass for ConvResidual {
    fn name(&self) -> &'static str {
        "conv_residual"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.onednn || target.gemm
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        let target = cx.target;
        let kinds: Vec<&Lowered> = [(target.onednn, &ONEDNN), (target.gemm, &INT8)]
            .into_iter()
            .filter_map(|(runs, kind)| runs.then_some(kind))
            .collect();
        cx.each_method(|_, m, readers, weights| kinds.iter().map(|kind| fuse(m, readers, weights, kind)).sum())
    }
}

/// Fuses the method's qualifying convolutions with their adds; returns how many.
fn fuse(m: &mut Method, readers: &Readers, weights: &Weights, kind: &Lowered) -> usize {
    let found = find(m, readers, weights, kind);
    if found.is_empty() {
        return 0;
    }
    let op = super::op_index(&mut m.ops, kind.fused);
    let mut removed = vec![false; m.graph.nodes.len()];
    let fused = found.len();
    for (convs, adds, node) in found {
        let at = *adds.last().expect("an add");
        m.graph.nodes[at] = Node { op, ..node };
        convs.iter().chain(&adds[..adds.len() - 1]).for_each(|&i| removed[i] = true);
    }
    super::remove_nodes(&mut m.graph.nodes, &removed);
    fused
}

/// A convolution that may absorb its add: the nodes it is (its own, and a 1×1 int8 one's
/// view of the result), its arguments as `kind`'s op takes them, and the value the add reads.
struct Candidate<'a> {
    nodes: Vec<usize>,
    args: std::borrow::Cow<'a, [Arg]>,
    y: &'a str,
}

/// The convolution at `ci` as `kind` lowered it, or, for int8, the 1×1 convolution that
/// `linear_int8` made an int8 linear over its pixels,
///
/// ```text
/// xm = movedim(x, -3, -1);  y = linear_int8(xm, ..., "none", algorithm);  ym = movedim(y, -1, -3)
/// ```
///
/// (its weight `[n, k, 1, 1]`), as the int8 convolution of `x` with stride 1, no padding and
/// one group that it is: the runtime's 1×1 kernel then adds the residual as it stores each
/// result (a ResNet bottleneck's or MobileNetV2's projection: resnet50's sixteen adds, ReLUs and
/// fake quantizations after them had taken 11% of its int8 call at 128×128).
fn candidate<'a>(
    m: &'a Method,
    readers: &Readers,
    (weights, weight_of): (&Weights, &HashMap<&str, &str>),
    kind: &Lowered,
    ci: usize,
) -> Option<Candidate<'a>> {
    let g = &m.graph;
    let op_of = |n: &Node| m.ops.get(n.op).map(|o| o.name.as_str());
    let conv = &g.nodes[ci];
    if !conv.kwargs.is_empty() {
        return None;
    }
    let y = one(conv)?;
    if op_of(conv) == Some(kind.op) {
        let bare = conv.args.len() == kind.args && conv.args[kind.attr] == Arg::Str("none".into());
        return bare.then(|| Candidate { nodes: vec![ci], args: conv.args.as_slice().into(), y });
    }
    // A static int8 linear's 11 arguments (no output quantization yet), its `attr` 10th.
    let pixels = kind.fused == CONV_RESIDUAL && op_of(conv) == Some(LINEAR) && conv.args.len() == 11;
    if !pixels || conv.args[9] != Arg::Str("none".into()) {
        return None;
    }
    let w = match &conv.args[5] {
        Arg::Ref(w) => weights.tensors.get(*weight_of.get(w.as_str())?)?,
        _ => return None,
    };
    if w.shape.len() != 4 || w.shape[2..] != [1, 1] {
        return None;
    }
    let movedim = |n: &'a Node, from: i64, to: i64| -> Option<&'a str> {
        let [Arg::Ref(v), Arg::Int(a), Arg::Int(b)] = n.args.as_slice() else { return None };
        (op_of(n) == Some(MOVEDIM) && n.kwargs.is_empty() && (*a, *b) == (from, to)).then_some(v.as_str())
    };
    let Arg::Ref(xm) = &conv.args[0] else { return None };
    let x = g.nodes[..ci].iter().find(|n| one(n) == Some(xm.as_str())).and_then(|n| movedim(n, -3, -1))?;
    let vi = sole_reader(readers, conv).filter(|&vi| vi > ci)?;
    let view = &g.nodes[vi];
    movedim(view, -1, -3).filter(|&v| v == y)?;
    let ints = |v: i64| Arg::List(vec![Arg::Int(v), Arg::Int(v)]);
    let args =
        [&[Arg::Ref(x.to_owned())], &conv.args[1..9], &[ints(1), ints(0), Arg::Int(1)], &conv.args[9..]].concat();
    Some(Candidate { nodes: vec![ci, vi], args: args.into(), y: one(view)? })
}

/// Each convolution to fuse: its nodes, the add's (and the ReLU's), and the fused node (`op`
/// left for the caller).
fn find(m: &Method, readers: &Readers, weights: &Weights, kind: &Lowered) -> Vec<(Vec<usize>, Vec<usize>, Node)> {
    let g = &m.graph;
    let op_of = |n: &Node| m.ops.get(n.op).map(|o| o.name.as_str());
    // Whether a node may sit between the convolution and its add: it writes nothing (a view
    // among them: a 1×1 int8 convolution's, or another's between).
    let lowered = |name: &str| name == super::conv_pointwise::FUSED || FUSED_OPS.contains(&name) || name == MOVEDIM;
    let writes_nothing = |n: &Node| m.ops.get(n.op).is_some_and(|o| super::dead_code::pure(o) || lowered(&o.name));
    let mut found = Vec::new();
    // Adds already absorbed: of two convolutions added together, the first absorbs the add
    // and the second stays, its output the residual.
    let mut taken = std::collections::HashSet::new();
    let weight_of = weight_inputs(g);
    for ci in 0..g.nodes.len() {
        let Some(Candidate { nodes, args, y }) = candidate(m, readers, (weights, &weight_of), kind, ci) else {
            continue;
        };
        // (A reader before the node is possible: the passes run before validation.)
        let last = *nodes.last().expect("a node");
        let Some(ai) = readers.get(y).and_then(|r| match r.as_slice() {
            [j] if *j != OUTSIDE && *j > last => Some(*j),
            _ => None,
        }) else {
            continue;
        };
        let add = &g.nodes[ai];
        let other = match (op_of(add), add.args.as_slice()) {
            (Some(op), [Arg::Ref(a), other @ Arg::Ref(b)]) if ADDS.contains(&op) && a == y && b != y => other,
            // `other + conv`, out of place only: `add_` would write the other tensor.
            (Some("aten::add.Tensor"), [other @ Arg::Ref(a), Arg::Ref(b)]) if b == y && a != y => other,
            _ => continue,
        };
        if !add.kwargs.is_empty() || !g.nodes[nodes[0] + 1..ai].iter().all(writes_nothing) || !taken.insert(ai) {
            continue;
        }
        let relu = sole_reader(readers, add).filter(|&ri| {
            let r = &g.nodes[ri];
            ri > ai && super::post_ops::matched(op_of(r), r, &["relu"]).is_some()
        });
        // A ReLU later than right after the add would move the add's result past its readers.
        let relu = relu.filter(|&ri| g.nodes[ai + 1..ri].iter().all(writes_nothing));
        let last = relu.unwrap_or(ai);
        let Outputs::One(_) = &g.nodes[last].outputs else { continue };
        let args = kind.fused(&args, other, relu.is_some());
        let node = Node { op: 0, args, kwargs: Default::default(), outputs: g.nodes[last].outputs.clone() };
        found.push((nodes, [Some(ai), relu].into_iter().flatten().collect(), node));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `y = conv(x)` (lowered, no activation), then `nodes`; outputs `outputs`.
    fn doc(nodes: serde_json::Value, outputs: serde_json::Value) -> Document {
        let header = move |h: &mut serde_json::Value| {
            let m = &mut h["methods"]["forward"];
            m["ops"] = json!([
                {"name": super::super::conv_pointwise::FUSED, "schema": null},
                {"name": "aten::add.Tensor", "schema": "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"},
                {"name": "aten::add_.Tensor", "schema": "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)"},
                {"name": "aten::relu_.default", "schema": "aten::relu_(Tensor(a!) self) -> Tensor(a!)"},
                {"name": "aten::neg.default", "schema": "aten::neg(Tensor self) -> Tensor"},
            ]);
            m["graph"]["inputs"] = json!([
                {"name": "pw", "source": {"weight": "w"}},
                {"name": "x", "source": {"user": 0}}, {"name": "o", "source": {"user": 1}}]);
            let mut all = vec![json!({"op": 0, "args": [{"ref": "x"}, {"ref": "pw"}, {"none": null},
                {"list": [{"int": 1}, {"int": 1}]}, {"list": [{"int": 1}, {"int": 1}]},
                {"list": [{"int": 1}, {"int": 1}]}, {"int": 1}, {"str": "none"}, {"list": []}, {"none": null}],
                "outputs": {"one": "y"}})];
            all.extend(nodes.as_array().unwrap().iter().cloned());
            m["graph"]["nodes"] = json!(all);
            m["graph"]["outputs"] = outputs;
        };
        crate::passes::tests::document(header, |_| {})
    }

    fn node(op: usize, args: &[&str], out: &str) -> serde_json::Value {
        let args: Vec<_> = args.iter().map(|a| json!({"ref": a})).collect();
        json!({"op": op, "args": args, "outputs": {"one": out}})
    }

    #[test]
    fn fuses_the_add_and_the_relu_after_it() {
        for (add, args) in [(2, ["y", "o"]), (1, ["y", "o"]), (1, ["o", "y"])] {
            let mut d = doc(json!([node(add, &args, "z"), node(3, &["z"], "r")]), json!([{"ref": "r"}]));
            assert_eq!(apply(&mut d), 1, "{add} {args:?}");
            let m = &d.methods["forward"];
            assert_eq!(m.graph.nodes.len(), 1);
            let n = &m.graph.nodes[0];
            assert_eq!(m.ops[n.op].name, FUSED);
            assert_eq!(
                (&n.args[0], &n.args[1], &n.args[2]),
                (&Arg::Ref("x".into()), &Arg::Ref("o".into()), &Arg::Ref("pw".into()))
            );
            assert_eq!((&n.args[8], &n.args[10]), (&Arg::Str("add".into()), &Arg::Str("relu".into())));
            assert_eq!(n.outputs, Outputs::One("r".into()));
            assert_eq!(apply(&mut d), 0, "idempotent");
        }
        // Without a ReLU after it.
        let mut d = doc(json!([node(1, &["y", "o"], "z")]), json!([{"ref": "z"}]));
        assert_eq!(apply(&mut d), 1);
        let n = &d.methods["forward"].graph.nodes[0];
        assert_eq!((&n.args[10], &n.outputs), (&Arg::None(()), &Outputs::One("z".into())));
    }

    #[test]
    fn of_two_convolutions_added_the_first_absorbs_the_add() {
        let second = json!({"op": 0, "args": [{"ref": "o"}, {"ref": "pw"}, {"none": null},
            {"list": [{"int": 1}, {"int": 1}]}, {"list": [{"int": 1}, {"int": 1}]},
            {"list": [{"int": 1}, {"int": 1}]}, {"int": 1}, {"str": "none"}, {"list": []}, {"none": null}],
            "outputs": {"one": "y2"}});
        let mut d = doc(json!([second, node(1, &["y", "y2"], "z")]), json!([{"ref": "z"}]));
        assert_eq!(apply(&mut d), 1);
        let m = &d.methods["forward"];
        let ops: Vec<_> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(ops, [super::super::conv_pointwise::FUSED, FUSED]);
        assert_eq!(m.graph.nodes[1].args[1], Arg::Ref("y2".into()));
    }

    #[test]
    fn a_pure_node_between_stays_before_the_fused_one() {
        let mut d = doc(json!([node(4, &["o"], "p"), node(1, &["y", "p"], "z")]), json!([{"ref": "z"}]));
        assert_eq!(apply(&mut d), 1);
        let m = &d.methods["forward"];
        assert_eq!(
            m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect::<Vec<_>>(),
            ["aten::neg.default", FUSED]
        );
    }

    /// `y = conv_int8(x, ...)` (a static scale, no activation, `args` arguments), then an add
    /// and a ReLU.
    fn int8_doc(args: usize) -> Document {
        let header = move |h: &mut serde_json::Value| {
            let m = &mut h["methods"]["forward"];
            m["ops"] = json!([
                {"name": CONV, "schema": null},
                {"name": "aten::add_.Tensor", "schema": "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)"},
                {"name": "aten::relu_.default", "schema": "aten::relu_(Tensor(a!) self) -> Tensor(a!)"},
            ]);
            m["graph"]["inputs"] = json!([
                {"name": "w", "source": {"weight": "w"}}, {"name": "ws", "source": {"weight": "ws"}},
                {"name": "wz", "source": {"weight": "wz"}},
                {"name": "x", "source": {"user": 0}}, {"name": "o", "source": {"user": 1}}]);
            let pair = json!({"list": [{"int": 1}, {"int": 1}]});
            let mut conv = vec![
                json!({"ref": "x"}),
                json!({"float": 0.02}),
                json!({"int": 128}),
                json!({"int": 0}),
                json!({"int": 255}),
                json!({"ref": "w"}),
                json!({"ref": "ws"}),
                json!({"ref": "wz"}),
                json!({"none": null}),
                pair.clone(),
                pair,
                json!({"int": 1}),
                json!({"str": "none"}),
                json!({"none": null}),
                json!({"float": 0.05}),
                json!({"int": 0}),
                json!({"int": 0}),
                json!({"int": 255}),
            ];
            conv.truncate(args);
            m["graph"]["nodes"] = json!([
                {"op": 0, "args": conv, "outputs": {"one": "y"}},
                node(1, &["y", "o"], "z"), node(2, &["z"], "r")]);
            m["graph"]["outputs"] = json!([{"ref": "r"}]);
        };
        crate::passes::tests::document(header, |_| {})
    }

    #[test]
    fn an_int8_convolution_takes_the_add_and_the_relu_before_its_output_quantization() {
        let mut d = int8_doc(14);
        assert_eq!(apply(&mut d), 1);
        let m = &d.methods["forward"];
        assert_eq!(m.graph.nodes.len(), 1);
        let n = &m.graph.nodes[0];
        assert_eq!(m.ops[n.op].name, CONV_RESIDUAL);
        assert_eq!(n.args.len(), 15);
        assert_eq!((&n.args[0], &n.args[11]), (&Arg::Ref("x".into()), &Arg::Int(1)));
        assert_eq!(
            (&n.args[12], &n.args[13], &n.args[14]),
            (&Arg::Ref("o".into()), &Arg::Str("relu".into()), &Arg::None(()))
        );
        assert_eq!(n.outputs, Outputs::One("r".into()));
        // One whose result is quantized already (`linear_int8_output`) stays: the add would
        // read its quantized values.
        let mut d = int8_doc(18);
        assert_eq!(apply(&mut d), 0);
    }

    /// `xm = movedim(x, -3, -1); y = linear_int8(xm, ...); ym = movedim(y, -1, -3)`, a 1×1
    /// convolution as `linear_int8` writes it (its weight of `shape`), then `add_(ym, o)` and a
    /// ReLU; `edit` changes the JSON before it is parsed.
    fn pointwise_doc(shape: &[i64], edit: impl FnOnce(&mut serde_json::Value)) -> Document {
        let header = |h: &mut serde_json::Value| {
            let m = &mut h["methods"]["forward"];
            m["ops"] = json!([
                {"name": LINEAR, "schema": null},
                {"name": "aten::add_.Tensor", "schema": "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)"},
                {"name": "aten::relu_.default", "schema": "aten::relu_(Tensor(a!) self) -> Tensor(a!)"},
                {"name": MOVEDIM, "schema": "aten::movedim.int(Tensor(a) self, int source, int destination) -> Tensor(a)"},
            ]);
            m["graph"]["inputs"] = json!([
                {"name": "w", "source": {"weight": "w"}}, {"name": "ws", "source": {"weight": "ws"}},
                {"name": "wz", "source": {"weight": "wz"}},
                {"name": "x", "source": {"user": 0}}, {"name": "o", "source": {"user": 1}}]);
            let r = |v: &str| json!({"ref": v});
            let linear = json!([r("xm"), {"float": 0.02}, {"int": 128}, {"int": 0}, {"int": 255}, r("w"), r("ws"),
                                r("wz"), {"none": null}, {"str": "none"}, {"none": null}]);
            m["graph"]["nodes"] = json!([
                {"op": 3, "args": [r("x"), {"int": -3}, {"int": -1}], "outputs": {"one": "xm"}},
                {"op": 0, "args": linear, "outputs": {"one": "y"}},
                {"op": 3, "args": [r("y"), {"int": -1}, {"int": -3}], "outputs": {"one": "ym"}},
                node(1, &["ym", "o"], "z"), node(2, &["z"], "r")]);
            m["graph"]["outputs"] = json!([{"ref": "r"}]);
            edit(h);
        };
        let t = |shape: &[i64]| json!({"dtype": "float32", "shape": shape, "strides": [], "storage": 0});
        let weights = json!({"w": t(shape), "ws": t(&[8]), "wz": t(&[8])});
        crate::passes::tests::document(header, |d| d["weights"]["tensors"] = weights)
    }

    #[test]
    fn an_int8_1x1_convolution_over_pixels_takes_the_add_as_the_int8_convolution_it_is() {
        let mut d = pointwise_doc(&[8, 16, 1, 1], |_| {});
        assert_eq!(apply(&mut d), 1);
        let m = &d.methods["forward"];
        let ops: Vec<_> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        // The view of the input stays (dead code removes it, unread).
        assert_eq!(ops, [MOVEDIM, CONV_RESIDUAL]);
        let n = &m.graph.nodes[1];
        let pair = |v| Arg::List(vec![Arg::Int(v), Arg::Int(v)]);
        assert_eq!(n.args.len(), 15);
        assert_eq!(
            (&n.args[0], &n.args[5], &n.args[8]),
            (&Arg::Ref("x".into()), &Arg::Ref("w".into()), &Arg::None(()))
        );
        assert_eq!(n.args[9..12], [pair(1), pair(0), Arg::Int(1)]);
        assert_eq!(n.args[12..], [Arg::Ref("o".into()), Arg::Str("relu".into()), Arg::None(())]);
        assert_eq!(n.outputs, Outputs::One("r".into()));
        assert_eq!(apply(&mut d), 0, "idempotent");
    }

    #[test]
    fn an_int8_linear_that_is_no_1x1_convolution_keeps_its_add() {
        type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
        let cases: [(&[i64], Edit); 4] = [
            // A linear's 2-D weight, and a 3×3 one.
            (&[8, 16], Box::new(|_| {})),
            (&[8, 16, 3, 3], Box::new(|_| {})),
            // The view back to the image read elsewhere too.
            (
                &[8, 16, 1, 1],
                Box::new(|h| h["methods"]["forward"]["graph"]["outputs"] = json!([{"ref": "r"}, {"ref": "ym"}])),
            ),
            // Another view of the result.
            (
                &[8, 16, 1, 1],
                Box::new(|h| h["methods"]["forward"]["graph"]["nodes"][2]["args"][2] = json!({"int": -2})),
            ),
        ];
        for (i, (shape, edit)) in cases.into_iter().enumerate() {
            let mut d = pointwise_doc(shape, edit);
            assert_eq!(apply(&mut d), 0, "case {i}");
        }
    }

    #[test]
    fn leaves_near_misses_alone() {
        let cases = [
            // A write between the convolution and its add.
            (json!([node(3, &["x"], "x2"), node(1, &["y", "o"], "z")]), json!([{"ref": "z"}, {"ref": "x2"}])),
            // The convolution's output read elsewhere too.
            (json!([node(1, &["y", "o"], "z")]), json!([{"ref": "z"}, {"ref": "y"}])),
            // `add_` into the other tensor.
            (json!([node(2, &["o", "y"], "z")]), json!([{"ref": "z"}])),
            // Its own output twice.
            (json!([node(1, &["y", "y"], "z")]), json!([{"ref": "z"}])),
        ];
        for (i, (nodes, outputs)) in cases.into_iter().enumerate() {
            let mut d = doc(nodes, outputs);
            assert_eq!(apply(&mut d), 0, "case {i}");
        }
        // An alpha.
        let mut d = doc(json!([node(1, &["y", "o"], "z")]), json!([{"ref": "z"}]));
        d.methods.get_mut("forward").unwrap().graph.nodes[1].kwargs.insert("alpha".into(), Arg::Int(2));
        assert_eq!(apply(&mut d), 0);
    }
}
