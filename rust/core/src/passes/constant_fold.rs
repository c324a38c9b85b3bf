//! Constant folding (`fast`): a node whose inputs are all literals, weights the program never
//! writes, or other such nodes' values computes the same tensors on every call. The runtime
//! computes those once, at load, and the rest of the graph reads them as weights. Exported
//! transformers build their attention mask and rotary tables this way, from `arange`s over
//! the traced sizes: a few dozen small ops per call that never change.
//!
//! This module only decides, and splits the graph in two; running the first half needs torch.
//! A node folds when
//! - its op is pure ([`dead_code`](super::dead_code): writes nothing, draws no random
//!   numbers), returns only tensors and doesn't make uninitialized memory (`empty`); or it is
//!   a grad-mode or autocast region whose body holds only such nodes (Llama's rotary table);
//! - it reads no user input and no state;
//! - no graph output or mutation reads its values, since each call must return new tensors;
//! - every node left that reads its values writes nothing and returns no alias of them, so
//!   a folded value is never written, nor handed to the caller through a view.

use std::collections::BTreeMap;

use crate::graph::{plan_frees, visit_slots, SlotArg, SlotGraph, SlotNode, ValueRef};
use crate::hops::{HopCall, HopKind};
use crate::schema::OpEntry;

/// A graph split into what runs once and what runs on every call.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    /// The folded nodes, as a graph of no inputs that returns the values `rest` reads.
    pub once: SlotGraph,
    /// The name `rest` reads each of `once`'s outputs by, as a weight.
    pub names: Vec<String>,
    /// The other nodes, unchanged but for those reads.
    pub rest: SlotGraph,
}

/// Splits `graph`; `None` where nothing folds. `is_state` says which weights the program
/// writes; `name` names a folded value's slot (a name no weight has).
pub fn split(
    graph: &SlotGraph,
    ops: &[OpEntry],
    subgraphs: &BTreeMap<String, SlotGraph>,
    is_state: impl Fn(&str) -> bool,
    name: impl Fn(usize) -> String,
) -> Option<Split> {
    let nodes = &graph.nodes;
    let mut producer = vec![None; graph.n_slots];
    for (i, n) in nodes.iter().enumerate() {
        n.outputs.defined().for_each(|(_, s)| producer[s] = Some(i));
    }
    let mut returned = vec![false; graph.n_slots];
    graph.outputs.iter().for_each(|a| visit_slots(a, &mut |s| returned[s] = true));

    let mut may_fold: Vec<bool> = nodes
        .iter()
        .map(|n| {
            let mut outputs = n.outputs.defined().peekable();
            outputs.peek().is_some() && outputs.all(|(_, s)| !returned[s]) && foldable_op(n, ops, subgraphs)
        })
        .collect();
    // Forward, which nodes read only constants; then drop the producers of values a kept
    // node must not read, and go again until nothing changes.
    let fold = loop {
        let mut fold = vec![false; nodes.len()];
        for (i, n) in nodes.iter().enumerate() {
            let constant = |a: &SlotArg| reads_constants(a, &|s| producer[s].is_some_and(|p| fold[p]), &is_state);
            fold[i] = may_fold[i] && n.args.iter().chain(n.kwargs.iter().map(|(_, a)| a)).all(constant);
        }
        let mut changed = false;
        for (i, n) in nodes.iter().enumerate() {
            if !fold[i] && !safe_reader(n, ops) {
                n.visit_reads(&mut |s| {
                    if let Some(p) = producer[s].filter(|&p| fold[p]) {
                        changed |= std::mem::replace(&mut may_fold[p], false);
                    }
                });
            }
        }
        if !changed {
            break fold;
        }
    };

    let mut needed = vec![false; graph.n_slots];
    for (i, n) in nodes.iter().enumerate() {
        if !fold[i] {
            n.visit_reads(&mut |s| needed[s] |= producer[s].is_some_and(|p| fold[p]));
        }
    }
    let values: Vec<usize> = (0..graph.n_slots).filter(|&s| needed[s]).collect();
    if values.is_empty() {
        return None;
    }
    let names: Vec<String> = values.iter().map(|&s| name(s)).collect();

    let mut once_nodes: Vec<SlotNode> = nodes.iter().zip(&fold).filter(|(_, f)| **f).map(|(n, _)| n.clone()).collect();
    let once_outputs: Vec<SlotArg> = values.iter().map(|&s| SlotArg::Value(ValueRef::Slot(s))).collect();
    plan_frees(&mut once_nodes, &once_outputs, graph.n_slots);
    let once = SlotGraph {
        n_slots: graph.n_slots,
        n_inputs: 0,
        user_inputs: Vec::new(),
        nodes: once_nodes,
        n_user_outputs: once_outputs.len(),
        outputs: once_outputs,
    };

    let weight_of: BTreeMap<usize, &String> = values.iter().copied().zip(&names).collect();
    let mut rest_nodes: Vec<SlotNode> = nodes
        .iter()
        .zip(&fold)
        .filter(|(_, f)| !**f)
        .map(|(n, _)| {
            let mut n = n.clone();
            n.args.iter_mut().chain(n.kwargs.iter_mut().map(|(_, a)| a)).for_each(|a| rewire(a, &weight_of));
            n
        })
        .collect();
    plan_frees(&mut rest_nodes, &graph.outputs, graph.n_slots);
    let rest = SlotGraph { nodes: rest_nodes, ..graph.clone() };
    Some(Split { once, names, rest })
}

/// Whether a node's op may fold: pure, returning tensors, no uninitialized memory; or a
/// grad-mode or autocast region of such nodes.
fn foldable_op(node: &SlotNode, ops: &[OpEntry], subgraphs: &BTreeMap<String, SlotGraph>) -> bool {
    match HopKind::parse(&node.op_name) {
        Some(kind @ (HopKind::SetGradEnabled | HopKind::Autocast)) => {
            let Ok(call) = HopCall::new(kind, node) else { return false };
            call.bodies
                .iter()
                .all(|b| subgraphs.get(*b).is_some_and(|g| g.nodes.iter().all(|n| foldable_op(n, ops, subgraphs))))
        }
        Some(_) => false,
        None => ops.get(node.op).is_some_and(|op| {
            let returns = op.schema.as_deref().and_then(crate::opschema::parse).map(|s| s.returns);
            super::dead_code::pure(op) && returns.is_some_and(only_tensors) && !op.name.contains("empty")
        }),
    }
}

/// Whether a schema's returns are all tensors (`Tensor`, `Tensor[]`, `(Tensor a, Tensor b)`,
/// any of them an alias of an argument), never `None` or a number.
fn only_tensors(returns: &str) -> bool {
    let inner = returns.strip_prefix('(').and_then(|r| r.strip_suffix(')')).unwrap_or(returns);
    !inner.is_empty()
        && inner.split(',').all(|r| {
            let ty = r.split_whitespace().next().unwrap_or("");
            ty.starts_with("Tensor") && !ty.contains('?')
        })
}

/// Whether an argument reads only literals, constant slots and weights that aren't state.
fn reads_constants(a: &SlotArg, constant: &dyn Fn(usize) -> bool, is_state: &dyn Fn(&str) -> bool) -> bool {
    match a {
        SlotArg::Value(ValueRef::Slot(s)) => constant(*s),
        SlotArg::Value(ValueRef::Weight(w)) => !is_state(w),
        SlotArg::Literal(_) => true,
        SlotArg::List(items) => items.iter().all(|i| reads_constants(i, constant, is_state)),
    }
}

/// Whether a node may read a folded value: it writes nothing and returns no alias of what it
/// reads. Nodes a pass made and Python operators carry no schema and return new values;
/// higher-order ops may return an operand.
fn safe_reader(node: &SlotNode, ops: &[OpEntry]) -> bool {
    if HopKind::parse(&node.op_name).is_some() {
        return false;
    }
    match ops.get(node.op).and_then(|o| o.schema.as_deref()) {
        Some(schema) => !schema.contains('!') && !super::readers::returns_alias(schema),
        None => true,
    }
}

/// Reads the folded slots in `a` as their weights.
fn rewire(a: &mut SlotArg, weight_of: &BTreeMap<usize, &String>) {
    match a {
        SlotArg::Value(ValueRef::Slot(s)) => {
            if let Some(w) = weight_of.get(s) {
                *a = SlotArg::Value(ValueRef::Weight((*w).clone()));
            }
        }
        SlotArg::List(items) => items.iter_mut().for_each(|i| rewire(i, weight_of)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{op_names, validate, validate_subgraph};
    use crate::schema::{Graph, Subgraph};
    use serde_json::json;

    fn ops() -> Vec<OpEntry> {
        serde_json::from_value(json!([
            {"name": "aten::arange.default", "schema": "aten::arange(Scalar end, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"},
            {"name": "aten::neg.default", "schema": "aten::neg(Tensor self) -> Tensor"},
            {"name": "aten::mul.Tensor", "schema": "aten::mul.Tensor(Tensor self, Tensor other) -> Tensor"},
            {"name": "aten::view.default", "schema": "aten::view(Tensor(a) self, SymInt[] size) -> Tensor(a)"},
            {"name": "aten::add_.Tensor", "schema": "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)"},
            {"name": "aten::rand_like.default", "schema": "aten::rand_like(Tensor self) -> Tensor"},
            {"name": "aten::new_empty.default", "schema": "aten::new_empty(Tensor self, SymInt[] size) -> Tensor"},
            {"name": "aten::sym_size.int", "schema": "aten::sym_size.int(Tensor self, int dim) -> SymInt"},
            {"name": "higher_order::wrap_with_set_grad_enabled", "schema": null},
            {"name": "aten::split.Tensor", "schema": "aten::split.Tensor(Tensor(a -> *) self, SymInt split_size, int dim=0) -> Tensor(a)[]"}
        ]))
        .unwrap()
    }
    const ARANGE: usize = 0;
    const NEG: usize = 1;
    const MUL: usize = 2;
    const VIEW: usize = 3;
    const ADD_: usize = 4;
    const RAND: usize = 5;
    const EMPTY: usize = 6;
    const SIZE: usize = 7;
    const REGION: usize = 8;

    /// `x` (user leaf 0) and weights `w` and `state`; `nodes` as the file writes them.
    fn graph(nodes: serde_json::Value, outputs: serde_json::Value) -> Graph {
        serde_json::from_value(json!({
            "inputs": [
                {"name": "x", "source": {"user": 0}},
                {"name": "w", "source": {"weight": "w"}},
                {"name": "state", "source": {"weight": "state"}}
            ],
            "nodes": nodes,
            "outputs": outputs,
        }))
        .unwrap()
    }

    fn split_of(g: &Graph, subgraphs: &BTreeMap<String, SlotGraph>) -> Option<Split> {
        let names = op_names(&ops()).unwrap();
        let slots = validate(g, &names, 1, |_| true).unwrap();
        split(&slots, &ops(), subgraphs, |w| w == "state", |s| format!("<folded {s}>"))
    }

    fn op_of(g: &SlotGraph) -> Vec<usize> {
        g.nodes.iter().map(|n| n.op).collect()
    }

    fn weight(name: &str) -> SlotArg {
        SlotArg::Value(ValueRef::Weight(name.into()))
    }

    #[test]
    fn folds_a_chain_of_constants_and_the_rest_reads_it_as_a_weight() {
        let g = graph(
            json!([
                {"op": ARANGE, "args": [{"int": 4}], "outputs": {"one": "a"}},
                {"op": NEG, "args": [{"ref": "a"}], "outputs": {"one": "b"}},
                {"op": MUL, "args": [{"ref": "b"}, {"ref": "w"}], "outputs": {"one": "c"}},
                {"op": MUL, "args": [{"ref": "x"}, {"ref": "c"}], "outputs": {"one": "y"}},
                {"op": MUL, "args": [{"ref": "y"}, {"ref": "b"}], "outputs": {"one": "z"}}
            ]),
            json!([{"ref": "z"}]),
        );
        let s = split_of(&g, &BTreeMap::new()).unwrap();
        assert_eq!(op_of(&s.once), [ARANGE, NEG, MUL]);
        // b (slot 2) and c (slot 3), which the kept nodes read; a is freed where neg reads it.
        assert_eq!(s.names, ["<folded 2>", "<folded 3>"]);
        assert_eq!(s.once.outputs.len(), 2);
        assert_eq!(s.once.nodes[1].free, [1]);
        assert_eq!(s.once.nodes[0].outputs.defined().count(), 1);
        assert_eq!(op_of(&s.rest), [MUL, MUL]);
        assert_eq!(s.rest.nodes[0].args[1], weight("<folded 3>"));
        assert_eq!(s.rest.nodes[1].args[1], weight("<folded 2>"));
        // The folded slots are no one's to free any more; x and y still are.
        let freed: Vec<usize> = s.rest.nodes.iter().flat_map(|n| n.free.clone()).collect();
        assert_eq!(freed, [0, 4]);
        assert_eq!(
            (s.rest.outputs.clone(), s.rest.user_inputs.clone()),
            (vec![SlotArg::Value(ValueRef::Slot(5))], vec![(0, 0)])
        );
    }

    #[test]
    fn inputs_state_draws_and_uninitialized_memory_stay() {
        let g = graph(
            json!([
                {"op": NEG, "args": [{"ref": "x"}], "outputs": {"one": "a"}},
                {"op": NEG, "args": [{"ref": "state"}], "outputs": {"one": "b"}},
                {"op": RAND, "args": [{"ref": "w"}], "outputs": {"one": "c"}},
                {"op": EMPTY, "args": [{"ref": "w"}, {"list": [{"int": 2}]}], "outputs": {"one": "d"}},
                {"op": SIZE, "args": [{"ref": "w"}, {"int": 0}], "outputs": {"one": "e"}},
                {"op": MUL, "args": [{"ref": "a"}, {"ref": "b"}], "outputs": {"one": "f"}},
                {"op": MUL, "args": [{"ref": "c"}, {"ref": "d"}], "outputs": {"one": "g"}},
                {"op": VIEW, "args": [{"ref": "f"}, {"list": [{"ref": "e"}]}], "outputs": {"one": "h"}}
            ]),
            json!([{"ref": "g"}, {"ref": "h"}]),
        );
        assert_eq!(split_of(&g, &BTreeMap::new()), None);
    }

    #[test]
    fn a_returned_value_is_made_on_each_call_from_folded_inputs() {
        let g = graph(
            json!([
                {"op": ARANGE, "args": [{"int": 4}], "outputs": {"one": "a"}},
                {"op": NEG, "args": [{"ref": "a"}], "outputs": {"one": "b"}}
            ]),
            json!([{"ref": "b"}, {"ref": "x"}]),
        );
        let s = split_of(&g, &BTreeMap::new()).unwrap();
        assert_eq!((op_of(&s.once), op_of(&s.rest)), (vec![ARANGE], vec![NEG]));
    }

    #[test]
    fn a_reader_that_writes_or_aliases_keeps_its_producer() {
        for (reader, second) in [(ADD_, json!({"ref": "x"})), (VIEW, json!({"list": [{"ref": "n"}]}))] {
            let g = graph(
                json!([
                    {"op": ARANGE, "args": [{"int": 4}], "outputs": {"one": "a"}},
                    {"op": NEG, "args": [{"ref": "a"}], "outputs": {"one": "b"}},
                    {"op": NEG, "args": [{"ref": "x"}], "outputs": {"one": "y"}},
                    {"op": SIZE, "args": [{"ref": "x"}, {"int": 0}], "outputs": {"one": "n"}},
                    {"op": reader, "args": [{"ref": "b"}, second], "outputs": {"one": "c"}},
                    {"op": MUL, "args": [{"ref": "c"}, {"ref": "y"}], "outputs": {"one": "z"}}
                ]),
                json!([{"ref": "z"}]),
            );
            // `b` would be written, or aliased by a view of a size known only on the call:
            // it is made on each call, from the folded `a`.
            let s = split_of(&g, &BTreeMap::new()).unwrap();
            assert_eq!((op_of(&s.once), op_of(&s.rest)), (vec![ARANGE], vec![NEG, NEG, SIZE, reader, MUL]));
        }
    }

    #[test]
    fn a_pure_grad_mode_region_of_constants_folds_and_one_that_draws_doesnt() {
        for (body_op, folds) in [(NEG, true), (RAND, false)] {
            let names = op_names(&ops()).unwrap();
            let body = Subgraph {
                inputs: vec!["p".into()],
                nodes: serde_json::from_value(
                    json!([{"op": body_op, "args": [{"ref": "p"}], "outputs": {"one": "q"}}]),
                )
                .unwrap(),
                outputs: serde_json::from_value(json!([{"ref": "q"}])).unwrap(),
            };
            let subgraphs = BTreeMap::from([("body".to_owned(), validate_subgraph(&body, &names, "body").unwrap())]);
            let g = graph(
                json!([
                    {"op": REGION, "args": [{"bool": false}, {"subgraph": "body"}, {"ref": "w"}], "outputs": {"many": ["r"]}},
                    {"op": MUL, "args": [{"ref": "x"}, {"ref": "r"}], "outputs": {"one": "y"}}
                ]),
                json!([{"ref": "y"}]),
            );
            let s = split_of(&g, &subgraphs);
            assert_eq!(s.map(|s| op_of(&s.once)), folds.then(|| vec![REGION]));
        }
    }

    #[test]
    fn returns_of_tensors_only() {
        for (r, ok) in [
            ("Tensor", true),
            ("Tensor(a)[]", true),
            ("(Tensor values, Tensor indices)", true),
            ("Tensor?", false),
            ("SymInt", false),
            ("()", false),
            ("(Tensor, int)", false),
        ] {
            assert_eq!(only_tensors(r), ok, "{r}");
        }
    }
}
