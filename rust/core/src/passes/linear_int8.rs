//! Quantized linears onto kwexport's int8 GEMM (`optimize="fast"`, at load, where the runtime
//! has its kernels): what torch's pt2e flows write for a linear, static or dynamic,
//!
//! ```text
//! q  = quantize_per_tensor(x, scale, zp, qmin, qmax, uint8|int8)      (.default or .tensor)
//! xd = dequantize_per_tensor(q, scale, zp, qmin, qmax, same dtype)    (the same overload)
//! wd = dequantize_per_channel(w_int8, w_scale, w_zp, 0, qmin', qmax', int8)
//! y  = linear(xd, wd, bias?)
//! ```
//!
//! becomes one `kwexport::linear_int8(x, scale, zp, qmin, qmax, w_int8, w_scale, w_zp, bias)`
//! (`.tensor` where the scale and zero point are tensors), or, where they are
//! `choose_qparams.tensor(x, qmin, qmax, eps, dtype)` of the same input (dynamic
//! quantization), `kwexport::linear_int8.dynamic(x, qmin, qmax, eps, dtype, w_int8, w_scale,
//! w_zp, bias)`, which chooses them itself. Each ends in the `attr, algorithm` of oneDNN's
//! fused linear (`mkldnn::_linear_pointwise`, whose post-ops without scalars it takes): an
//! activation that alone reads the linear (ReLU, SiLU, GELU, ReLU6, hardswish: [`ACTIVATIONS`])
//! goes into the node, applied as the GEMM stores each result; `"none", None` where none does
//! (yet: a GELU that `gelu_tanh` assembles goes in at the next sweep). Its C path quantizes
//! the input and sums int8 products exactly (`kernels::int8`), and whose Python form (`kwexport._passes.linear_int8`) is the ops it
//! replaced. The quantize and dequantize nodes stay where anything else reads them, and go
//! otherwise: the float32 copy of the weight the dequantize would make never exists.
//!
//! A 1×1 convolution (`conv2d` with stride 1, no padding, dilation 1, one group) of the same
//! quantized input and an int8 `[n, k, 1, 1]` weight is that linear over each pixel's
//! channels: it becomes `movedim(kwexport::linear_int8(movedim(x, -3, -1), ...), -1, -3)`,
//! whose views cost nothing on the channels-last tensors `fast`'s convolutions make (the
//! kernel's rows are then the pixels in memory order) and whose result is channels-last too.
//!
//! It runs before `quantized_ops` writes those ops out as aten arithmetic, so it is
//! registered ahead of every level's passes (`super::registered`). Like `linear_pointwise`, it
//! runs at load only: a file written by `kwexport optimize` keeps torch's ops.

use std::collections::HashMap;

use super::pass::{Ctx, Pass};
use super::readers::{one, readers, sole_reader, weight_inputs};
use super::{Level, Target};
use crate::schema::{Arg, Method, Node, Weights};

/// The fused op, with float and int parameters (a static scale).
pub const FUSED: &str = crate::tables::PASS_OPS[3];
/// The fused op, with tensor parameters.
pub const FUSED_TENSOR: &str = crate::tables::PASS_OPS[4];
/// The fused op, choosing the parameters from its input (dynamic quantization).
pub const FUSED_DYNAMIC: &str = crate::tables::PASS_OPS[5];
/// The int8 convolution (a spatial kernel), with float and int parameters (a static scale).
pub const CONV: &str = crate::tables::PASS_OPS[11];
/// The int8 convolution, choosing the parameters from its input (dynamic quantization).
pub const CONV_DYNAMIC: &str = crate::tables::PASS_OPS[12];

/// The int8 convolution with a static scale adding a residual before its activation
/// (`super::conv_residual` makes it).
pub const CONV_RESIDUAL: &str = crate::tables::PASS_OPS[15];

/// The fused ops whose argument list ends in `attr, algorithm` (then the output's
/// quantization, `super::linear_int8_output`).
pub const FUSED_OPS: [&str; 6] = [FUSED, FUSED_TENSOR, FUSED_DYNAMIC, CONV, CONV_DYNAMIC, CONV_RESIDUAL];

/// Below this many input channels per group (a network's stem: an image's 3), a convolution
/// goes to the int8 convolution only where its patch (channels times taps) holds at least
/// [`MIN_STEM_PATCH`] values. The kernel gathers such a convolution's patches into dense rows:
/// ResNet-18's 7×7 stem at 224 pixels (147 values) took 626 µs on it against oneDNN's 1095,
/// but GhostNet's 3×3 (27 values, 16 output channels) 192 against 100 for kwexport's float32
/// kernel for few channels.
const MIN_CONV_IN_CHANNELS: i64 = 8;
const MIN_STEM_PATCH: i64 = 64;

/// The pass (`fast`, on a loader's CPU with the runtime's kernels).
pub struct LinearInt8;

impl Pass for LinearInt8 {
    fn name(&self) -> &'static str {
        "linear_int8"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.gemm
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, _, weights| apply(m, weights))
    }
}

/// Fuses each quantized linear of the method's top-level graph; returns how many.
pub fn apply(m: &mut Method, weights: &Weights) -> usize {
    let found = find(m, weights);
    let mut replaced: Vec<usize> = Vec::new();
    for f in &found {
        let op = super::op_index(&mut m.ops, f.op);
        m.graph.nodes[f.linear] = Node { op, ..f.node.clone() };
        replaced.extend(&f.replaced);
    }
    // The replaced nodes nothing reads any more, the dequantizes first (they read the rest).
    loop {
        let read = readers(&m.graph);
        let mut removed = vec![false; m.graph.nodes.len()];
        for &i in &replaced {
            removed[i] = m.graph.nodes[i].outputs.names().all(|o| !read.contains_key(o));
        }
        if !removed.contains(&true) {
            break;
        }
        // Indices shift as nodes go: keep those of the nodes that stay.
        let new_index: Vec<usize> = removed
            .iter()
            .scan(0, |next, &r| {
                let at = *next;
                *next += usize::from(!r);
                Some(at)
            })
            .collect();
        replaced = replaced.iter().filter(|&&i| !removed[i]).map(|&i| new_index[i]).collect();
        super::remove_nodes(&mut m.graph.nodes, &removed);
    }
    let absorbed = absorb_activations(m);
    over_pixels(m, weights);
    found.len() + absorbed
}

/// Wraps each fused node of a 1×1 convolution's (its weight 4-D) that still reads the
/// convolution's input in the views that make its channels the last dimension:
/// `movedim(x, -3, -1)` before, `movedim(·, -1, -3)` after, binding the node's outputs.
fn over_pixels(m: &mut Method, weights: &Weights) {
    let weight_of = weight_inputs(&m.graph);
    let fused = [FUSED, FUSED_TENSOR, FUSED_DYNAMIC].map(|f| m.ops.iter().position(|o| o.name == f));
    let is_conv = |n: &Node| {
        let w = match n.args.get(5) {
            Some(Arg::Ref(w)) => weight_of.get(w.as_str()).and_then(|w| weights.tensors.get(*w)),
            _ => None,
        };
        fused.contains(&Some(n.op)) && w.is_some_and(|t| t.shape.len() == 4)
    };
    // Those wrapped already (an earlier sweep's) read the view.
    let moved: std::collections::HashSet<&str> = (m.graph.nodes.iter())
        .filter(|n| m.ops.get(n.op).is_some_and(|o| o.name == "aten::movedim.int"))
        .filter_map(one)
        .collect();
    let wrapped = |n: &Node| matches!(n.args.first(), Some(Arg::Ref(x)) if moved.contains(x.as_str()));
    let at: Vec<(usize, Node)> = (m.graph.nodes.iter().enumerate())
        .filter(|(_, n)| is_conv(n) && !wrapped(n))
        .map(|(i, n)| (i, n.clone()))
        .collect();
    let mut names = super::emit::value_names(&m.graph);
    let mut views = std::collections::HashMap::new();
    for (i, mut node) in at {
        let base = format!("{}_pixels", node.outputs.names().next().unwrap_or("conv"));
        let op = m.ops[node.op].name.clone();
        let mut emit = super::emit::Emit::new(&mut m.ops, &mut names, base);
        node.args[0] = emit.call("aten::movedim.int", vec![node.args[0].clone(), Arg::Int(-3), Arg::Int(-1)], &[]);
        let outputs = std::mem::replace(&mut node.outputs, crate::schema::Outputs::None(()));
        let y = emit.call(&op, node.args, &[]);
        emit.bind("aten::movedim.int", vec![y, Arg::Int(-1), Arg::Int(-3)], &[], outputs);
        views.insert(i, emit.nodes);
    }
    super::splice_nodes(&mut m.graph.nodes, views, &[]);
}

/// Takes into each fused node without an activation the activation that alone reads it
/// (ReLU, SiLU, GELU, as `linear_pointwise` takes them), which then runs as the GEMM's
/// epilogue: the one after the linear in the file, or one a later pass made (`gelu_tanh`'s
/// GELU, in a later sweep). The fused node takes the activation's place. Returns how many.
fn absorb_activations(m: &mut Method) -> usize {
    let read = readers(&m.graph);
    let name = |n: &Node| m.ops.get(n.op).map_or("", |o| o.name.as_str());
    let g = &m.graph;
    // Each fused node to absorb an activation: its index, the activation's, and the result.
    let absorbed: Vec<(usize, usize, Node)> = (g.nodes.iter().enumerate())
        .filter_map(|(i, node)| {
            let len = node.args.len();
            if !FUSED_OPS.contains(&name(node)) || len < 2 || node.args[len - 2] != Arg::Str("none".into()) {
                return None;
            }
            let ai = sole_reader(&read, node)?;
            let a = &g.nodes[ai];
            // ReLU6's bounds are implied by its name (`hardtanh` with other bounds stays).
            let super::post_ops::Matched { attr, algorithm, .. } =
                super::post_ops::matched(Some(name(a)), a, ACTIVATIONS)?;
            let mut node = node.clone();
            node.args[len - 1] = algorithm;
            node.args[len - 2] = Arg::Str(attr.to_owned());
            node.outputs = a.outputs.clone();
            Some((i, ai, node))
        })
        .collect();
    let (count, mut removed) = (absorbed.len(), vec![false; m.graph.nodes.len()]);
    for (i, ai, node) in absorbed {
        // At the activation's place: everything the linear read is defined by then.
        m.graph.nodes[ai] = node;
        removed[i] = true;
    }
    super::remove_nodes(&mut m.graph.nodes, &removed);
    count
}

/// The activations an int8 linear applies as it stores its results: `linear_pointwise`'s,
/// and the ones MobileNets put after their 1×1 convolutions (ReLU6 as `hardtanh` with the
/// bounds 0 and 6, hardswish), which `epilogue_of` maps to the same kernels' epilogues.
const ACTIVATIONS: &[&str] = &["relu", "swish", "gelu", "hardtanh", "hardswish"];

/// A quantized linear found: its index, the fused node (`op` left for the caller) and the
/// overload it takes, and the nodes it stands for (quantize, dequantizes, `choose_qparams`).
struct Found {
    linear: usize,
    node: Node,
    op: &'static str,
    replaced: Vec<usize>,
}

/// Each quantized linear of the method's top-level graph.
fn find(m: &Method, weights: &Weights) -> Vec<Found> {
    let g = &m.graph;
    let op_of = |n: &Node| m.ops.get(n.op).map_or("", |o| o.name.as_str());
    let maker: HashMap<&str, usize> = g.nodes.iter().enumerate().filter_map(|(i, n)| Some((one(n)?, i))).collect();
    // The node of several outputs that makes each value, and which output it is.
    let many: HashMap<&str, (usize, usize)> = (g.nodes.iter().enumerate())
        .filter_map(|(i, n)| match &n.outputs {
            crate::schema::Outputs::Many(outs) => {
                Some(outs.iter().enumerate().filter_map(move |(j, o)| Some((o.as_deref()?, (i, j)))))
            }
            _ => None,
        })
        .flatten()
        .collect();
    // The node of `op` that makes value `a`, and its index.
    let made_by = |a: Option<&Arg>, op: &str| match a {
        Some(Arg::Ref(v)) => maker.get(v.as_str()).map(|&i| (&g.nodes[i], i)).filter(|(n, _)| op_of(n) == op),
        _ => None,
    };
    let weight_of = weight_inputs(g);
    let tensor = |a: &Arg, dtypes: &[&str], rank: usize| match a {
        Arg::Ref(v) => weight_of.get(v.as_str()).and_then(|w| weights.tensors.get(*w)).is_some_and(|t| {
            dtypes.contains(&t.dtype.as_str()) && !t.mutable && t.shape.len() == rank && !t.shape.contains(&0)
        }),
        _ => false,
    };
    let mut found = Vec::new();
    for (i, linear) in g.nodes.iter().enumerate() {
        let conv = op_of(linear) == "aten::conv2d.default";
        let is_linear = op_of(linear) == "aten::linear.default";
        if !(is_linear || conv) || !linear.kwargs.is_empty() {
            continue;
        }
        if is_linear && linear.args.len() > 3 {
            continue;
        }
        let bias = match linear.args.get(2) {
            None | Some(Arg::None(())) => Arg::None(()),
            Some(b @ Arg::Ref(_)) => b.clone(),
            Some(_) => continue,
        };
        // The input's quantize → dequantize, with the same parameters and an 8-bit dtype.
        let ((dq, dqi), overload) =
            match made_by(linear.args.first(), "quantized_decomposed::dequantize_per_tensor.default") {
                Some(dq) => (dq, "default"),
                None => match made_by(linear.args.first(), "quantized_decomposed::dequantize_per_tensor.tensor") {
                    Some(dq) => (dq, "tensor"),
                    None => continue,
                },
            };
        let quantize = format!("quantized_decomposed::quantize_per_tensor.{overload}");
        let Some((q, qi)) = made_by(dq.args.first(), &quantize) else { continue };
        let [_, scale, zp, Arg::Int(qmin), Arg::Int(qmax), Arg::Dtype(dtype)] = &q.args[..] else { continue };
        let params_ok = match overload {
            "default" => matches!((scale, zp), (Arg::Float(_), Arg::Int(_))),
            _ => matches!((scale, zp), (Arg::Ref(_), Arg::Ref(_))),
        };
        if !(is_pair(q, dq) && params_ok) {
            continue;
        }
        // The weight's per-channel dequantize along its output channels.
        let Some((wd, wdi)) = made_by(linear.args.get(1), "quantized_decomposed::dequantize_per_channel.default")
        else {
            continue;
        };
        let [w, w_scale, w_zp, Arg::Int(0), _, _, Arg::Dtype(w_dtype)] = &wd.args[..] else { continue };
        // A linear's `[n, k]` weight, or a 1×1 convolution's `[n, k, 1, 1]`; any other
        // convolution without dilation is the int8 convolution, of its stride, padding and
        // groups (`spatial`).
        let w_shape = match w {
            Arg::Ref(v) => weight_of.get(v.as_str()).and_then(|w| weights.tensors.get(*w)).map(|t| t.shape.as_slice()),
            _ => None,
        };
        let one_by_one = w_shape.is_some_and(|s| s.len() == 4 && s[2..] == [1, 1]);
        // Its weight's input channels per group, output channels and patch (input channels
        // per group times taps).
        let channels = w_shape.and_then(|s| Some((*s.get(1)?, *s.first()?, s[1..].iter().product::<i64>())));
        let pointwise = one_by_one && is_pointwise_conv(linear);
        let geometry = if conv && !pointwise { conv_geometry(linear) } else { None };
        // Groups start on a word of 4 channels (a depthwise convolution's stay float32), and
        // divide the output channels.
        let spatial = geometry.filter(|[_, _, groups]| match (channels, groups) {
            (Some((per_group, _, patch)), _) if per_group < MIN_CONV_IN_CHANNELS && patch < MIN_STEM_PATCH => false,
            (Some((per_group, n, _)), Arg::Int(g)) => *g == 1 || (per_group % 4 == 0 && n % g == 0),
            _ => false,
        });
        let matrix = match is_linear {
            true => tensor(w, &["int8"], 2),
            false => tensor(w, &["int8"], 4) && (pointwise || spatial.is_some()),
        };
        let weight_ok =
            w_dtype == "int8" && matrix && tensor(w_scale, &["float32"], 1) && tensor(w_zp, &["int64", "int32"], 1);
        if !(weight_ok && float32_out(wd)) {
            continue;
        }
        let weight = [w.clone(), w_scale.clone(), w_zp.clone(), bias];
        let x = &q.args[0];
        let mut replaced = vec![dqi, qi, wdi];
        // Dynamic quantization: the scale and zero point chosen from this input, for this range.
        let chosen = match (scale, zp) {
            (Arg::Ref(s), Arg::Ref(z)) => match (many.get(s.as_str()), many.get(z.as_str())) {
                (Some(&(c, 0)), Some(&(c2, 1))) if c == c2 => Some(c),
                _ => None,
            },
            _ => None,
        };
        let dynamic = chosen.and_then(|c| {
            let n = &g.nodes[c];
            let same = op_of(n) == "quantized_decomposed::choose_qparams.tensor" && n.kwargs.is_empty();
            match &n.args[..] {
                [cx, Arg::Int(lo), Arg::Int(hi), eps @ Arg::Float(_), d @ Arg::Dtype(_)]
                    if same && cx == x && (lo, hi, d) == (qmin, qmax, &Arg::Dtype(dtype.clone())) =>
                {
                    Some((c, eps.clone(), d.clone()))
                }
                _ => None,
            }
        });
        let (op, args) = match (overload, dynamic, spatial) {
            // The int8 convolution takes a static scale or one it chooses.
            ("default", _, Some(geometry)) => {
                let params = vec![x.clone(), scale.clone(), zp.clone(), Arg::Int(*qmin), Arg::Int(*qmax)];
                (CONV, [params, weight.to_vec(), geometry.to_vec()].concat())
            }
            ("tensor", Some((c, eps, d)), Some(geometry)) => {
                replaced.push(c);
                let params = vec![x.clone(), Arg::Int(*qmin), Arg::Int(*qmax), eps, d];
                (CONV_DYNAMIC, [params, weight.to_vec(), geometry.to_vec()].concat())
            }
            (_, _, Some(_)) => continue,
            ("tensor", Some((c, eps, d)), None) => {
                replaced.push(c);
                (FUSED_DYNAMIC, [vec![x.clone(), Arg::Int(*qmin), Arg::Int(*qmax), eps, d], weight.to_vec()].concat())
            }
            _ => {
                let params = vec![x.clone(), scale.clone(), zp.clone(), Arg::Int(*qmin), Arg::Int(*qmax)];
                (if overload == "tensor" { FUSED_TENSOR } else { FUSED }, [params, weight.to_vec()].concat())
            }
        };
        // No activation yet: `absorb_activations` takes the one after it, if any.
        let args = [args, vec![Arg::Str("none".into()), Arg::None(())]].concat();
        let node = Node { op: 0, args, kwargs: Default::default(), outputs: linear.outputs.clone() };
        found.push(Found { linear: i, node, op, replaced });
    }
    found
}

/// A `conv2d` node's stride and padding as two-element literal lists, and its groups, where
/// its dilation is 1 (as literals or left to their defaults): the int8 convolution's geometry.
fn conv_geometry(n: &Node) -> Option<[Arg; 3]> {
    let pair = |i: usize, default: i64| -> Option<Arg> {
        let ints = match n.args.get(i) {
            None => vec![default],
            Some(Arg::List(items)) => {
                items.iter().map(|a| if let Arg::Int(v) = a { Some(*v) } else { None }).collect::<Option<Vec<_>>>()?
            }
            Some(_) => return None,
        };
        let pair = match ints[..] {
            [v] => [v, v],
            [a, b] => [a, b],
            _ => return None,
        };
        Some(Arg::List(pair.map(Arg::Int).to_vec()))
    };
    let ones = pair(5, 1)? == Arg::List(vec![Arg::Int(1), Arg::Int(1)]);
    let groups = match n.args.get(6) {
        None => 1,
        Some(Arg::Int(g)) if *g > 0 => *g,
        Some(_) => return None,
    };
    (n.args.len() <= 7 && ones).then_some([pair(3, 1)?, pair(4, 0)?, Arg::Int(groups)])
}

/// Whether a `conv2d` node is a 1×1 convolution's product over pixels: stride 1, no padding,
/// dilation 1 and one group, as literals (or left to their defaults).
fn is_pointwise_conv(n: &Node) -> bool {
    let all = |i: usize, v: i64| match n.args.get(i) {
        None => true,
        Some(Arg::List(items)) => !items.is_empty() && items.iter().all(|a| *a == Arg::Int(v)),
        Some(_) => false,
    };
    let groups = matches!(n.args.get(6), None | Some(Arg::Int(1)));
    n.args.len() <= 7 && all(3, 1) && all(4, 0) && all(5, 1) && groups
}

/// Whether `dq` dequantizes `q`'s result with `q`'s own parameters, to float32, and `q`
/// quantizes to an 8-bit dtype within its range (the pair pt2e writes around an op).
pub(super) fn is_pair(q: &Node, dq: &Node) -> bool {
    let [_, _, _, Arg::Int(qmin), Arg::Int(qmax), Arg::Dtype(dtype)] = &q.args[..] else { return false };
    let in_range = match dtype.as_str() {
        "uint8" => 0 <= *qmin && *qmax <= 255,
        "int8" => -128 <= *qmin && *qmax <= 127,
        _ => false,
    };
    in_range && q.kwargs.is_empty() && dq.args.get(1..) == q.args.get(1..) && float32_out(dq)
}

/// Whether a dequantize returns float32 (its `out_dtype` not given, `None` or float32).
pub(super) fn float32_out(dq: &Node) -> bool {
    dq.kwargs
        .iter()
        .all(|(k, v)| k == "out_dtype" && (matches!(v, Arg::None(())) || matches!(v, Arg::Dtype(d) if d == "float32")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The scale and zero point of a static (`tensor` false) or dynamic quantization.
    fn params(tensor: bool) -> (serde_json::Value, serde_json::Value) {
        match tensor {
            true => (json!({"ref": "s"}), json!({"ref": "z"})),
            false => (json!({"float": 0.02}), json!({"int": 131})),
        }
    }

    /// A quantized linear as pt2e writes it, static or dynamic (`tensor`).
    fn method(tensor: bool) -> Method {
        let r = |v: &str| json!({"ref": v});
        let overload = if tensor { "tensor" } else { "default" };
        let (scale, zp) = params(tensor);
        let q = json!([r("x"), scale, zp, {"int": 0}, {"int": 255}, {"dtype": "uint8"}]);
        let mut dq = q.clone();
        dq[0] = r("q");
        let weight = |n: &str| json!({"name": n, "source": {"weight": n}});
        serde_json::from_value(json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": "quantized_decomposed::dequantize_per_channel.default", "schema": "s"},
                    {"name": format!("quantized_decomposed::quantize_per_tensor.{overload}"), "schema": "s"},
                    {"name": format!("quantized_decomposed::dequantize_per_tensor.{overload}"), "schema": "s"},
                    {"name": "aten::linear.default", "schema": "s"}],
            "graph": {
                "inputs": [{"name": "x", "source": {"user": 0}}, {"name": "s", "source": {"user": 1}},
                           {"name": "z", "source": {"user": 2}},
                           weight("w"), weight("ws"), weight("wz"), weight("b")],
                "nodes": [
                    {"op": 0, "args": [r("w"), r("ws"), r("wz"), {"int": 0}, {"int": -128}, {"int": 127},
                                       {"dtype": "int8"}], "outputs": {"one": "wd"}},
                    {"op": 1, "args": q, "outputs": {"one": "q"}},
                    {"op": 2, "args": dq, "outputs": {"one": "xd"}},
                    {"op": 3, "args": [r("xd"), r("wd"), r("b")], "outputs": {"one": "y"}}],
                "outputs": [r("y")]}
        }))
        .unwrap()
    }

    fn weights() -> Weights {
        let t = |dtype: &str, shape: &[i64]| json!({"dtype": dtype, "shape": shape, "strides": [], "storage": 0});
        serde_json::from_value(json!({
            "storages": [],
            "tensors": {"w": t("int8", &[8, 16]), "ws": t("float32", &[8]), "wz": t("int64", &[8]),
                        "b": t("float32", &[8])}
        }))
        .unwrap()
    }

    #[test]
    fn fuses_static_and_dynamic_quantized_linears() {
        for (tensor, fused) in [(false, FUSED), (true, FUSED_TENSOR)] {
            let mut m = method(tensor);
            assert_eq!(apply(&mut m, &weights()), 1);
            let y = &m.graph.nodes[0];
            assert_eq!(m.ops[y.op].name, fused);
            let (scale, zp) = params(tensor);
            let r = |v: &str| json!({"ref": v});
            let want = json!([r("x"), scale, zp, {"int": 0}, {"int": 255}, r("w"), r("ws"), r("wz"), r("b"),
                              {"str": "none"}, {"none": null}]);
            assert_eq!(serde_json::to_value(&y.args).unwrap(), want);
            // The quantize and dequantize nodes, now unread, went.
            assert_eq!(m.graph.nodes.len(), 1);
            // Nothing left to fuse: the next sweep changes nothing.
            assert_eq!(apply(&mut m, &weights()), 0);
        }
    }

    /// Dynamic quantization: the scale and zero point `choose_qparams` picks from the input.
    fn dynamic(eps_input: &str, qmax: i64) -> Method {
        let mut m = serde_json::to_value(method(true)).unwrap();
        m["ops"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "quantized_decomposed::choose_qparams.tensor", "schema": "s"}));
        let choose = json!({"op": 4, "args": [{"ref": eps_input}, {"int": 0}, {"int": qmax}, {"float": 1e-5},
                                              {"dtype": "uint8"}], "outputs": {"many": ["s", "z"]}});
        m["graph"]["nodes"].as_array_mut().unwrap().insert(0, choose);
        m["graph"]["inputs"].as_array_mut().unwrap().retain(|i| !["s", "z"].contains(&i["name"].as_str().unwrap()));
        serde_json::from_value(m).unwrap()
    }

    /// A dynamically quantized 3×3 convolution becomes the int8 convolution that chooses its
    /// parameters; the `choose_qparams`, quantize and dequantizes go.
    #[test]
    fn a_dynamic_convolution_chooses_its_parameters_itself() {
        let mut m = serde_json::to_value(dynamic("x", 255)).unwrap();
        m["ops"][3] = json!({"name": "aten::conv2d.default", "schema": "s"});
        let mut m: Method = serde_json::from_value(m).unwrap();
        let mut w = weights();
        w.tensors.get_mut("w").unwrap().shape = vec![8, 16, 3, 3];
        assert_eq!(apply(&mut m, &w), 1);
        let [fused] = &m.graph.nodes[..] else { panic!("{:?}", m.graph.nodes) };
        assert_eq!(m.ops[fused.op].name, CONV_DYNAMIC);
        let ints = |v: &[i64]| Arg::List(v.iter().map(|&i| Arg::Int(i)).collect());
        assert_eq!(
            fused.args[..5],
            [
                Arg::Ref("x".into()),
                Arg::Int(0),
                Arg::Int(255),
                Arg::Float(crate::schema::Float(1e-5)),
                Arg::Dtype("uint8".into())
            ]
        );
        assert_eq!(
            fused.args[9..],
            [ints(&[1, 1]), ints(&[0, 0]), Arg::Int(1), Arg::Str("none".into()), Arg::None(())]
        );
    }

    #[test]
    fn a_dynamic_linear_chooses_its_parameters_itself() {
        let mut m = dynamic("x", 255);
        assert_eq!(apply(&mut m, &weights()), 1);
        assert_eq!(m.graph.nodes.len(), 1, "choose_qparams went with the rest");
        let y = &m.graph.nodes[0];
        assert_eq!(m.ops[y.op].name, FUSED_DYNAMIC);
        let r = |v: &str| json!({"ref": v});
        let want = json!([r("x"), {"int": 0}, {"int": 255}, {"float": 1e-5}, {"dtype": "uint8"}, r("w"), r("ws"),
                          r("wz"), r("b"), {"str": "none"}, {"none": null}]);
        assert_eq!(serde_json::to_value(&y.args).unwrap(), want);
        // Parameters chosen for another range, or from another value, are the `.tensor` form's.
        for mut m in [dynamic("x", 127), dynamic("b", 255)] {
            assert_eq!(apply(&mut m, &weights()), 1);
            let y = m.graph.nodes.iter().find(|n| n.outputs.names().any(|o| o == "y")).unwrap();
            assert_eq!(m.ops[y.op].name, FUSED_TENSOR);
        }
    }

    /// The static method's linear as a `conv2d(xd, wd, b, stride, padding, dilation, groups)`
    /// of a `[8, 16, kh, kw]` weight, then a ReLU.
    fn conv(kernel: i64, geometry: serde_json::Value) -> (Method, Weights) {
        let mut m = serde_json::to_value(method(false)).unwrap();
        m["ops"][3] = json!({"name": "aten::conv2d.default", "schema": "s"});
        m["ops"].as_array_mut().unwrap().push(json!({"name": "aten::relu.default", "schema": "s"}));
        let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
        nodes[3]["args"].as_array_mut().unwrap().extend(geometry.as_array().unwrap().iter().cloned());
        nodes.push(json!({"op": 4, "args": [{"ref": "y"}], "outputs": {"one": "a"}}));
        m["graph"]["outputs"] = json!([{"ref": "a"}]);
        let mut w = weights();
        w.tensors.get_mut("w").unwrap().shape = vec![8, 16, kernel, kernel];
        (serde_json::from_value(m).unwrap(), w)
    }

    #[test]
    fn a_1x1_convolution_is_the_linear_over_each_pixels_channels() {
        let pointwise = json!([{"list": [{"int": 1}, {"int": 1}]}, {"list": [{"int": 0}, {"int": 0}]},
                               {"list": [{"int": 1}, {"int": 1}]}, {"int": 1}]);
        let (mut m, w) = conv(1, pointwise.clone());
        // The fusion and the ReLU it took.
        assert_eq!(apply(&mut m, &w), 2);
        let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(ops, ["aten::movedim.int", FUSED, "aten::movedim.int"]);
        let [to_pixels, fused, back] = &m.graph.nodes[..] else { unreachable!() };
        let pixels = crate::schema::Outputs::One("a_pixels0".into());
        assert_eq!(
            (&to_pixels.args[..], &to_pixels.outputs),
            (&[Arg::Ref("x".into()), Arg::Int(-3), Arg::Int(-1)][..], &pixels)
        );
        assert_eq!(fused.args[0], Arg::Ref("a_pixels0".into()));
        assert_eq!(fused.args[9], Arg::Str("relu".into()));
        assert_eq!(back.args, [Arg::Ref("a_pixels1".into()), Arg::Int(-1), Arg::Int(-3)]);
        assert_eq!(back.outputs, crate::schema::Outputs::One("a".into()));
        assert_eq!(apply(&mut m, &w), 0, "nothing is found twice");
        assert_eq!(m.graph.nodes.len(), 3, "nor wrapped twice");
    }

    /// A convolution with a spatial kernel, a stride or padding becomes the int8 convolution,
    /// its stride and padding as pairs, its ReLU taken; so does one of groups of 8 channels;
    /// groups of 2 channels (not whole words), a dilation or a dynamic quantization leave it
    /// alone.
    #[test]
    fn a_spatial_convolution_becomes_the_int8_convolution() {
        let ints = |v: &[i64]| Arg::List(v.iter().map(|&i| Arg::Int(i)).collect());
        let strided = json!([{"list": [{"int": 2}]}]);
        let padded = json!([{"list": [{"int": 1}, {"int": 2}]}, {"list": [{"int": 1}, {"int": 0}]}]);
        for (kernel, geometry, stride, padding) in
            [(3, json!([]), [1, 1], [0, 0]), (1, strided, [2, 2], [0, 0]), (3, padded, [1, 2], [1, 0])]
        {
            let (mut m, w) = conv(kernel, geometry.clone());
            assert_eq!(apply(&mut m, &w), 2, "{geometry}");
            let [fused] = &m.graph.nodes[..] else { panic!("{geometry}: {:?}", m.graph.nodes) };
            assert_eq!(m.ops[fused.op].name, CONV);
            let r = |v: &str| Arg::Ref(v.into());
            let want = [
                r("x"),
                Arg::Float(crate::schema::Float(0.02)),
                Arg::Int(131),
                Arg::Int(0),
                Arg::Int(255),
                r("w"),
                r("ws"),
                r("wz"),
                r("b"),
                ints(&stride),
                ints(&padding),
                Arg::Int(1),
                Arg::Str("relu".into()),
                Arg::None(()),
            ];
            assert_eq!(fused.args, want, "{geometry}");
            assert_eq!(fused.outputs, crate::schema::Outputs::One("a".into()));
        }
        let grouped = json!([{"list": [{"int": 1}]}, {"list": [{"int": 0}]}, {"list": [{"int": 1}]}, {"int": 2}]);
        let (mut m, w) = conv(3, grouped.clone());
        assert_eq!(apply(&mut m, &w), 2, "groups of the weight's 16 channels");
        assert_eq!(m.graph.nodes[0].args[11], Arg::Int(2));
        let mut narrow = conv(3, grouped.clone());
        narrow.1.tensors.get_mut("w").unwrap().shape = vec![8, 2, 3, 3];
        let dilated = json!([{"list": [{"int": 1}]}, {"list": [{"int": 0}]}, {"list": [{"int": 2}]}]);
        for (mut m, w) in [narrow, conv(3, dilated)] {
            assert_eq!(apply(&mut m, &w), 0);
        }
        // Tensor parameters not chosen from the input.
        let mut m = serde_json::to_value(method(true)).unwrap();
        m["ops"][3] = json!({"name": "aten::conv2d.default", "schema": "s"});
        let mut w = weights();
        w.tensors.get_mut("w").unwrap().shape = vec![8, 16, 3, 3];
        let mut m: Method = serde_json::from_value(m).unwrap();
        assert_eq!(apply(&mut m, &w), 0, "tensor parameters");
    }

    /// The static method with `activation(y, *args)` after the linear, the graph's output.
    fn with_activation(activation: &str, args: serde_json::Value) -> Method {
        let mut m = serde_json::to_value(method(false)).unwrap();
        m["ops"].as_array_mut().unwrap().push(json!({"name": activation, "schema": "s"}));
        let args = [vec![json!({"ref": "y"})], args.as_array().unwrap().clone()].concat();
        m["graph"]["nodes"].as_array_mut().unwrap().push(json!({"op": 4, "args": args, "outputs": {"one": "a"}}));
        m["graph"]["outputs"] = json!([{"ref": "a"}]);
        serde_json::from_value(m).unwrap()
    }

    #[test]
    fn fuses_the_activation_that_alone_reads_the_linear() {
        for (op, args, attr, algorithm) in [
            ("aten::gelu.default", json!([]), "gelu", json!({"str": "none"})),
            ("aten::gelu.default", json!([{"str": "tanh"}]), "gelu", json!({"str": "tanh"})),
            ("aten::relu.default", json!([]), "relu", json!(null)),
            ("aten::silu_.default", json!([]), "swish", json!(null)),
            ("aten::hardtanh_.default", json!([{"float": 0.0}, {"float": 6.0}]), "hardtanh", json!(null)),
            ("aten::relu6.default", json!([]), "hardtanh", json!(null)),
            ("aten::hardswish.default", json!([]), "hardswish", json!(null)),
        ] {
            let mut m = with_activation(op, args);
            assert_eq!(apply(&mut m, &weights()), 2, "the linear, then its activation");
            assert_eq!(m.graph.nodes.len(), 1, "{op}: the linear and the activation are one node");
            let y = &m.graph.nodes[0];
            assert_eq!(m.ops[y.op].name, FUSED);
            assert_eq!(y.outputs.names().collect::<Vec<_>>(), ["a"]);
            let tail = serde_json::to_value(&y.args[9..]).unwrap();
            let algorithm = if algorithm.is_null() { json!({"none": null}) } else { algorithm };
            assert_eq!(tail, json!([{"str": attr}, algorithm]), "{op}");
        }
        // Another reader of the linear's output, or an activation the GEMM doesn't apply
        // here: the linear fuses alone.
        let mut m = with_activation("aten::gelu.default", json!([]));
        m.graph.outputs.push(Arg::Ref("y".into()));
        let mut sigmoid = with_activation("aten::sigmoid.default", json!([]));
        let mut clamp = with_activation("aten::hardtanh.default", json!([{"float": -1.0}, {"float": 1.0}]));
        for m in [&mut m, &mut sigmoid, &mut clamp] {
            assert_eq!(apply(m, &weights()), 1);
            assert_eq!(m.graph.nodes.len(), 2);
            assert_eq!(m.graph.nodes[0].args[9], Arg::Str("none".into()));
        }
    }

    #[test]
    fn absorbs_an_activation_a_later_pass_makes() {
        // A fused node of an earlier sweep, then the GELU `gelu_tanh` assembled after it.
        let mut m = with_activation("aten::gelu.default", json!([{"str": "tanh"}]));
        m.graph.outputs = vec![Arg::Ref("y".into())];
        assert_eq!(apply(&mut m, &weights()), 1);
        assert_eq!(m.graph.nodes.len(), 2, "the GELU was no reader then");
        m.graph.outputs = vec![Arg::Ref("a".into())];
        assert_eq!(apply(&mut m, &weights()), 1);
        assert_eq!(m.graph.nodes.len(), 1);
        let tail = serde_json::to_value(&m.graph.nodes[0].args[9..]).unwrap();
        assert_eq!(tail, json!([{"str": "gelu"}, {"str": "tanh"}]));
        assert_eq!(apply(&mut m, &weights()), 0, "nothing left to take");
    }

    #[test]
    fn leaves_near_misses_alone() {
        type Mutate = fn(&mut Method, &mut Weights);
        let cases: [(&str, Mutate); 6] = [
            ("the dequantize's parameters differ", |m, _| m.graph.nodes[2].args[2] = Arg::Int(130)),
            ("a 16-bit range", |m, _| m.graph.nodes[1].args[4] = Arg::Int(65535)),
            ("a float32 weight", |_, w| w.tensors.get_mut("w").unwrap().dtype = "float32".into()),
            ("a state weight", |_, w| w.tensors.get_mut("w").unwrap().mutable = true),
            ("per channel along the inputs", |m, _| m.graph.nodes[0].args[3] = Arg::Int(1)),
            ("a float64 dequantize", |m, _| {
                m.graph.nodes[2].kwargs.insert("out_dtype".into(), Arg::Dtype("float64".into()));
            }),
        ];
        for (why, mutate) in cases {
            let (mut m, mut w) = (method(false), weights());
            mutate(&mut m, &mut w);
            assert_eq!(apply(&mut m, &w), 0, "{why}");
        }
    }
}
