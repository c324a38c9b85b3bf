//! State written in place. torch.export functionalizes a write into a buffer (a static KV
//! cache's `index_copy_`) into an out-of-place `index_copy` whose result the runtime copies
//! back into the state after the call: two full copies of the cache per call where the model
//! wrote one row. Where the graph reads the old value only through that node, running the
//! node in place on the state tensor computes the same values (`index_copy` is a clone, then
//! `index_copy_`) and leaves nothing to copy back.
//!
//! Safe when, for the weight `w` the mutation writes with the value of node `N`:
//! - `N` is `OUT_OF_PLACE[i].0` with `w`'s graph input as its first argument;
//! - nothing else reads `w`'s graph input (no view of the old value outlives the write);
//! - no user output is `N`'s value or a view of it (the caller would hold the live state).
//!
//! A call that fails after `N` ran leaves `N`'s rows written (docs/format.md, state).

use std::collections::HashSet;

use super::pass::{Ctx, Pass};
use super::{Level, Target};
use crate::schema::{Arg, InputSource, Method, MutationTarget, OpEntry};

/// Out-of-place ops and the in-place op that computes their value into their first argument.
const OUT_OF_PLACE: &[(&str, &str)] = &[
    ("aten::index_copy.default", "aten::index_copy_.default"),
    ("aten::index_put.default", "aten::index_put_.default"),
];

/// Ops whose output may alias their first argument.
const VIEWS: &[&str] = &[
    "aten::alias.default",
    "aten::slice.Tensor",
    "aten::select.int",
    "aten::view.default",
    "aten::_unsafe_view.default",
    "aten::reshape.default",
    "aten::transpose.int",
    "aten::permute.default",
    "aten::expand.default",
    "aten::unsqueeze.default",
    "aten::squeeze.dim",
    "aten::squeeze.dims",
    "aten::squeeze.default",
    "aten::t.default",
    "aten::narrow.default",
    "aten::as_strided.default",
    "aten::unflatten.int",
    "aten::flatten.using_ints",
    "aten::split.Tensor",
    "aten::split_with_sizes.default",
    "aten::chunk.default",
    "aten::unbind.int",
    "aten::detach.default",
    "aten::diagonal.default",
    "aten::contiguous.default",
];

/// Rewrites each state write that is safe to run in place (see the module docs) to its
/// in-place op, and returns the weights so written, in mutation order: their new values need
/// no copy back.
pub fn apply(m: &mut Method) -> Vec<String> {
    let mut written = Vec::new();
    for i in 0..m.graph.mutations.len() {
        let mutation = &m.graph.mutations[i];
        let (MutationTarget::Weight(weight), Arg::Ref(value)) = (&mutation.target, &mutation.value) else {
            continue;
        };
        let Some(node) = candidate(m, weight, value) else { continue };
        let (_, inplace) =
            OUT_OF_PLACE.iter().find(|(op, _)| *op == m.ops[m.graph.nodes[node].op].name).copied().unwrap_or_default();
        let op = match m.ops.iter().position(|o| o.name == inplace) {
            Some(op) => op,
            None => {
                m.ops.push(OpEntry { name: inplace.to_owned(), schema: None });
                m.ops.len() - 1
            }
        };
        m.graph.nodes[node].op = op;
        written.push(weight.clone());
    }
    written
}

/// The node whose value `value` is, if writing `weight` with it can run in place.
fn candidate(m: &Method, weight: &str, value: &str) -> Option<usize> {
    let input = m.graph.inputs.iter().find(|i| matches!(&i.source, InputSource::Weight(w) if w == weight))?;
    let node = m.graph.nodes.iter().position(|n| n.outputs.names().any(|o| o == value))?;
    let n = &m.graph.nodes[node];
    let op = &m.ops.get(n.op)?.name;
    if !OUT_OF_PLACE.iter().any(|(o, _)| o == op) || n.args.first() != Some(&Arg::Ref(input.name.clone())) {
        return None;
    }
    let other_readers = m
        .graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != node)
        .any(|(_, n)| n.args.iter().chain(n.kwargs.values()).any(|a| a.reads(&input.name)));
    let read_by_itself_again = n.args[1..].iter().chain(n.kwargs.values()).any(|a| a.reads(&input.name));
    let mut returned = m.graph.outputs.iter().chain(m.graph.mutations.iter().map(|w| &w.value));
    if other_readers || read_by_itself_again || returned.any(|a| a.reads(&input.name)) {
        return None;
    }
    // The value and its views: none may be a user output.
    let mut aliases: HashSet<&str> = HashSet::from([value]);
    for n in &m.graph.nodes[node + 1..] {
        let is_view = m.ops.get(n.op).is_some_and(|o| VIEWS.contains(&o.name.as_str()));
        if is_view && n.args.first().is_some_and(|a| aliases.iter().any(|v| a.reads(v))) {
            aliases.extend(n.outputs.names());
        }
    }
    let user_outputs = &m.graph.outputs;
    if user_outputs.iter().any(|a| aliases.iter().any(|v| a.reads(v))) {
        return None;
    }
    Some(node)
}

/// The pass, at every level where the loader decides it (`Target::in_place`): the weights
/// each method writes in place go to `Rewrites::in_place`.
pub struct InplaceState;

impl Pass for InplaceState {
    fn name(&self) -> &'static str {
        "inplace_state"
    }

    fn level(&self) -> Level {
        Level::Exact
    }

    fn runs_for(&self, target: Target) -> bool {
        target.in_place
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        let mut written = std::collections::BTreeMap::<String, Vec<String>>::new();
        let made = cx.each_method(|name, m, _, _| {
            let weights = apply(m);
            let n = weights.len();
            written.insert(name.to_owned(), weights);
            n
        });
        for (name, weights) in written {
            cx.rewrites.in_place.entry(name).or_default().extend(weights);
        }
        made
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A cache `c` written at `pos` with `x`, read back through the write's value.
    fn method(mutate: impl FnOnce(&mut serde_json::Value)) -> Method {
        let mut m = json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": "aten::index_copy.default", "schema": "s"}, {"name": "aten::slice.Tensor", "schema": "s"},
                    {"name": "aten::mul.Tensor", "schema": "s"}],
            "graph": {
                "inputs": [{"name": "c", "source": {"weight": "cache"}}, {"name": "x", "source": {"user": 0}},
                           {"name": "pos", "source": {"user": 1}}],
                "nodes": [
                    {"op": 0, "args": [{"ref": "c"}, {"int": 0}, {"ref": "pos"}, {"ref": "x"}], "outputs": {"one": "new"}},
                    {"op": 1, "args": [{"ref": "new"}, {"int": 0}, {"int": 0}, {"int": 2}], "outputs": {"one": "head"}},
                    {"op": 2, "args": [{"ref": "head"}, {"ref": "head"}], "outputs": {"one": "y"}}],
                "outputs": [{"ref": "y"}],
                "mutations": [{"target": {"weight": "cache"}, "value": {"ref": "new"}}]}
        });
        mutate(&mut m);
        serde_json::from_value(m).unwrap()
    }

    #[test]
    fn a_cache_write_read_only_through_its_value_runs_in_place() {
        let mut m = method(|_| {});
        assert_eq!(apply(&mut m), ["cache"]);
        assert_eq!(m.ops[m.graph.nodes[0].op].name, "aten::index_copy_.default");
        assert_eq!(m.ops[m.graph.nodes[0].op].schema, None);
        assert_eq!(m.ops.len(), 4);
    }

    #[test]
    fn refuses_when_the_old_value_or_a_view_of_the_new_escapes() {
        // Another node reads the old cache.
        let mut m = method(|m| m["graph"]["nodes"][2]["args"][1] = json!({"ref": "c"}));
        assert!(apply(&mut m).is_empty());
        // A view of the new cache is returned to the caller.
        let mut m = method(|m| m["graph"]["outputs"] = json!([{"ref": "head"}]));
        assert!(apply(&mut m).is_empty());
        // The new cache itself is returned.
        let mut m = method(|m| m["graph"]["outputs"] = json!([{"ref": "new"}]));
        assert!(apply(&mut m).is_empty());
        // Not an op with an in-place twin.
        let mut m = method(|m| m["ops"][0]["name"] = json!("aten::add.Tensor"));
        assert!(apply(&mut m).is_empty());
        // The op writes another tensor than the state.
        let mut m = method(|m| m["graph"]["nodes"][0]["args"][0] = json!({"ref": "x"}));
        assert!(apply(&mut m).is_empty());
        assert_eq!(m.ops.len(), 3);
    }
}
