//! Dead code: nodes whose values nothing reads, and torch.export's metadata assertions.
//! Removing them changes no value a call returns or writes (every level applies it).
//!
//! - A node is dead when no later node, graph output or mutation reads any of its outputs and
//!   its op is pure: an `aten`/`prims` op whose recorded schema writes nothing (no `!`) and
//!   that draws no random numbers (dropping a draw would shift the generator's stream).
//! - `aten::_assert_tensor_metadata` checks an intermediate's dtype and device against the
//!   trace's. Those follow from the inputs' dtypes and devices, which every call's input
//!   checks enforce, and from the device a program is placed on, to which the graph's device
//!   literals move with it: the assertion can't fail, and costs a dispatch per node.

use std::collections::HashSet;

use super::pass::{Ctx, Pass};
use super::Level;
use crate::schema::{Arg, Method, Node, OpEntry};

/// Assertions that can't fail on a checked call (see the module docs).
const REDUNDANT_ASSERTIONS: &[&str] = &["aten::_assert_tensor_metadata.default"];

/// Name fragments of ops that draw random numbers.
const RANDOM: &[&str] = &[
    "rand",
    "dropout",
    "bernoulli",
    "normal",
    "uniform",
    "multinomial",
    "poisson",
    "exponential",
    "geometric",
    "cauchy",
];

/// Removes dead nodes and redundant assertions from a method's graph and subgraphs; returns
/// how many nodes went.
pub fn apply(m: &mut Method) -> usize {
    let ops = m.ops.clone();
    let mut removed =
        prune(&mut m.graph.nodes, &ops, m.graph.outputs.iter().chain(m.graph.mutations.iter().map(|w| &w.value)));
    for sub in m.subgraphs.values_mut() {
        removed += prune(&mut sub.nodes, &ops, sub.outputs.iter());
    }
    removed
}

fn prune<'a>(nodes: &mut Vec<Node>, ops: &[OpEntry], roots: impl Iterator<Item = &'a Arg>) -> usize {
    let before = nodes.len();
    let mut read: HashSet<String> = HashSet::new();
    roots.for_each(|a| a.for_each_ref(&mut |r| _ = read.insert(r.to_owned())));
    // Backwards: a node's reads count only if the node stays.
    let mut keep = vec![true; nodes.len()];
    for (i, n) in nodes.iter().enumerate().rev() {
        let op = ops.get(n.op);
        let assertion = op.is_some_and(|o| REDUNDANT_ASSERTIONS.contains(&o.name.as_str()));
        let unread = n.outputs.names().all(|o| !read.contains(o));
        let has_outputs = n.outputs.names().next().is_some();
        if assertion || (has_outputs && unread && op.is_some_and(pure)) {
            keep[i] = false;
            continue;
        }
        n.args.iter().chain(n.kwargs.values()).for_each(|a| a.for_each_ref(&mut |r| _ = read.insert(r.to_owned())));
    }
    let mut i = 0;
    nodes.retain(|_| {
        i += 1;
        keep[i - 1]
    });
    before - nodes.len()
}

/// Whether an op neither writes its arguments nor draws random numbers.
pub(crate) fn pure(op: &OpEntry) -> bool {
    let namespace_ok = op.name.starts_with("aten::") || op.name.starts_with("prims::");
    let writes = op.schema.as_deref().is_none_or(|s| s.contains('!'));
    namespace_ok && !writes && !RANDOM.iter().any(|r| op.name.contains(r))
}

/// The pass, at every level: dead code first, so the patterns see each value's real readers.
pub struct DeadCode;

impl Pass for DeadCode {
    fn name(&self) -> &'static str {
        "dead_code"
    }

    fn level(&self) -> Level {
        Level::Exact
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, _, _| apply(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Outputs;
    use serde_json::json;

    fn method(nodes: serde_json::Value, ops: serde_json::Value) -> Method {
        serde_json::from_value(json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": ops,
            "graph": {"inputs": [{"name": "x", "source": {"user": 0}}], "nodes": nodes, "outputs": [{"ref": "y"}]}
        }))
        .unwrap()
    }

    fn ops() -> serde_json::Value {
        json!([
            {"name": "aten::relu.default", "schema": "aten::relu(Tensor self) -> Tensor"},
            {"name": "aten::_assert_tensor_metadata.default", "schema": "aten::_assert_tensor_metadata(Tensor a, *, SymInt[]? size=None, SymInt[]? stride=None, ScalarType? dtype=None, Device? device=None, Layout? layout=None) -> ()"},
            {"name": "aten::add_.Tensor", "schema": "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)"},
            {"name": "aten::rand_like.default", "schema": "aten::rand_like(Tensor self) -> Tensor"},
            {"name": "aten::_assert_async.msg", "schema": "aten::_assert_async.msg(Tensor self, str assert_msg) -> ()"},
            {"name": "aten::neg.default", "schema": null}
        ])
    }

    #[test]
    fn removes_unread_pure_chains_and_metadata_assertions() {
        let mut m = method(
            json!([
                {"op": 0, "args": [{"ref": "x"}], "outputs": {"one": "a"}},
                {"op": 0, "args": [{"ref": "a"}], "outputs": {"one": "b"}},
                {"op": 1, "args": [{"ref": "x"}], "kwargs": {"dtype": {"dtype": "float32"}}, "outputs": {"none": null}},
                {"op": 0, "args": [{"ref": "x"}], "outputs": {"one": "y"}}
            ]),
            ops(),
        );
        assert_eq!(apply(&mut m), 3);
        assert_eq!(m.graph.nodes.len(), 1);
        assert_eq!(m.graph.nodes[0].outputs, Outputs::One("y".into()));
    }

    #[test]
    fn keeps_writes_draws_side_effects_and_unknown_schemas() {
        let mut m = method(
            json!([
                {"op": 2, "args": [{"ref": "x"}, {"ref": "x"}], "outputs": {"one": "w"}},
                {"op": 3, "args": [{"ref": "x"}], "outputs": {"one": "r"}},
                {"op": 4, "args": [{"ref": "x"}, {"str": "no"}], "outputs": {"none": null}},
                {"op": 5, "args": [{"ref": "x"}], "outputs": {"one": "n"}},
                {"op": 0, "args": [{"ref": "x"}], "outputs": {"one": "y"}}
            ]),
            ops(),
        );
        assert_eq!(apply(&mut m), 0);
        assert_eq!(m.graph.nodes.len(), 5);
    }
}
