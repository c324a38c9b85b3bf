//! Convolutions of an int8 weight dequantized per channel run on float32 weights made once
//! at load (`optimize="fast"`, at load, on a CPU torch with oneDNN). A program quantized by
//! torch's pt2e flows convolves `dequantize_per_channel(w_int8, scale, zero_point, axis, ...)`;
//! constant folding would make that float32 weight at load too, but as a value the other
//! passes can't see, so the convolution stayed torch's plain op on an NCHW weight (3× the time
//! of the lowered one on mobilenet_v3_small). Here the convolutions read the weight itself and
//! the runtime replaces the int8 tensor by its dequantized values before any other pass's
//! work on it (`kwexport._passes.dequantize_weights`: `(w - zero_point) * scale` along `axis`,
//! torch's definition, the same bits); `conv_pointwise` and `channels_last` then take it as a
//! float32 weight.
//!
//! Only a weight no other node of any method reads (the dequantize alone), nor state, whose
//! dequantize only convolutions read as their weight. Runs at load only: a written file
//! keeps its int8 weights.

use std::collections::BTreeMap;

use super::pass::{Ctx, Pass};
use super::readers::{one, readers, weight_inputs, OUTSIDE};
use super::{Level, Target};
use crate::schema::{Arg, Document, Node};

/// A weight to dequantize at load: its scales and zero points (weights too) along `axis`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dequant {
    /// The int8 weight's name in the weight table.
    pub weight: String,
    /// Its float32 scales' name, one per slice along `axis`.
    pub scale: String,
    /// Its integer zero points' name, as many.
    pub zero_point: String,
    /// The dimension the scales run along.
    pub axis: i64,
}

/// The pass (`fast`, at load on a CPU with oneDNN; before `quantized_ops` and `conv_pointwise`).
pub struct DequantizeWeights;

impl Pass for DequantizeWeights {
    fn name(&self) -> &'static str {
        "dequantize_weights"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.onednn
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        let found = find(cx.doc);
        let made = found.len();
        for (method, node, weight_input, d) in found.into_iter().rev() {
            // Last to first within a method: the indices before `node` stay.
            let m = cx.doc.methods.get_mut(&method).expect("found in it");
            let dq_out = Arg::Ref(one(&m.graph.nodes[node]).expect("found with one output").to_owned());
            let ops = &m.ops;
            for n in m.graph.nodes.iter_mut() {
                let Some(conv) = super::conv::of(ops.get(n.op).map(|o| o.name.as_str())) else { continue };
                if n.args.get(conv.weight) == Some(&dq_out) {
                    n.args[conv.weight] = Arg::Ref(weight_input.clone());
                }
            }
            m.graph.nodes.remove(node);
            cx.rewrites.dequantized.push(d);
        }
        made
    }
}

/// Each dequantize to drop: its method, its node's index, the graph input naming the int8
/// weight, and the weight's dequantization; by method, in node order.
fn find(doc: &Document) -> Vec<(String, usize, String, Dequant)> {
    // How many times all methods read each weight (through any graph input naming it):
    // node arguments, subgraphs' too, graph outputs and mutations.
    let mut reads: BTreeMap<&str, usize> = BTreeMap::new();
    for m in doc.methods.values() {
        let weight_of = weight_inputs(&m.graph);
        let mut count = |v: &str| {
            if let Some(w) = weight_of.get(v) {
                *reads.entry(w).or_default() += 1;
            }
        };
        let nodes = m.graph.nodes.iter().chain(m.subgraphs.values().flat_map(|g| g.nodes.iter()));
        let args = nodes.flat_map(|n| n.args.iter().chain(n.kwargs.values()));
        let outside = m.graph.outputs.iter().chain(m.graph.mutations.iter().map(|w| &w.value));
        args.chain(outside).for_each(|a| a.for_each_ref(&mut count));
    }
    let mut found = Vec::new();
    for (name, m) in &doc.methods {
        let (weight_of, read) = (weight_inputs(&m.graph), readers(&m.graph));
        let op_of = |n: &Node| m.ops.get(n.op).map_or("", |o| o.name.as_str());
        for (i, n) in m.graph.nodes.iter().enumerate() {
            if op_of(n) != "quantized_decomposed::dequantize_per_channel.default" || !super::linear_int8::float32_out(n)
            {
                continue;
            }
            let [Arg::Ref(w), Arg::Ref(s), Arg::Ref(z), Arg::Int(axis), Arg::Int(_), Arg::Int(_), Arg::Dtype(dt)] =
                &n.args[..]
            else {
                continue;
            };
            let (Some(&wn), Some(&sn), Some(&zn)) =
                (weight_of.get(w.as_str()), weight_of.get(s.as_str()), weight_of.get(z.as_str()))
            else {
                continue;
            };
            let tensor = |t: &str| doc.weights.tensors.get(t);
            let int8 =
                tensor(wn).is_some_and(|t| t.dtype == "int8" && dt == "int8" && !t.mutable && t.shape.len() == 4);
            let scales = tensor(sn).is_some_and(|t| t.dtype == "float32" && t.shape.len() == 1);
            let zeros = tensor(zn).is_some_and(|t| matches!(t.dtype.as_str(), "int64" | "int32") && t.shape.len() == 1);
            if !(int8 && scales && zeros && reads.get(wn) == Some(&1) && *axis == 0) {
                continue;
            }
            // Only convolutions read the dequantized weight, each once, as its weight (a
            // reader appears once per reference).
            let Some(out) = one(n) else { continue };
            let as_weight = |r: usize| {
                let c = &m.graph.nodes[r];
                super::conv::of(Some(op_of(c)))
                    .is_some_and(|conv| c.args.get(conv.weight) == Some(&Arg::Ref(out.into())))
            };
            let readers_ok = read.get(out).is_some_and(|rs| {
                rs.windows(2).all(|p| p[0] != p[1]) && rs.iter().all(|&r| r != OUTSIDE && as_weight(r))
            });
            if readers_ok {
                let d = Dequant { weight: wn.into(), scale: sn.into(), zero_point: zn.into(), axis: *axis };
                found.push((name.clone(), i, w.clone(), d));
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `y = conv2d(x, dequantize_per_channel(w, s, z, 0, -128, 127, int8))`, with `edit` applied.
    fn doc(edit: impl FnOnce(&mut serde_json::Value)) -> Document {
        let header = |h: &mut serde_json::Value| {
            let m = &mut h["methods"]["forward"];
            m["ops"] = json!([
                {"name": "quantized_decomposed::dequantize_per_channel.default", "schema": null},
                {"name": "aten::conv2d.default", "schema": null},
                {"name": "aten::relu.default", "schema": null}]);
            m["graph"]["inputs"] = json!([
                {"name": "pw", "source": {"weight": "w"}}, {"name": "ps", "source": {"weight": "s"}},
                {"name": "pz", "source": {"weight": "z"}}, {"name": "x", "source": {"user": 0}}]);
            m["graph"]["nodes"] = json!([
                {"op": 0, "args": [{"ref": "pw"}, {"ref": "ps"}, {"ref": "pz"}, {"int": 0}, {"int": -128},
                                   {"int": 127}, {"dtype": "int8"}], "outputs": {"one": "wd"}},
                {"op": 1, "args": [{"ref": "x"}, {"ref": "wd"}], "outputs": {"one": "y"}}]);
            m["graph"]["outputs"] = json!([{"ref": "y"}]);
            h["weights"]["storages"] = json!([{"offset": 0, "nbytes": 96}]);
            h["weights"]["tensors"] = json!({
                "w": {"dtype": "int8", "shape": [4, 3, 1, 1], "strides": [3, 1, 1, 1], "storage": 0},
                "s": {"dtype": "float32", "shape": [4], "strides": [1], "storage": 0, "storage_offset": 4},
                "z": {"dtype": "int64", "shape": [4], "strides": [1], "storage": 0, "storage_offset": 4}});
        };
        super::super::tests::document(header, edit)
    }

    fn run(d: &mut Document) -> (usize, Vec<Dequant>) {
        let mut cx = Ctx::new(d, Target { onednn: true, ..Target::default() });
        let made = DequantizeWeights.apply(&mut cx);
        (made, cx.rewrites.dequantized)
    }

    #[test]
    fn a_convolution_reads_its_int8_weight_dequantized_at_load() {
        let mut d = doc(|_| {});
        let (made, dequantized) = run(&mut d);
        assert_eq!(made, 1);
        let want = Dequant { weight: "w".into(), scale: "s".into(), zero_point: "z".into(), axis: 0 };
        assert_eq!(dequantized, [want]);
        let m = &d.methods["forward"];
        assert_eq!(m.graph.nodes.len(), 1);
        assert_eq!(m.graph.nodes[0].args, [Arg::Ref("x".into()), Arg::Ref("pw".into())]);
        assert_eq!(run(&mut d).0, 0, "nothing is found twice");
    }

    /// At `fast` on a CPU with oneDNN, the passes before this one found the readers of the
    /// graph with the dequantize in it; the convolution then lowered after it, with its ReLU,
    /// must find them again (they were stale: a ReLU at an index past the graph's end, a panic
    /// on every ResNet quantized by pt2e's x86 flow).
    #[test]
    fn the_passes_after_it_see_the_graph_without_the_dequantize() {
        let mut d = doc(|d| {
            let nodes = d["methods"]["forward"]["graph"]["nodes"].as_array_mut().unwrap();
            nodes.push(json!({"op": 2, "args": [{"ref": "y"}], "outputs": {"one": "r"}}));
            d["methods"]["forward"]["graph"]["outputs"] = json!([{"ref": "r"}]);
        });
        // With the GEMM, which lowers this 1×1 convolution.
        let target = Target { onednn: true, gemm: true, ..Target::default() };
        let rewrites = super::super::apply(&mut d, super::super::Level::Fast, target);
        assert_eq!(rewrites.counts["dequantize_weights"], 1);
        assert_eq!(rewrites.counts["conv_pointwise"], 1);
        let m = &d.methods["forward"];
        let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(ops, [super::super::conv_pointwise::FUSED]);
        assert_eq!(m.graph.nodes[0].args[7], Arg::Str("relu".into()));
    }

    #[test]
    fn a_weight_or_value_something_else_reads_stays() {
        let cases: [fn(&mut serde_json::Value); 4] = [
            // The dequantized weight read by another op too.
            |d| {
                let nodes = d["methods"]["forward"]["graph"]["nodes"].as_array_mut().unwrap();
                nodes.push(json!({"op": 2, "args": [{"ref": "wd"}], "outputs": {"one": "r"}}));
            },
            // The int8 weight read by another node.
            |d| {
                let nodes = d["methods"]["forward"]["graph"]["nodes"].as_array_mut().unwrap();
                nodes.push(json!({"op": 2, "args": [{"ref": "pw"}], "outputs": {"one": "r"}}));
            },
            // The dequantized weight an output.
            |d| d["methods"]["forward"]["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "wd"}]),
            // Along another axis.
            |d| d["methods"]["forward"]["graph"]["nodes"][0]["args"][3] = json!({"int": 1}),
        ];
        for (i, case) in cases.into_iter().enumerate() {
            let mut d = doc(case);
            assert_eq!(run(&mut d), (0, Vec::new()), "case {i}");
        }
    }
}
