//! Linears that read one input as one GEMM (`optimize="fast"`, at load, on CUDA with CUDA
//! graphs). An attention block projects its input three times (query, key, value) and a gated
//! MLP twice (gate, up):
//!
//! ```text
//! q = linear(x, wq, bq); k = linear(x, wk, bk); v = linear(x, wv, bv)
//! ```
//!
//! At batch 1 on a GPU each product is a small GEMM that fills the device poorly, and a launch.
//! They become one product over the weights stacked along their output features, and slices of
//! its last dimension, each bound to the name the linear's output had:
//!
//! ```text
//! w = cat([wq, wk, wv], 0); b = cat([bq, bk, bv], 0); y = linear(x, w, b)
//! q = slice(y, -1, 0, nq); k = slice(y, -1, nq, nq + nk); v = slice(y, -1, nq + nk, n)
//! ```
//!
//! The `cat`s read only weights, so constant folding makes the stacked weights once at load.
//! Each slice is the columns of its linear's output, computed by the same dot products in a
//! wider GEMM: equal but for the order cuBLAS sums in, which may differ with the wider shape
//! (float32 rounding).
//!
//! Linears join when they read the same value, their weights (and biases: all or none) are
//! 2-D float weights of the file of one dtype that the program never writes, no node between
//! the first and the last writes anything or is a higher-order op (which could change the
//! input between the reads), and nothing writes through their outputs (a slice shares its
//! storage with the others', and a view of it may be a copy where a view of the linear's
//! output wasn't).

use std::collections::{BTreeMap, HashMap};

use super::emit::{value_names, Emit};
use super::pass::{Ctx, Pass};
use super::readers::{may_write, one, returns_alias, weight_inputs, Readers, OUTSIDE};
use super::{Level, Target};
use crate::schema::{Arg, Method, Node, OpEntry, Outputs, Weights};

const LINEAR: &str = "aten::linear.default";
const CAT: &str = "aten::cat.default";
const SLICE: &str = "aten::slice.Tensor";

/// Linears to join: their node indices (the first is replaced, the others dropped), the input
/// they share, their weights' and biases' graph inputs, and each one's output name and
/// output features.
#[derive(Debug)]
struct Group {
    members: Vec<usize>,
    input: String,
    weights: Vec<String>,
    biases: Option<Vec<String>>,
    parts: Vec<(String, i64)>,
}

/// A linear that may join others: its input, weight, bias (graph input names), output name,
/// and what must match: whether it has a bias, its weight's dtype and input features.
struct Candidate<'m> {
    input: &'m str,
    weight: &'m str,
    bias: Option<&'m str>,
    output: &'m str,
    features: i64,
    key: Key<'m>,
}

/// What linears must share to join: their input, whether they have a bias, their weights'
/// dtype and input features.
type Key<'m> = (&'m str, bool, &'m str, i64);

/// Joins each group of linears of the method's top-level graph; returns how many linears
/// were dropped into another.
fn rewrite(m: &mut Method, readers: &Readers, weights: &Weights) -> usize {
    let groups = find(m, readers, weights);
    if groups.is_empty() {
        return 0;
    }
    let mut names = value_names(&m.graph);
    let mut at = HashMap::new();
    let mut removed = vec![false; m.graph.nodes.len()];
    let mut dropped = 0;
    for g in groups {
        let refs = |names: &[String]| Arg::List(names.iter().map(|n| Arg::Ref(n.clone())).collect());
        let mut e = Emit::new(&mut m.ops, &mut names, format!("{}_joined", g.parts[0].0));
        let mut args = vec![Arg::Ref(g.input), e.call(CAT, vec![refs(&g.weights), Arg::Int(0)], &[])];
        if let Some(biases) = &g.biases {
            args.push(e.call(CAT, vec![refs(biases), Arg::Int(0)], &[]));
        }
        let y = e.call(LINEAR, args, &[]);
        let mut start = 0;
        for (name, features) in g.parts {
            let bounds = vec![y.clone(), Arg::Int(-1), Arg::Int(start), Arg::Int(start + features)];
            e.bind(SLICE, bounds, &[], Outputs::One(name));
            start += features;
        }
        at.insert(g.members[0], e.nodes);
        for &i in &g.members[1..] {
            removed[i] = true;
            dropped += 1;
        }
    }
    super::splice_nodes(&mut m.graph.nodes, at, &removed);
    dropped
}

/// Every group of two or more linears that may join, in graph order.
fn find<'a>(m: &'a Method, readers: &Readers, weights: &'a Weights) -> Vec<Group> {
    let nodes = &m.graph.nodes;
    let weight_of = weight_inputs(&m.graph);
    // A 2-D (`rows` given: 1-D of that many) float weight the program never writes: its dtype
    // and shape.
    let tensor = |input: &str, rows: Option<i64>| {
        let t = weights.tensors.get(*weight_of.get(input)?)?;
        let float = matches!(t.dtype.as_str(), "float32" | "bfloat16" | "float16");
        let shaped = match rows {
            None => t.shape.len() == 2,
            Some(n) => t.shape == [n],
        };
        (float && shaped && !t.mutable).then_some(t)
    };
    let candidate = |i: usize| -> Option<Candidate<'a>> {
        let n = &nodes[i];
        if m.ops.get(n.op)?.name != LINEAR || !n.kwargs.is_empty() {
            return None;
        }
        let (Some(Arg::Ref(input)), Some(Arg::Ref(weight))) = (n.args.first(), n.args.get(1)) else { return None };
        let w = tensor(weight, None)?;
        let bias = match n.args.get(2) {
            None | Some(Arg::None(())) => None,
            Some(Arg::Ref(b)) if tensor(b, Some(w.shape[0])).is_some_and(|t| t.dtype == w.dtype) => Some(b.as_str()),
            Some(_) => return None,
        };
        if n.args.len() > 3 {
            return None;
        }
        let output = one(n)?;
        if written_through(m, readers, output) {
            return None;
        }
        let key = (input.as_str(), bias.is_some(), w.dtype.as_str(), w.shape[1]);
        Some(Candidate { input, weight, bias, output, features: w.shape[0], key })
    };

    // Writing (or higher-order) nodes before each index: linears with one between can't join.
    let mut writes_before = Vec::with_capacity(nodes.len() + 1);
    writes_before.push(0usize);
    for n in nodes {
        let w = m.ops.get(n.op).is_none_or(may_write);
        writes_before.push(writes_before.last().unwrap() + usize::from(w));
    }
    let mut open: BTreeMap<Key<'a>, Vec<(usize, Candidate<'a>)>> = BTreeMap::new();
    for i in 0..nodes.len() {
        if let Some(c) = candidate(i) {
            open.entry(c.key).or_default().push((i, c));
        }
    }
    let mut groups = Vec::new();
    for (_, found) in open {
        // Split where a writing node lies between neighbours.
        let mut run: Vec<(usize, Candidate<'_>)> = Vec::new();
        for (i, c) in found {
            if run.last().is_some_and(|(j, _)| writes_before[i] != writes_before[j + 1]) {
                groups.extend(group(std::mem::take(&mut run)));
            }
            run.push((i, c));
        }
        groups.extend(group(run));
    }
    groups.sort_by_key(|g| g.members[0]);
    groups
}

/// A run of candidates as a group, if there are two or more.
fn group(run: Vec<(usize, Candidate<'_>)>) -> Option<Group> {
    let first = &run.first()?.1;
    (run.len() >= 2).then(|| Group {
        input: first.input.to_owned(),
        biases: first.bias.map(|_| run.iter().filter_map(|(_, c)| c.bias.map(str::to_owned)).collect()),
        weights: run.iter().map(|(_, c)| c.weight.to_owned()).collect(),
        parts: run.iter().map(|(_, c)| (c.output.to_owned(), c.features)).collect(),
        members: run.iter().map(|(i, _)| *i).collect(),
    })
}

/// Whether a node writes `v`, or a value that may alias it (a view's, followed through): the
/// readers of `v` and of every aliasing value made from it.
fn written_through(m: &Method, readers: &Readers, v: &str) -> bool {
    let mut todo = vec![v];
    let mut seen = std::collections::HashSet::new();
    while let Some(v) = todo.pop() {
        if !seen.insert(v) {
            continue;
        }
        for &j in readers.get(v).map(Vec::as_slice).unwrap_or(&[]) {
            if j == OUTSIDE {
                continue;
            }
            let n = &m.graph.nodes[j];
            let Some(op) = m.ops.get(n.op) else { return true };
            if writes_value(op, n, v) {
                return true;
            }
            // A view's output aliases its input: follow it. A schema says; an op a pass
            // inserted (`reshape` for `view`, a slice) may return a view.
            let aliases = match op.schema.as_deref() {
                Some(s) => returns_alias(s),
                None => op.name.starts_with("aten::"),
            };
            if aliases {
                todo.extend(n.outputs.names());
            }
        }
    }
    false
}

/// Whether node `n` of `op` may write `v`: passes it where its schema marks a write (a KV
/// cache's `index_copy_` writes the cache, not the key it reads); without a schema, as the
/// first argument of an aten op torch names in place (which writes only `self`: the
/// `index_copy_` `inplace_state` makes), or to any other op that may write.
fn writes_value(op: &OpEntry, n: &Node, v: &str) -> bool {
    let reads = |a: &Arg| {
        let mut found = false;
        a.for_each_ref(&mut |r| found |= r == v);
        found
    };
    let Some(schema) = op.schema.as_deref().and_then(crate::opschema::parse) else {
        let in_place =
            op.name.strip_prefix("aten::").is_some_and(|n| n.split('.').next().is_some_and(|b| b.ends_with('_')));
        return match in_place {
            true => n.args.first().is_some_and(reads) || n.kwargs.values().any(reads),
            false => may_write(op),
        };
    };
    let positional = schema.args.iter().filter(|d| **d != "*");
    let by_position = n.args.iter().zip(positional).any(|(a, d)| reads(a) && d.contains('!'));
    let by_name = n.kwargs.iter().any(|(k, a)| {
        reads(a) && schema.args.iter().any(|d| d.rsplit(' ').next() == Some(k.as_str()) && d.contains('!'))
    });
    // More arguments than the schema declares: nothing says where they go.
    by_position || by_name || (n.args.len() > schema.args.len() && may_write(op))
}

/// The pass (`fast`, on CUDA with CUDA graphs).
pub struct LinearConcat;

impl Pass for LinearConcat {
    fn name(&self) -> &'static str {
        "linear_concat"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.cuda_graphs
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, readers, weights| rewrite(m, readers, weights))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::readers::readers;
    use serde_json::json;

    /// Weights `w{i}` (`[4 + i, 8]` float32) and biases `b{i}`, a state weight `s` and a
    /// bfloat16 `h`; `x` and `r` user inputs; `nodes` over ops linear, reshape, relu, add_ and
    /// a schema-less `index_copy_`.
    fn method(nodes: serde_json::Value, outputs: serde_json::Value) -> (Method, Weights) {
        let mut inputs = vec![json!({"name": "x", "source": {"user": 0}}), json!({"name": "r", "source": {"user": 1}})];
        let mut tensors = serde_json::Map::new();
        let mut tensor = |name: &str, dtype: &str, shape: Vec<i64>, mutable: bool| {
            inputs.push(json!({"name": name, "source": {"weight": format!("p.{name}")}}));
            let t = json!({"dtype": dtype, "shape": shape, "strides": [1], "storage": 0, "mutable": mutable});
            tensors.insert(format!("p.{name}"), t);
        };
        for i in 0..3 {
            tensor(&format!("w{i}"), "float32", vec![4 + i, 8], false);
            tensor(&format!("b{i}"), "float32", vec![4 + i], false);
        }
        tensor("s", "float32", vec![4, 8], true);
        tensor("h", "bfloat16", vec![4, 8], false);
        let m = json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": LINEAR, "schema": "s"},
                    {"name": "aten::reshape.default", "schema": null},
                    {"name": "aten::relu.default", "schema": "aten::relu(Tensor self) -> Tensor"},
                    {"name": "aten::add_.Tensor", "schema": "aten::add_.Tensor(Tensor(a!) self, Tensor other) -> Tensor(a!)"},
                    {"name": "aten::index_copy_.default", "schema": null}],
            "graph": {"inputs": inputs, "nodes": nodes, "outputs": outputs}
        });
        let weights = json!({"storages": [], "tensors": tensors});
        (serde_json::from_value(m).unwrap(), serde_json::from_value(weights).unwrap())
    }

    fn linear(x: &str, w: &str, b: Option<&str>, out: &str) -> serde_json::Value {
        let mut args = vec![json!({"ref": x}), json!({"ref": w})];
        args.extend(b.map(|b| json!({"ref": b})));
        json!({"op": 0, "args": args, "outputs": {"one": out}})
    }

    fn node(op: usize, args: &[&str], out: &str) -> serde_json::Value {
        let args: Vec<_> = args.iter().map(|a| json!({"ref": a})).collect();
        json!({"op": op, "args": args, "outputs": {"one": out}})
    }

    fn run(m: &mut Method, w: &Weights) -> usize {
        let r = readers(&m.graph);
        rewrite(m, &r, w)
    }

    fn names(m: &Method) -> Vec<&str> {
        m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect()
    }

    fn refs(names: &[&str]) -> Arg {
        Arg::List(names.iter().map(|n| Arg::Ref((*n).into())).collect())
    }

    #[test]
    fn three_projections_of_one_input_become_one_linear_and_slices() {
        let (mut m, w) = method(
            json!([
                linear("x", "w0", Some("b0"), "q"),
                node(1, &["q"], "q4"),
                linear("x", "w1", Some("b1"), "k"),
                node(1, &["k"], "k4"),
                linear("x", "w2", Some("b2"), "v"),
                node(2, &["v"], "v2")
            ]),
            json!([{"ref": "q4"}, {"ref": "k4"}, {"ref": "v2"}]),
        );
        assert_eq!(run(&mut m, &w), 2);
        assert_eq!(
            names(&m),
            [
                CAT,
                CAT,
                LINEAR,
                SLICE,
                SLICE,
                SLICE,
                "aten::reshape.default",
                "aten::reshape.default",
                "aten::relu.default"
            ]
        );
        let n = &m.graph.nodes;
        assert_eq!(n[0].args, [refs(&["w0", "w1", "w2"]), Arg::Int(0)]);
        assert_eq!(n[1].args, [refs(&["b0", "b1", "b2"]), Arg::Int(0)]);
        let (wc, bc) = (one(&n[0]).unwrap(), one(&n[1]).unwrap());
        assert_eq!(n[2].args, [Arg::Ref("x".into()), Arg::Ref(wc.into()), Arg::Ref(bc.into())]);
        let y = Arg::Ref(one(&n[2]).unwrap().into());
        // Output features 4, 5 and 6, in order, each slice bound to its linear's name.
        for (s, (name, start, end)) in n[3..6].iter().zip([("q", 0, 4), ("k", 4, 9), ("v", 9, 15)]) {
            assert_eq!(s.args, [y.clone(), Arg::Int(-1), Arg::Int(start), Arg::Int(end)]);
            assert_eq!(one(s), Some(name));
        }
        assert_eq!(run(&mut m, &w), 0, "nothing is found twice");
    }

    #[test]
    fn unbiased_linears_join_without_a_bias_and_biased_ones_apart() {
        let (mut m, w) = method(
            json!([
                linear("x", "w0", None, "g"),
                linear("x", "w1", Some("b1"), "a"),
                linear("x", "w2", None, "u"),
                linear("x", "w0", Some("b0"), "c"),
                node(2, &["g"], "gs")
            ]),
            json!([{"ref": "gs"}, {"ref": "u"}, {"ref": "a"}, {"ref": "c"}]),
        );
        assert_eq!(run(&mut m, &w), 2);
        assert_eq!(names(&m), [CAT, LINEAR, SLICE, SLICE, CAT, CAT, LINEAR, SLICE, SLICE, "aten::relu.default"]);
        assert_eq!(m.graph.nodes[1].args.len(), 2, "no bias");
        let bound: Vec<_> = m.graph.nodes.iter().filter_map(|n| one(n)).filter(|o| o.len() == 1).collect();
        assert_eq!(bound, ["g", "u", "a", "c"]);
    }

    #[test]
    fn an_output_written_into_a_cache_joins() {
        // `add_(r, k)` writes `r` (as `index_copy_` writes a KV cache), not the key it reads.
        let (mut m, w) = method(
            json!([linear("x", "w0", None, "q"), linear("x", "w1", None, "k"), node(3, &["r", "k"], "r2")]),
            json!([{"ref": "q"}, {"ref": "r2"}]),
        );
        assert_eq!(run(&mut m, &w), 1);
        // The same where the in-place op has no schema yet (`inplace_state`'s `index_copy_`).
        let (mut m, w) = method(
            json!([linear("x", "w0", None, "q"), linear("x", "w1", None, "k"), node(4, &["r", "k"], "r2")]),
            json!([{"ref": "q"}, {"ref": "r2"}]),
        );
        assert_eq!(run(&mut m, &w), 1);
        // ... but not where it writes the output.
        let (mut m, w) = method(
            json!([linear("x", "w0", None, "q"), linear("x", "w1", None, "k"), node(4, &["k", "r"], "k2")]),
            json!([{"ref": "q"}, {"ref": "k2"}]),
        );
        assert_eq!(run(&mut m, &w), 0);
    }

    #[test]
    fn leaves_near_misses_alone() {
        let cases: Vec<serde_json::Value> = vec![
            // Different inputs.
            json!([linear("x", "w0", None, "a"), linear("r", "w1", None, "b")]),
            // A write between the two reads of x.
            json!([linear("x", "w0", None, "a"), node(3, &["x", "r"], "x2"), linear("x", "w1", None, "b")]),
            // A weight the program writes, and one of another dtype.
            json!([linear("x", "w0", None, "a"), linear("x", "s", None, "b"), linear("x", "h", None, "c")]),
            // A write through one output's view.
            json!([
                linear("x", "w0", None, "a"),
                node(1, &["a"], "a2"),
                node(3, &["a2", "r"], "a3"),
                linear("x", "w1", None, "b")
            ]),
            // A bias that isn't the weight's (`b1` has 5 features, `w0` 4).
            json!([linear("x", "w0", Some("b1"), "a"), linear("x", "w1", Some("b1"), "b")]),
        ];
        for nodes in cases {
            let outputs: Vec<_> =
                nodes.as_array().unwrap().iter().map(|n| json!({"ref": n["outputs"]["one"].clone()})).collect();
            let (mut m, w) = method(nodes.clone(), json!(outputs));
            let before = m.graph.nodes.clone();
            assert_eq!(run(&mut m, &w), 0, "{nodes}");
            assert_eq!(m.graph.nodes, before);
        }
    }

    #[test]
    fn runs_only_with_cuda_graphs() {
        assert!(LinearConcat.runs_for(Target { cuda_graphs: true, ..Target::default() }));
        assert!(!LinearConcat.runs_for(Target { onednn: true, gemm: true, in_place: true, cuda_graphs: false }));
    }
}
