//! torch's quantize and dequantize ops (`quantized_decomposed::*`, what pt2e's `convert_pt2e`
//! writes, in torch or torchao) as the aten arithmetic torch defines them with
//! (`torch/ao/quantization/fx/_decomposed.py`), at every level: the same ops in the same
//! order, so the same bits, run through the C ABI instead of a Python function per node (which
//! made a quantized MLP 20–40× slower than its float32 self). A node this pass can't write
//! out (a per-channel op on a value whose rank the file doesn't say) stays, and runs as
//! torch's op, whose library the runtime imports (`torch.ao.quantization.fx._decomposed`).
//!
//! - `dequantize_per_tensor(x, scale, zp, ...)`: `(x.to(out_dtype) - zp) * scale`
//! - `quantize_per_tensor(x, scale, zp, qmin, qmax, dtype)`:
//!   `clamp(round(x * (1.0 / scale)) + zp, qmin, qmax).to(dtype)`
//! - their `.tensor` forms, with `scale` and `zp` one-element tensors (torch reads them with
//!   `.item()`: `1.0 / scale` in double, then cast as a scalar operand is)
//! - `dequantize_per_channel(w, scales, zps, axis, ...)`: `((w - zps) * scales).to(out_dtype)`,
//!   the parameters viewed to broadcast along `axis`; `quantize_per_channel` likewise
//! - `choose_qparams.tensor(x, qmin, qmax, eps, dtype)`: the per-tensor affine parameters of
//!   `torch.ao.quantization.utils.determine_qparams` from `aminmax(x)` (dynamic quantization)

use std::collections::HashSet;

use super::emit::{value_names, Emit};
use super::pass::{Ctx, Pass};
use super::Level;
use crate::schema::{Arg, Float, Method, Node, Outputs, Weights};

/// The namespace of torch's quantize and dequantize ops.
pub const NAMESPACE: &str = "quantized_decomposed";

/// The pass, at every level (the results are torch's own, bit for bit).
pub struct QuantizedOps;

impl Pass for QuantizedOps {
    fn name(&self) -> &'static str {
        "quantized_ops"
    }

    fn level(&self) -> Level {
        Level::Exact
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, _, weights| apply(m, weights))
    }
}

/// Writes out each quantize and dequantize node of the method's top-level graph it can;
/// returns how many.
pub fn apply(m: &mut Method, weights: &Weights) -> usize {
    if !m.ops.iter().any(|o| o.name.starts_with(NAMESPACE)) {
        return 0;
    }
    let weight_of: std::collections::HashMap<String, String> =
        super::readers::weight_inputs(&m.graph).into_iter().map(|(i, w)| (i.to_owned(), w.to_owned())).collect();
    let rank = |a: &Arg| match a {
        Arg::Ref(v) => weight_of.get(v).and_then(|w| weights.tensors.get(w)).map(|t| t.shape.len()),
        _ => None,
    };
    let mut names = value_names(&m.graph);
    let nodes = std::mem::take(&mut m.graph.nodes);
    let mut out = Vec::with_capacity(nodes.len());
    let mut written = 0;
    for node in nodes {
        let op = m.ops.get(node.op).map(|o| o.name.clone()).unwrap_or_default();
        let mut e = Emit::new(&mut m.ops, &mut names, format!("{}_q", first_output(&node)));
        if write_out(&mut e, &op, &node, &rank).is_some() {
            out.append(&mut e.nodes);
            written += 1;
        } else {
            out.push(node);
        }
    }
    m.graph.nodes = out;
    if written > 0 {
        drop_unread_ops(m);
    }
    written
}

/// Removes the op table's `quantized_decomposed` entries no node runs any more (the runtime
/// resolves every entry), renumbering the nodes' ops.
fn drop_unread_ops(m: &mut Method) {
    let read: HashSet<usize> = std::iter::once(&m.graph.nodes)
        .chain(m.subgraphs.values().map(|g| &g.nodes))
        .flat_map(|nodes| nodes.iter().map(|n| n.op))
        .collect();
    let keep: Vec<bool> =
        m.ops.iter().enumerate().map(|(i, o)| read.contains(&i) || !o.name.starts_with(NAMESPACE)).collect();
    let mut new_index = Vec::with_capacity(keep.len());
    let mut next = 0;
    for &k in &keep {
        new_index.push(next);
        next += usize::from(k);
    }
    let mut i = 0;
    m.ops.retain(|_| {
        i += 1;
        keep[i - 1]
    });
    let nodes = std::iter::once(&mut m.graph.nodes).chain(m.subgraphs.values_mut().map(|g| &mut g.nodes));
    for n in nodes.flatten() {
        n.op = new_index[n.op];
    }
}

/// The node's first output name, which the new values' names start from.
fn first_output(n: &Node) -> String {
    n.outputs.names().next().unwrap_or("q").to_owned()
}

fn float(v: f64) -> Arg {
    Arg::Float(Float(v))
}

fn dtype(name: &str) -> Arg {
    Arg::Dtype(name.to_owned())
}

/// The value a `.to(dtype)` of `x` gives, as torch.export writes it.
fn to(e: &mut Emit<'_>, x: Arg, dt: Arg) -> Arg {
    e.call("aten::_to_copy.default", vec![x], &[("dtype", dt)])
}

/// `(x.to(out_dtype) - zp) * scale`, per tensor, into `outputs`.
fn dequantize_per_tensor(e: &mut Emit<'_>, [x, scale, zp]: [Arg; 3], out_dtype: Arg, outputs: Outputs) {
    let x = to(e, x, out_dtype);
    let shifted = e.call("aten::sub.Tensor", vec![x, zp], &[]);
    e.bind("aten::mul.Tensor", vec![shifted, scale], &[], outputs);
}

/// `clamp(round(x * inv_scale) + zp, qmin, qmax).to(dtype)`, into `outputs`.
fn quantize(e: &mut Emit<'_>, [x, inv_scale, zp, qmin, qmax, dt]: [Arg; 6], outputs: Outputs) {
    let scaled = e.call("aten::mul.Tensor", vec![x, inv_scale], &[]);
    let rounded = e.call("aten::round.default", vec![scaled], &[]);
    let shifted = e.call("aten::add.Tensor", vec![rounded, zp], &[]);
    // `clamp.Tensor` on the bounds as wrapped numbers: `clamp`'s values (the bounds are
    // integers a float32 holds exactly), on the C path, which can't pass `clamp`'s Scalars.
    let clamped = e.call("aten::clamp.Tensor", vec![shifted, qmin, qmax], &[]);
    e.bind("aten::_to_copy.default", vec![clamped], &[("dtype", dt)], outputs);
}

/// A one-element tensor as torch's `.item()` hands it to an op: a 0-dimensional tensor, which
/// takes part in type promotion as a Python number does (a `[1]` float64 scale would make a
/// float32 product float64).
fn item(e: &mut Emit<'_>, t: Arg) -> Arg {
    e.call("aten::view.default", vec![t, Arg::List(Vec::new())], &[])
}

/// `t` viewed as `[-1, 1, ...]` to broadcast along `axis` of a tensor of `rank` dimensions.
fn along(e: &mut Emit<'_>, t: Arg, axis: usize, rank: usize) -> Arg {
    let shape = std::iter::once(-1).chain(std::iter::repeat_n(1, rank - 1 - axis)).map(Arg::Int).collect();
    e.call("aten::view.default", vec![t, Arg::List(shape)], &[])
}

/// Writes out `node` (running `op`), or `None` (writing nothing) where it isn't one this
/// pass knows with arguments it can write out.
fn write_out(e: &mut Emit<'_>, op: &str, node: &Node, rank: &dyn Fn(&Arg) -> Option<usize>) -> Option<()> {
    let a = &node.args;
    let outputs = node.outputs.clone();
    let out_dtype = || match node.kwargs.get("out_dtype") {
        None | Some(Arg::None(())) => Some(dtype("float32")),
        Some(d @ Arg::Dtype(_)) => Some(d.clone()),
        Some(_) => None,
    };
    let known_kwargs = node.kwargs.keys().all(|k| k == "out_dtype");
    if !known_kwargs {
        return None;
    }
    match (op.strip_prefix("quantized_decomposed::")?, a.as_slice()) {
        ("dequantize_per_tensor.default", [x, scale @ Arg::Float(_), zp @ Arg::Int(_), _, _, Arg::Dtype(_)]) => {
            dequantize_per_tensor(e, [x.clone(), scale.clone(), zp.clone()], out_dtype()?, outputs);
        }
        ("dequantize_per_tensor.tensor", [x, scale @ Arg::Ref(_), zp @ Arg::Ref(_), _, _, Arg::Dtype(_)]) => {
            let out_dtype = out_dtype()?;
            let (scale, zp) = (item(e, scale.clone()), item(e, zp.clone()));
            dequantize_per_tensor(e, [x.clone(), scale, zp], out_dtype, outputs);
        }
        (
            "quantize_per_tensor.default",
            [x, Arg::Float(Float(scale)), zp @ Arg::Int(_), lo, hi, dt @ Arg::Dtype(_)],
            // A zero or non-finite scale stays torch's op, which refuses it (`1.0 / scale` raises).
        ) if node.kwargs.is_empty() && scale.is_finite() && *scale != 0.0 => {
            quantize(e, [x.clone(), float(1.0 / scale), zp.clone(), lo.clone(), hi.clone(), dt.clone()], outputs);
        }
        ("quantize_per_tensor.tensor", [x, scale @ Arg::Ref(_), zp @ Arg::Ref(_), lo, hi, dt @ Arg::Dtype(_)])
            if node.kwargs.is_empty() =>
        {
            // `1.0 / scale.item()`: the reciprocal in double, whatever the scale's dtype.
            let scale = item(e, scale.clone());
            let scale = to(e, scale, dtype("float64"));
            let inv = e.call("aten::reciprocal.default", vec![scale], &[]);
            let zp = item(e, zp.clone());
            quantize(e, [x.clone(), inv, zp, lo.clone(), hi.clone(), dt.clone()], outputs);
        }
        ("dequantize_per_channel.default", [x, scales @ Arg::Ref(_), zps, Arg::Int(axis), _, _, Arg::Dtype(_)]) => {
            let (axis, rank) = (usize::try_from(*axis).ok()?, rank(x)?);
            if axis >= rank || !matches!(zps, Arg::Ref(_) | Arg::None(())) {
                return None;
            }
            let out_dtype = out_dtype()?;
            let scales = along(e, scales.clone(), axis, rank);
            let shifted = match zps {
                Arg::Ref(_) => {
                    let zps = along(e, zps.clone(), axis, rank);
                    e.call("aten::sub.Tensor", vec![x.clone(), zps], &[])
                }
                _ => x.clone(),
            };
            let scaled = e.call("aten::mul.Tensor", vec![shifted, scales], &[]);
            e.bind("aten::_to_copy.default", vec![scaled], &[("dtype", out_dtype)], outputs);
        }
        ("quantize_per_channel.default", [x, scales @ Arg::Ref(_), zps @ Arg::Ref(_), Arg::Int(axis), lo, hi, dt])
            if node.kwargs.is_empty() && matches!(dt, Arg::Dtype(_)) =>
        {
            let (axis, rank) = (usize::try_from(*axis).ok()?, rank(x)?);
            if axis >= rank {
                return None;
            }
            let scales = along(e, scales.clone(), axis, rank);
            let inv = e.call("aten::reciprocal.default", vec![scales], &[]);
            let zps = along(e, zps.clone(), axis, rank);
            quantize(e, [x.clone(), inv, zps, lo.clone(), hi.clone(), dt.clone()], outputs);
        }
        ("choose_qparams.tensor", [x, Arg::Int(qmin), Arg::Int(qmax), Arg::Float(Float(eps)), Arg::Dtype(_)])
            if node.kwargs.is_empty() && qmax > qmin =>
        {
            let Outputs::Many(outs) = &outputs else { return None };
            let [scale_out, zp_out] = outs.as_slice() else { return None };
            let steps = qmax.checked_sub(*qmin)? as f64;
            choose_qparams(e, x.clone(), [*qmin, *qmax], steps, *eps, [scale_out.clone(), zp_out.clone()]);
        }
        _ => return None,
    }
    Some(())
}

/// `determine_qparams(*aminmax(x), qmin, qmax, dtype, tensor([eps]))` for per-tensor affine
/// quantization: `scale = max((max(hi, 0) - min(lo, 0)) / (qmax - qmin), eps)` as float64 and
/// `zp = clamp(qmin - round(min(lo, 0) / scale).to(int32), qmin, qmax)` as int64, each of
/// shape `[1]`. (torch returns `[1.0]` and `[0]` where `x` has an infinity or no element,
/// and raises for a NaN minimum or maximum: those inputs get what this arithmetic gives.)
fn choose_qparams(e: &mut Emit<'_>, x: Arg, [qmin, qmax]: [i64; 2], steps: f64, eps: f64, outs: [Option<String>; 2]) {
    let lo = e.call("aten::amin.default", vec![x.clone()], &[]);
    let hi = e.call("aten::amax.default", vec![x], &[]);
    let zero_lo = e.call("aten::zeros_like.default", vec![lo.clone()], &[]);
    let zero_hi = e.call("aten::zeros_like.default", vec![hi.clone()], &[]);
    let lo = e.call("aten::minimum.default", vec![lo, zero_lo], &[]);
    let hi = e.call("aten::maximum.default", vec![hi, zero_hi], &[]);
    let range = e.call("aten::sub.Tensor", vec![hi, lo.clone()], &[]);
    let scale = e.call("aten::div.Tensor", vec![range, float(steps)], &[]);
    let eps =
        e.call("aten::full.default", vec![Arg::List(vec![Arg::Int(1)]), float(eps)], &[("dtype", dtype("float32"))]);
    let scale = e.call("aten::maximum.default", vec![scale, eps], &[]);
    let steps = e.call("aten::div.Tensor", vec![lo, scale.clone()], &[]);
    let steps = e.call("aten::round.default", vec![steps], &[]);
    let steps = to(e, steps, dtype("int32"));
    // `qmin - steps` and the clamp with wrapped numbers, in int32 as torch computes them.
    let zp = e.call("aten::sub.Tensor", vec![Arg::Int(qmin), steps], &[]);
    let zp = e.call("aten::clamp.Tensor", vec![zp, Arg::Int(qmin), Arg::Int(qmax)], &[]);
    let [scale_out, zp_out] = outs;
    let scale = to(e, scale, dtype("float64"));
    let zp = to(e, zp, dtype("int64"));
    // The node's outputs, as aliases of the last values (`alias` is a view: no copy).
    for (out, value) in [(scale_out, scale), (zp_out, zp)] {
        if let Some(out) = out {
            e.bind("aten::alias.default", vec![value], &[], Outputs::One(out));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `x -> dequantize_per_tensor -> y`, and a per-channel dequantize of `w` (a weight when
    /// `w_is_weight`, else a user input) into `z`.
    fn method(w_is_weight: bool) -> Method {
        let r = |v: &str| json!({"ref": v});
        let w_source = if w_is_weight { json!({"weight": "w"}) } else { json!({"user": 1}) };
        serde_json::from_value(json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": "quantized_decomposed::dequantize_per_tensor.default", "schema": "s"},
                    {"name": "quantized_decomposed::dequantize_per_channel.default", "schema": "s"}],
            "graph": {
                "inputs": [{"name": "x", "source": {"user": 0}}, {"name": "w", "source": w_source},
                           {"name": "s", "source": {"weight": "s"}}, {"name": "z0", "source": {"weight": "z0"}}],
                "nodes": [
                    {"op": 0, "args": [r("x"), {"float": 0.5}, {"int": 3}, {"int": -128}, {"int": 127},
                                       {"dtype": "int8"}], "outputs": {"one": "y"}},
                    {"op": 1, "args": [r("w"), r("s"), r("z0"), {"int": 0}, {"int": -128}, {"int": 127},
                                       {"dtype": "int8"}], "outputs": {"one": "z"}}],
                "outputs": [r("y"), r("z")]}
        }))
        .unwrap()
    }

    fn weights() -> Weights {
        serde_json::from_value(json!({
            "storages": [],
            "tensors": {"w": {"dtype": "int8", "shape": [4, 3, 2, 2], "strides": [12, 4, 2, 1], "storage": 0}}
        }))
        .unwrap()
    }

    fn ops_run(m: &Method) -> Vec<&str> {
        m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect()
    }

    #[test]
    fn writes_out_torchs_arithmetic_and_drops_the_ops_it_replaced() {
        let mut m = method(true);
        let w = weights();
        assert_eq!(apply(&mut m, &w), 2);
        assert_eq!(
            ops_run(&m),
            [
                "aten::_to_copy.default",
                "aten::sub.Tensor",
                "aten::mul.Tensor",
                "aten::view.default",
                "aten::view.default",
                "aten::sub.Tensor",
                "aten::mul.Tensor",
                "aten::_to_copy.default",
            ]
        );
        assert!(m.ops.iter().all(|o| !o.name.starts_with(NAMESPACE)));
        // The last node of each binds the replaced node's output; the scales broadcast along
        // axis 0 of a 4-D weight.
        assert_eq!(m.graph.nodes[2].outputs, Outputs::One("y".into()));
        assert_eq!(m.graph.nodes[7].outputs, Outputs::One("z".into()));
        let view = &m.graph.nodes[3].args[1];
        assert_eq!(view, &Arg::List(vec![Arg::Int(-1), Arg::Int(1), Arg::Int(1), Arg::Int(1)]));
        assert_eq!(apply(&mut m, &w), 0, "nothing left to write out");
    }

    #[test]
    fn a_quantize_torch_would_refuse_stays_torchs() {
        let mut m = method(true);
        m.ops[0].name = "quantized_decomposed::quantize_per_tensor.default".into();
        m.graph.nodes.truncate(1);
        m.graph.outputs.truncate(1);
        for scale in [0.0, f64::INFINITY] {
            let mut m = m.clone();
            m.graph.nodes[0].args[1] = Arg::Float(Float(scale));
            assert_eq!(apply(&mut m, &weights()), 0, "scale {scale}");
        }
        assert_eq!(apply(&mut m, &weights()), 1);
    }

    #[test]
    fn a_per_channel_op_on_a_value_of_unknown_rank_stays() {
        let mut m = method(false);
        assert_eq!(apply(&mut m, &weights()), 1);
        assert_eq!(ops_run(&m).last(), Some(&"quantized_decomposed::dequantize_per_channel.default"));
        assert!(m.ops.iter().any(|o| o.name == "quantized_decomposed::dequantize_per_channel.default"));
        assert!(m.ops.iter().all(|o| o.name != "quantized_decomposed::dequantize_per_tensor.default"));
    }
}
