//! Linears fused with the activation after them (`optimize="fast"`, at load, where the
//! runtime has its own GEMM and torch has oneDNN): `mkldnn::_linear_pointwise`, oneDNN's
//! linear with the activation as a post-op. The runtime's GEMM applies the activation as it
//! stores each result; where torch's kernel measured faster for the node's rows, kwexport's
//! pointwise kernel applies it to torch's result while that is still in cache. Either way
//! the activation is no node of its own: no dispatch, no output allocated, no second pass
//! over memory (BERT's GELU, Llama's SiLU).
//!
//! Like [`conv_pointwise`](super::conv_pointwise), the pass runs at load only: a file written
//! by `kwexport optimize` keeps its `linear` nodes, portable to any torch.

use super::pass::{Ctx, Pass};
use super::readers::{sole_reader, weight_inputs, Readers};
use super::{Level, Target};
use crate::schema::{Arg, Document, Method, Node};

/// The op a fused linear runs.
pub const FUSED: &str = crate::tables::PASS_OPS[1];

/// The post-ops (`post_ops::POST_OPS`) a fused linear takes: those kwexport's GEMM applies
/// where transformers and MLPs use them (`linear_int8` fuses the same).
pub(super) const ACTIVATIONS: &[&str] = &["relu", "swish", "gelu"];

/// Fuses every linear of each method's top-level graph whose float32 weight isn't state and
/// whose output only an activation reads; returns how many.
pub fn apply(doc: &mut Document) -> usize {
    LinearPointwise.apply(&mut Ctx::new(doc, Target { onednn: true, gemm: true, ..Target::default() }))
}

/// The pass (`fast`, on a loader's CPU with oneDNN and the runtime's GEMM).
pub struct LinearPointwise;

impl Pass for LinearPointwise {
    fn name(&self) -> &'static str {
        "linear_pointwise"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.onednn && target.gemm
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, readers, weights| {
            let weight_of = weight_inputs(&m.graph);
            let found = find(m, readers, |input| {
                let t = weight_of.get(input).and_then(|w| weights.tensors.get(*w));
                t.is_some_and(|t| t.dtype == "float32" && !t.mutable && t.shape.len() == 2)
            });
            if found.is_empty() {
                return 0;
            }
            let op = super::op_index(&mut m.ops, FUSED);
            let mut removed = vec![false; m.graph.nodes.len()];
            let fused = found.len();
            for (linear, activation, node) in found {
                // At the activation's place: everything the linear read is defined by then.
                m.graph.nodes[activation] = Node { op, ..node };
                removed[linear] = true;
            }
            super::remove_nodes(&mut m.graph.nodes, &removed);
            fused
        })
    }
}

/// Each linear to fuse: its index, its activation's, and the fused node (`op` left for the
/// caller). `is_weight(input)` says whether a graph input names a float32 matrix weight that
/// isn't state.
fn find(m: &Method, readers: &Readers, is_weight: impl Fn(&str) -> bool) -> Vec<(usize, usize, Node)> {
    let g = &m.graph;
    let op_of = |n: &Node| m.ops.get(n.op).map(|o| o.name.as_str());
    let mut found = Vec::new();
    for (li, linear) in g.nodes.iter().enumerate() {
        if op_of(linear) != Some("aten::linear.default") || !linear.kwargs.is_empty() {
            continue;
        }
        let (Some(x @ Arg::Ref(_)), Some(Arg::Ref(w))) = (linear.args.first(), linear.args.get(1)) else { continue };
        let bias = match linear.args.get(2) {
            None | Some(Arg::None(())) => Arg::None(()),
            Some(b @ Arg::Ref(_)) => b.clone(),
            Some(_) => continue,
        };
        if linear.args.len() > 3 || !is_weight(w) {
            continue;
        }
        let Some(ai) = sole_reader(readers, linear) else { continue };
        let a = &g.nodes[ai];
        // None of these takes scalars.
        let Some(super::post_ops::Matched { attr, algorithm, .. }) = super::post_ops::matched(op_of(a), a, ACTIVATIONS)
        else {
            continue;
        };
        let node = Node {
            op: 0,
            args: vec![
                x.clone(),
                Arg::Ref(w.clone()),
                bias,
                Arg::Str(attr.to_owned()),
                Arg::List(Vec::new()),
                algorithm,
            ],
            kwargs: Default::default(),
            outputs: a.outputs.clone(),
        };
        found.push((li, ai, node));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// linear(x, w, b) then `activation`, whose output is the graph's.
    fn doc(activation: &str, act_args: serde_json::Value, mutate: impl FnOnce(&mut serde_json::Value)) -> Document {
        let activation = activation.to_owned();
        let header = move |h: &mut serde_json::Value| {
            let m = &mut h["methods"]["forward"];
            m["ops"] = json!([{"name": "aten::linear.default", "schema": null}, {"name": activation, "schema": null}]);
            m["graph"]["inputs"] = json!([
                {"name": "pw", "source": {"weight": "w"}}, {"name": "pb", "source": {"weight": "b"}},
                {"name": "x", "source": {"user": 0}}]);
            let mut args = vec![json!({"ref": "h"})];
            args.extend(act_args.as_array().unwrap().iter().cloned());
            m["graph"]["nodes"] = json!([
                {"op": 0, "args": [{"ref": "x"}, {"ref": "pw"}, {"ref": "pb"}], "outputs": {"one": "h"}},
                {"op": 1, "args": args, "outputs": {"one": "y"}}]);
            m["graph"]["outputs"] = json!([{"ref": "y"}]);
            h["weights"]["storages"] = json!([{"offset": 0, "nbytes": 96}]);
            h["weights"]["tensors"] = json!({
                "w": {"dtype": "float32", "shape": [4, 4], "strides": [4, 1], "storage": 0},
                "b": {"dtype": "float32", "shape": [4], "strides": [1], "storage": 0, "storage_offset": 16}});
        };
        super::super::tests::document(header, mutate)
    }

    #[test]
    fn fuses_a_linear_and_its_activation() {
        for (activation, args, attr, algorithm) in [
            ("aten::silu.default", json!([]), "swish", Arg::None(())),
            ("aten::relu_.default", json!([]), "relu", Arg::None(())),
            ("aten::gelu.default", json!([]), "gelu", Arg::Str("none".into())),
            ("aten::gelu.default", json!([{"str": "tanh"}]), "gelu", Arg::Str("tanh".into())),
        ] {
            let mut d = doc(activation, args, |_| {});
            assert_eq!(apply(&mut d), 1, "{activation}");
            let m = &d.methods["forward"];
            assert_eq!(m.graph.nodes.len(), 1);
            let n = &m.graph.nodes[0];
            assert_eq!(m.ops[n.op].name, FUSED);
            let expected = [
                Arg::Ref("x".into()),
                Arg::Ref("pw".into()),
                Arg::Ref("pb".into()),
                Arg::Str(attr.into()),
                Arg::List(vec![]),
                algorithm,
            ];
            assert_eq!(n.args, expected);
            assert_eq!(n.outputs, crate::schema::Outputs::One("y".into()));
            assert_eq!(apply(&mut d), 0, "idempotent");
        }
    }

    #[test]
    fn leaves_near_misses_alone() {
        type Case = (&'static str, serde_json::Value, fn(&mut serde_json::Value));
        let cases: [Case; 6] = [
            // The linear's output read elsewhere too.
            ("aten::silu.default", json!([]), |h| {
                h["methods"]["forward"]["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "h"}])
            }),
            // An activation oneDNN's linear doesn't fuse here.
            ("aten::tanh.default", json!([]), |_| {}),
            // A GELU approximation torch doesn't have.
            ("aten::gelu.default", json!([{"str": "sigmoid"}]), |_| {}),
            // State as the weight, or another dtype.
            ("aten::silu.default", json!([]), |h| h["weights"]["tensors"]["w"]["mutable"] = json!(true)),
            ("aten::silu.default", json!([]), |h| h["weights"]["tensors"]["w"]["dtype"] = json!("bfloat16")),
            // A weight computed by the graph.
            ("aten::silu.default", json!([]), |h| {
                h["methods"]["forward"]["graph"]["nodes"][0]["args"][1] = json!({"ref": "x"})
            }),
        ];
        for (i, (activation, args, case)) in cases.into_iter().enumerate() {
            let mut d = doc(activation, args, case);
            assert_eq!(apply(&mut d), 0, "case {i}");
            assert_eq!(d.methods["forward"].graph.nodes.len(), 2, "case {i}");
        }
    }
}
