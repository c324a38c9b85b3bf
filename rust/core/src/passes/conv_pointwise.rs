//! Convolutions lowered onto oneDNN's fused convolution (`optimize="fast"`, at load, on a CPU
//! torch built with oneDNN): `mkldnn::_convolution_pointwise`, which takes its weight packed
//! once into oneDNN's blocked layout for this CPU, and applies the activation that follows
//! (ReLU, hardswish, ...) as a post-op while the output is still in cache. torch's own
//! `convolution` reorders a plain weight on every call; packed, a 3×3 convolution at
//! resnet18's small shapes takes 0.45–0.8× the time (docs/optimize.md).
//!
//! A 1×1 convolution is a matrix product over pixels, where oneDNN's fused op measured as
//! fast as torch's channels-last path or up to 2× slower (on 1×1 spatial inputs, where its
//! setup dominates): it is lowered only where the runtime has its own GEMM for it (`gemm`:
//! one group, no dilation), which the runtime measures against oneDNN per shape and which
//! absorbs the activation as well. The runtime packs each
//! weight on the node's first call (packing all of resnet18's takes ~70 ms, which a load
//! shouldn't pay), so files keep plain tensors and the pass runs at load only: a file
//! written by `kwexport optimize` keeps its `convolution` nodes, portable to any torch.

use super::pass::{Ctx, Pass};
use super::readers::{sole_reader, weight_inputs, Readers};
use super::{Level, Target};
use std::collections::BTreeMap;

use crate::schema::{Arg, Document, Method, Node, WeightTensor};

/// The op a lowered convolution runs.
pub const FUSED: &str = crate::tables::PASS_OPS[0];

/// The post-ops (`post_ops::POST_OPS`) a lowered convolution takes, each of its input only.
const ACTIVATIONS: &[&str] = &["relu", "hardswish", "hardsigmoid", "swish", "sigmoid", "tanh", "hardtanh", "gelu"];

/// Lowers every qualifying 2-D convolution of each method's top-level graph (1×1 ones with
/// stride 1, no padding and one group only with `gemm`); returns how many.
pub fn apply(doc: &mut Document, gemm: bool) -> usize {
    ConvPointwise.apply(&mut Ctx::new(doc, Target { onednn: true, gemm, ..Target::default() }))
}

/// The pass (`fast`, on a loader's CPU with oneDNN).
pub struct ConvPointwise;

impl Pass for ConvPointwise {
    fn name(&self) -> &'static str {
        "conv_pointwise"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.onednn
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        let gemm = cx.target.gemm;
        // Weights the runtime dequantizes to float32 at load (`dequantize_weights`) count as float32.
        let dequantized: Vec<String> = cx.rewrites.dequantized.iter().map(|d| d.weight.clone()).collect();
        cx.each_method(|_, m, readers, weights| lower(m, &weights.tensors, &dequantized, readers, gemm))
    }
}

/// Lowers the method's qualifying convolutions; returns how many.
fn lower(
    m: &mut Method,
    tensors: &BTreeMap<String, WeightTensor>,
    dequantized: &[String],
    readers: &Readers,
    gemm: bool,
) -> usize {
    let weight_of = weight_inputs(&m.graph);
    let found = find(m, gemm, readers, |input| {
        let name = *weight_of.get(input)?;
        let t = tensors.get(name)?;
        let float32 = t.dtype == "float32" || dequantized.iter().any(|d| d == name);
        (float32 && !t.mutable).then(|| t.shape.clone())
    });
    if found.is_empty() {
        return 0;
    }
    let op = super::op_index(&mut m.ops, FUSED);
    let mut removed = vec![false; m.graph.nodes.len()];
    let lowered = found.len();
    for (conv, activation, node) in found {
        let at = activation.unwrap_or(conv);
        m.graph.nodes[at] = Node { op, ..node };
        if activation.is_some() {
            removed[conv] = true;
        }
    }
    super::remove_nodes(&mut m.graph.nodes, &removed);
    lowered
}

/// Each convolution to lower: its index, the activation's it absorbs, and the fused node
/// (`op` left for the caller). `weight_shape(input)` is the shape of the float32 weight a
/// graph input names, if it names one that isn't state.
fn find(
    m: &Method,
    gemm: bool,
    readers: &Readers,
    weight_shape: impl Fn(&str) -> Option<Vec<i64>>,
) -> Vec<(usize, Option<usize>, Node)> {
    let g = &m.graph;
    let op_of = |n: &Node| m.ops.get(n.op).map(|o| o.name.as_str());
    let mut found = Vec::new();
    for (ci, conv) in g.nodes.iter().enumerate() {
        let Some(geometry) = convolution(op_of(conv), conv) else { continue };
        let Some(Arg::Ref(w)) = conv.args.get(1) else { continue };
        let Some(shape) = weight_shape(w) else { continue };
        let [stride, padding, dilation, groups] = geometry;
        let ones = |a: &Arg| matches!(a, Arg::List(items) if items.iter().all(|i| *i == Arg::Int(1)));
        let for_gemm = gemm && ones(&dilation) && groups == Arg::Int(1);
        if shape.len() != 4 || (shape[2] <= 1 && shape[3] <= 1 && !for_gemm) {
            continue;
        }
        let activation = sole_reader(readers, conv).and_then(|ai| {
            let a = &g.nodes[ai];
            let m = super::post_ops::matched(op_of(a), a, ACTIVATIONS)?;
            Some((ai, m.attr, m.scalars, m.algorithm))
        });
        let (x, bias) = (conv.args[0].clone(), conv.args.get(2).cloned().unwrap_or(Arg::None(())));
        let node = Node {
            op: 0,
            args: vec![
                x,
                Arg::Ref(w.clone()),
                bias,
                padding,
                stride,
                dilation,
                groups,
                Arg::Str(activation.as_ref().map_or("none", |(_, attr, _, _)| attr).to_owned()),
                Arg::List(activation.as_ref().map_or_else(Vec::new, |(_, _, scalars, _)| scalars.clone())),
                activation.as_ref().map_or(Arg::None(()), |(_, _, _, algorithm)| algorithm.clone()),
            ],
            kwargs: Default::default(),
            outputs: activation.as_ref().map_or(&conv.outputs, |(ai, _, _, _)| &g.nodes[*ai].outputs).clone(),
        };
        found.push((ci, activation.map(|(ai, _, _, _)| ai), node));
    }
    found
}

/// A 2-D convolution's `[stride, padding, dilation, groups]` as the fused op takes them
/// (pairs of int literals, and an int), if the node is one with literal geometry.
fn convolution(op: Option<&str>, n: &Node) -> Option<[Arg; 4]> {
    if !n.kwargs.is_empty() || !matches!(n.args.first(), Some(Arg::Ref(_))) {
        return None;
    }
    let bias_ok = matches!(n.args.get(2), None | Some(Arg::None(()) | Arg::Ref(_)));
    let pair = |a: Option<&Arg>, default: i64| -> Option<Arg> {
        let v = match a {
            None => vec![default; 2],
            Some(Arg::List(items)) => {
                let ints = items.iter().map(|i| if let Arg::Int(v) = i { Some(*v) } else { None });
                let ints: Vec<i64> = ints.collect::<Option<_>>()?;
                match ints.as_slice() {
                    [v] => vec![*v; 2],
                    [_, _] => ints,
                    _ => return None,
                }
            }
            _ => return None,
        };
        Some(Arg::List(v.into_iter().map(Arg::Int).collect()))
    };
    let groups = |a: Option<&Arg>| match a {
        None => Some(Arg::Int(1)),
        Some(Arg::Int(g)) => Some(Arg::Int(*g)),
        _ => None,
    };
    let a = &n.args;
    let conv = super::conv::of(op).filter(|c| c.torch && !c.transposed(n))?;
    let geometry = match conv.name {
        "aten::conv2d.default" if bias_ok && a.len() <= 7 => {
            [pair(a.get(3), 1)?, pair(a.get(4), 0)?, pair(a.get(5), 1)?, groups(a.get(6))?]
        }
        // convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        "aten::convolution.default" if bias_ok && a.len() == 9 => {
            [pair(a.get(3), 1)?, pair(a.get(4), 0)?, pair(a.get(5), 1)?, groups(a.get(8))?]
        }
        _ => return None,
    };
    // Geometry torch's convolution would refuse (a negative padding, a zero stride) stays with
    // torch's convolution, which says why.
    let at_least = |a: &Arg, min: i64| match a {
        Arg::List(items) => items.iter().all(|i| matches!(i, Arg::Int(v) if *v >= min)),
        Arg::Int(v) => *v >= min,
        _ => false,
    };
    let [stride, padding, dilation, groups] = &geometry;
    (at_least(stride, 1) && at_least(padding, 0) && at_least(dilation, 1) && at_least(groups, 1)).then_some(geometry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// conv2d(x, w, b, stride=[2, 2], padding=[1, 1]) then relu_.
    fn doc(mutate: impl FnOnce(&mut serde_json::Value)) -> Document {
        let header = |h: &mut serde_json::Value| {
            let m = &mut h["methods"]["forward"];
            m["ops"] = json!([{"name": "aten::conv2d.default", "schema": null},
                              {"name": "aten::relu_.default", "schema": null}]);
            m["graph"]["inputs"] = json!([
                {"name": "pw", "source": {"weight": "w"}}, {"name": "pb", "source": {"weight": "b"}},
                {"name": "x", "source": {"user": 0}}]);
            m["graph"]["nodes"] = json!([
                {"op": 0, "args": [{"ref": "x"}, {"ref": "pw"}, {"ref": "pb"},
                                   {"list": [{"int": 2}, {"int": 2}]}, {"list": [{"int": 1}]}], "outputs": {"one": "c"}},
                {"op": 1, "args": [{"ref": "c"}], "outputs": {"one": "y"}}]);
            m["graph"]["outputs"] = json!([{"ref": "y"}]);
            h["weights"]["storages"] = json!([{"offset": 0, "nbytes": 96}]);
            h["weights"]["tensors"] = json!({
                "w": {"dtype": "float32", "shape": [4, 1, 2, 2], "strides": [4, 4, 2, 1], "storage": 0},
                "b": {"dtype": "float32", "shape": [4], "strides": [1], "storage": 0, "storage_offset": 16}});
        };
        super::super::tests::document(header, mutate)
    }

    /// [`doc`] with the activation `op` in place of `relu_`, taking `extra` arguments after
    /// its input.
    fn with_activation(op: &str, extra: &serde_json::Value) -> Document {
        doc(|h| {
            let m = &mut h["methods"]["forward"];
            m["ops"][1]["name"] = json!(op);
            let args = m["graph"]["nodes"][1]["args"].as_array_mut().unwrap();
            args.extend(extra.as_array().unwrap().iter().cloned());
        })
    }

    fn ints(v: &[i64]) -> Arg {
        Arg::List(v.iter().map(|&i| Arg::Int(i)).collect())
    }

    #[test]
    fn lowers_a_convolution_and_its_activation() {
        let mut d = doc(|_| {});
        assert_eq!(apply(&mut d, false), 1);
        let m = &d.methods["forward"];
        assert_eq!(m.graph.nodes.len(), 1);
        let n = &m.graph.nodes[0];
        assert_eq!(m.ops[n.op].name, FUSED);
        let expected = [
            Arg::Ref("x".into()),
            Arg::Ref("pw".into()),
            Arg::Ref("pb".into()),
            ints(&[1, 1]),
            ints(&[2, 2]),
            ints(&[1, 1]),
            Arg::Int(1),
            Arg::Str("relu".into()),
            Arg::List(vec![]),
            Arg::None(()),
        ];
        assert_eq!(n.args, expected);
        assert_eq!(n.outputs, crate::schema::Outputs::One("y".into()));
        assert_eq!(apply(&mut d, false), 0, "idempotent");
    }

    #[test]
    fn takes_gelu_with_its_approximation_as_the_algorithm() {
        // (the GELU node's arguments after its input, the fused node's algorithm): ConvNeXt's
        // 1×1 convolution then GELU; an approximation oneDNN lacks stays a node.
        for (extra, algorithm) in
            [(json!([]), Some("none")), (json!([{"str": "tanh"}]), Some("tanh")), (json!([{"str": "sigmoid"}]), None)]
        {
            let mut d = with_activation("aten::gelu.default", &extra);
            assert_eq!(apply(&mut d, false), 1);
            let nodes = &d.methods["forward"].graph.nodes;
            match algorithm {
                Some(a) => {
                    assert_eq!(nodes.len(), 1);
                    assert_eq!(nodes[0].args[7..], [Arg::Str("gelu".into()), Arg::List(vec![]), Arg::Str(a.into())]);
                }
                None => assert_eq!((nodes.len(), &nodes[0].args[7]), (2, &Arg::Str("none".into()))),
            }
        }
    }

    #[test]
    fn takes_relu6_in_either_form_as_hardtanh_with_its_bounds() {
        // `nn.ReLU6` exports as `hardtanh(x, 0, 6)`, `F.relu6` as `relu6(x)`; other bounds stay.
        let f = |v: f64| json!({"float": v});
        for (op, extra, fused) in [
            ("aten::hardtanh.default", json!([{"int": 0}, f(6.0)]), true),
            ("aten::relu6.default", json!([]), true),
            ("aten::relu6_.default", json!([]), true),
            ("aten::hardtanh.default", json!([f(-1.0), f(1.0)]), false),
        ] {
            let mut d = with_activation(op, &extra);
            assert_eq!(apply(&mut d, false), 1);
            let nodes = &d.methods["forward"].graph.nodes;
            let relu6 = Arg::List(vec![Arg::Float(crate::schema::Float(0.0)), Arg::Float(crate::schema::Float(6.0))]);
            if fused {
                assert_eq!(nodes.len(), 1, "{op}");
                assert_eq!(nodes[0].args[7..], [Arg::Str("hardtanh".into()), relu6, Arg::None(())], "{op}");
            } else {
                assert_eq!((nodes.len(), &nodes[0].args[7]), (2, &Arg::Str("none".into())), "{op}");
            }
        }
    }

    #[test]
    fn an_activation_read_elsewhere_stays_a_node() {
        // The conv's output is also a graph output: no post-op, the relu stays.
        let mut d = doc(|h| h["methods"]["forward"]["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "c"}]));
        assert_eq!(apply(&mut d, false), 1);
        let m = &d.methods["forward"];
        assert_eq!(m.graph.nodes.len(), 2);
        assert_eq!(m.graph.nodes[0].args[7], Arg::Str("none".into()));
    }

    #[test]
    fn lowers_a_pointwise_convolution_only_for_the_runtimes_gemm() {
        let one_by_one = |h: &mut serde_json::Value| {
            h["weights"]["tensors"]["w"]["shape"] = json!([4, 4, 1, 1]);
            h["weights"]["tensors"]["w"]["strides"] = json!([4, 1, 1, 1]);
            let args = &mut h["methods"]["forward"]["graph"]["nodes"][0]["args"];
            args[3] = json!({"list": [{"int": 1}]});
            args[4] = json!({"list": [{"int": 0}, {"int": 0}]});
        };
        let mut d = doc(one_by_one);
        assert_eq!(apply(&mut d, false), 0, "without the GEMM, torch's path");
        assert_eq!(apply(&mut d, true), 1);
        let n = &d.methods["forward"].graph.nodes[0];
        assert_eq!((&n.args[3], &n.args[4], &n.args[7]), (&ints(&[0, 0]), &ints(&[1, 1]), &Arg::Str("relu".into())));
        // A strided one is too (the runtime gathers its pixels); a dilated or grouped one isn't.
        let strided = |h: &mut serde_json::Value| {
            one_by_one(h);
            h["methods"]["forward"]["graph"]["nodes"][0]["args"][3] = json!({"list": [{"int": 2}]});
        };
        assert_eq!(apply(&mut doc(strided), true), 1);
        let dilated = json!([{"list": [{"int": 2}]}]);
        let grouped = json!([{"list": [{"int": 1}]}, {"int": 2}]);
        for (case, extra) in [("dilated", dilated), ("grouped", grouped)] {
            let mut d = doc(|h| {
                one_by_one(h);
                let args = h["methods"]["forward"]["graph"]["nodes"][0]["args"].as_array_mut().unwrap();
                args.extend(extra.as_array().unwrap().iter().cloned());
            });
            assert_eq!(apply(&mut d, true), 0, "{case}");
        }
    }

    #[test]
    fn leaves_near_misses_alone() {
        let cases: [fn(&mut serde_json::Value); 5] = [
            // A negative padding: torch's convolution refuses it, with its message.
            |h| h["methods"]["forward"]["graph"]["nodes"][0]["args"][4] = json!({"list": [{"int": -1}]}),
            // A 1×1 kernel: torch's path is as fast.
            |h| h["weights"]["tensors"]["w"]["shape"] = json!([16, 1, 1, 1]),
            // A stride that isn't a literal.
            |h| h["methods"]["forward"]["graph"]["nodes"][0]["args"][3] = json!({"ref": "x"}),
            // State as the weight.
            |h| h["weights"]["tensors"]["w"]["mutable"] = json!(true),
            // Another dtype.
            |h| h["weights"]["tensors"]["w"]["dtype"] = json!("bfloat16"),
        ];
        for (i, case) in cases.into_iter().enumerate() {
            let mut d = doc(case);
            assert_eq!(apply(&mut d, false), 0, "case {i}");
            assert_eq!(d.methods["forward"].graph.nodes.len(), 2, "case {i}");
        }
    }
}
