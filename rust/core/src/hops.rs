//! Higher-order ops: nodes that run subgraphs, as torch.export produces them: `cond`
//! (data-dependent control flow, `torch.cond`), `wrap_with_set_grad_enabled` and
//! `wrap_with_autocast` (a `torch.no_grad()` or `torch.autocast(...)` region, as in Llama's
//! rotary embedding), and the loops `map_impl`, `scan`, `while_loop` and `associative_scan`.
//! A file names them `higher_order::<name>` in its op table.
//!
//! Argument layouts, checked at load against the subgraphs they name:
//!
//! - `cond(pred, true_graph, false_graph, [operands...])`: `pred` a value or a bool; both
//!   branches take the operands and return as many values;
//! - `wrap_with_set_grad_enabled(enabled: bool, body, *operands)`;
//! - `wrap_with_autocast(device_type: str, dtype: dtype | None, enabled: bool,
//!   cache_enabled: bool | None, body, *operands)`;
//! - `map_impl(body, [xs...], [args...])`: `body(x_i..., args...)` for each row `i` of the
//!   `xs` (their dim 0), its returns stacked;
//! - `scan(combine, [init...], [xs...], [additional...])`: `combine(carry..., x_i...,
//!   additional...)` returns the next carry then this row's outputs; the node returns the
//!   last carry, then each output stacked;
//! - `while_loop(cond, body, [carried...], [additional...])`: `body(carried...,
//!   additional...)` returns the next carried values while `cond` of them returns true;
//! - `associative_scan(combine, [xs...], [additional...])`: the running `combine(acc...,
//!   x_i..., additional...)` over the rows of the `xs`, each step's values stacked.

use std::collections::{BTreeMap, HashMap};

use crate::error::{Error, HopProblem, Result};
use crate::graph::{OpName, SlotArg, SlotGraph, SlotNode, SlotOutputs};
use crate::schema::Arg;

/// The op table's namespace for higher-order ops.
pub const NAMESPACE: &str = "higher_order";

/// A higher-order op kwexport runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HopKind {
    /// `torch.cond`.
    Cond,
    /// A `torch.set_grad_enabled` / `torch.no_grad` region.
    SetGradEnabled,
    /// A `torch.autocast` region.
    Autocast,
    /// `torch._higher_order_ops.map`: a body per row.
    Map,
    /// `torch._higher_order_ops.scan`.
    Scan,
    /// `torch._higher_order_ops.while_loop`.
    WhileLoop,
    /// `torch._higher_order_ops.associative_scan`.
    AssociativeScan,
}

impl HopKind {
    /// The higher-order op an op-table name stands for; `None` for anything else.
    pub fn parse(op: &OpName) -> Option<HopKind> {
        if op.namespace != NAMESPACE || op.overload.is_some() {
            return None;
        }
        Some(match op.name.as_str() {
            "cond" => HopKind::Cond,
            "wrap_with_set_grad_enabled" => HopKind::SetGradEnabled,
            "wrap_with_autocast" => HopKind::Autocast,
            "map_impl" => HopKind::Map,
            "scan" => HopKind::Scan,
            "while_loop" => HopKind::WhileLoop,
            "associative_scan" => HopKind::AssociativeScan,
            _ => return None,
        })
    }

    /// The names of the higher-order ops kwexport runs.
    pub const NAMES: &'static [&'static str] = &[
        "cond",
        "wrap_with_set_grad_enabled",
        "wrap_with_autocast",
        "map_impl",
        "scan",
        "while_loop",
        "associative_scan",
    ];
}

/// A higher-order op's node with its arguments sorted out.
#[derive(Debug, Clone, PartialEq)]
pub struct HopCall<'a> {
    /// Which op.
    pub kind: HopKind,
    /// The literal arguments before the subgraphs (`enabled`; `device_type`, `dtype`,
    /// `enabled`, `cache_enabled`); for `cond`, the predicate.
    pub params: &'a [SlotArg],
    /// The subgraphs it may run: the body, `cond`'s true and false branches, or
    /// `while_loop`'s condition and body.
    pub bodies: Vec<&'a str>,
    /// The values the node passes, in the layout's groups: one group (the operands) for
    /// `cond` and the regions; `[xs, args]` for `map_impl`; `[init, xs, additional]` for
    /// `scan`; `[carried, additional]` for `while_loop`; `[xs, additional]` for
    /// `associative_scan`.
    pub groups: Vec<&'a [SlotArg]>,
}

impl HopCall<'_> {
    /// Every value the node passes, group after group.
    pub fn operands(&self) -> impl Iterator<Item = &SlotArg> {
        self.groups.iter().flat_map(|g| g.iter())
    }

    /// How many values each subgraph takes.
    pub fn body_inputs(&self) -> usize {
        let n: Vec<usize> = self.groups.iter().map(|g| g.len()).collect();
        match self.kind {
            // The accumulated values and the next row's, then the additional inputs.
            HopKind::AssociativeScan => 2 * n[0] + n[1],
            _ => n.iter().sum(),
        }
    }

    /// Which subgraphs' returns are the node's (`while_loop`'s condition returns its
    /// predicate); each returns as many values.
    pub fn result_bodies(&self) -> std::ops::Range<usize> {
        match self.kind {
            HopKind::WhileLoop => 1..2,
            _ => 0..self.bodies.len(),
        }
    }

    /// How many values subgraph `i` must return, where the layout fixes it.
    fn body_outputs(&self, i: usize) -> Option<usize> {
        match (self.kind, i) {
            (HopKind::WhileLoop, 0) => Some(1),
            (HopKind::WhileLoop, _) => Some(self.groups[0].len()),
            (HopKind::AssociativeScan, _) => Some(self.groups[0].len()),
            _ => None,
        }
    }
}

impl<'a> HopCall<'a> {
    /// Splits a node's arguments by the op's layout.
    pub fn new(kind: HopKind, node: &'a SlotNode) -> std::result::Result<Self, HopProblem> {
        let args = node.args.as_slice();
        if !node.kwargs.is_empty() {
            return Err(HopProblem::Layout(layout(kind)));
        }
        let subgraph = |a: &'a SlotArg| match a {
            SlotArg::Literal(Arg::Subgraph(name)) => Some(name.as_str()),
            _ => None,
        };
        let lit = |a: &SlotArg, ok: fn(&Arg) -> bool| matches!(a, SlotArg::Literal(l) if ok(l));
        let bad = || HopProblem::Layout(layout(kind));
        Ok(match kind {
            HopKind::Cond => {
                let [pred, t, f, SlotArg::List(operands)] = args else { return Err(bad()) };
                let pred_ok = matches!(pred, SlotArg::Value(_)) || lit(pred, |l| matches!(l, Arg::Bool(_)));
                let (Some(t), Some(f), true) = (subgraph(t), subgraph(f), pred_ok) else { return Err(bad()) };
                HopCall { kind, params: &args[..1], bodies: vec![t, f], groups: vec![operands] }
            }
            HopKind::SetGradEnabled => {
                let [enabled, body, ..] = args else { return Err(bad()) };
                let (true, Some(body)) = (lit(enabled, |l| matches!(l, Arg::Bool(_))), subgraph(body)) else {
                    return Err(bad());
                };
                HopCall { kind, params: &args[..1], bodies: vec![body], groups: vec![&args[2..]] }
            }
            HopKind::Autocast => {
                let [device, dtype, enabled, cache, body, ..] = args else { return Err(bad()) };
                let ok = lit(device, |l| matches!(l, Arg::Str(_)))
                    && lit(dtype, |l| matches!(l, Arg::Dtype(_) | Arg::None(())))
                    && lit(enabled, |l| matches!(l, Arg::Bool(_)))
                    && lit(cache, |l| matches!(l, Arg::Bool(_) | Arg::None(())));
                let (true, Some(body)) = (ok, subgraph(body)) else { return Err(bad()) };
                HopCall { kind, params: &args[..4], bodies: vec![body], groups: vec![&args[5..]] }
            }
            HopKind::Map | HopKind::Scan | HopKind::WhileLoop | HopKind::AssociativeScan => {
                let n_bodies = if kind == HopKind::WhileLoop { 2 } else { 1 };
                let bodies = args.iter().take(n_bodies).map(subgraph).collect::<Option<Vec<_>>>().ok_or_else(bad)?;
                let groups = args[n_bodies.min(args.len())..]
                    .iter()
                    .map(|a| match a {
                        SlotArg::List(items) => Some(items.as_slice()),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(bad)?;
                let want = match kind {
                    HopKind::Scan => 3,
                    _ => 2,
                };
                // The loops run over rows of their `xs` (`while_loop` over nothing): one at least.
                let xs = match kind {
                    HopKind::Map | HopKind::AssociativeScan => groups.first(),
                    HopKind::Scan => groups.get(1),
                    _ => None,
                };
                if bodies.len() != n_bodies || groups.len() != want || xs.is_some_and(|x| x.is_empty()) {
                    return Err(bad());
                }
                HopCall { kind, params: &[], bodies, groups }
            }
        })
    }
}

fn names_subgraph(a: &SlotArg) -> bool {
    match a {
        SlotArg::Literal(Arg::Subgraph(_)) => true,
        SlotArg::List(items) => items.iter().any(names_subgraph),
        _ => false,
    }
}

fn layout(kind: HopKind) -> &'static str {
    match kind {
        HopKind::Cond => "cond(pred, true_graph, false_graph, [operands...])",
        HopKind::SetGradEnabled => "wrap_with_set_grad_enabled(enabled: bool, body, *operands)",
        HopKind::Autocast => {
            "wrap_with_autocast(device_type: str, dtype, enabled: bool, cache_enabled: bool | None, body, *operands)"
        }
        HopKind::Map => "map_impl(body, [xs...], [args...]) with at least one xs",
        HopKind::Scan => "scan(combine, [init...], [xs...], [additional...]) with at least one xs",
        HopKind::WhileLoop => "while_loop(cond, body, [carried...], [additional...])",
        HopKind::AssociativeScan => "associative_scan(combine, [xs...], [additional...]) with at least one xs",
    }
}

/// Checks every higher-order node of the main graph and the subgraphs against the subgraphs
/// it runs, that only higher-order nodes name subgraphs, and that no subgraph runs itself.
pub fn check(main: &SlotGraph, subgraphs: &BTreeMap<String, SlotGraph>) -> Result<()> {
    let mut uses: HashMap<&str, Vec<&str>> = HashMap::new();
    let all = std::iter::once(("", main)).chain(subgraphs.iter().map(|(k, v)| (k.as_str(), v)));
    for (graph_name, graph) in all {
        for (i, node) in graph.nodes.iter().enumerate() {
            let at = || {
                let graph =
                    if graph_name.is_empty() { "graph".to_owned() } else { format!("subgraphs[{graph_name:?}]") };
                format!("{graph}.nodes[{i}] ({})", node.op_name)
            };
            let err = |problem| Error::Hop { at: at(), problem };
            let Some(kind) = HopKind::parse(&node.op_name) else {
                if node.args.iter().chain(node.kwargs.iter().map(|(_, a)| a)).any(names_subgraph) {
                    return Err(err(HopProblem::NotHigherOrder));
                }
                continue;
            };
            let call = HopCall::new(kind, node).map_err(err)?;
            let mut shape = None;
            for (b, body) in call.bodies.iter().enumerate() {
                let sub = subgraphs.get(*body).ok_or_else(|| err(HopProblem::UnknownSubgraph(body.to_string())))?;
                if sub.n_inputs != call.body_inputs() {
                    return Err(err(HopProblem::OperandCount {
                        subgraph: body.to_string(),
                        takes: sub.n_inputs,
                        given: call.body_inputs(),
                    }));
                }
                let carry = if kind == HopKind::Scan { call.groups[0].len() } else { 0 };
                if sub.outputs.len() < carry {
                    return Err(err(HopProblem::Returns {
                        subgraph: body.to_string(),
                        returns: sub.outputs.len(),
                        want: carry,
                    }));
                }
                if let Some(n) = call.body_outputs(b).filter(|&n| n != sub.outputs.len()) {
                    return Err(err(HopProblem::Returns {
                        subgraph: body.to_string(),
                        returns: sub.outputs.len(),
                        want: n,
                    }));
                }
                uses.entry(graph_name).or_default().push(body);
                if !call.result_bodies().contains(&b) {
                    continue;
                }
                let this = (sub.n_inputs, sub.outputs.len());
                if shape.is_some_and(|s| s != this) {
                    return Err(err(HopProblem::BranchesDiffer));
                }
                shape = Some(this);
                let outputs_fit = match &node.outputs {
                    SlotOutputs::None => true,
                    SlotOutputs::One(_) => false,
                    SlotOutputs::Many(slots) => slots.len() <= sub.outputs.len(),
                };
                if !outputs_fit {
                    return Err(err(HopProblem::Outputs { subgraph: body.to_string(), returns: sub.outputs.len() }));
                }
            }
        }
    }
    // A subgraph that runs itself, directly or not, would never end.
    fn visit<'g>(
        name: &'g str,
        uses: &HashMap<&'g str, Vec<&'g str>>,
        state: &mut HashMap<&'g str, bool>,
    ) -> std::result::Result<(), String> {
        match state.get(name) {
            Some(true) => return Ok(()),
            Some(false) => return Err(name.to_owned()),
            None => {}
        }
        state.insert(name, false);
        for next in uses.get(name).into_iter().flatten() {
            visit(next, uses, state)?;
        }
        state.insert(name, true);
        Ok(())
    }
    let mut state = HashMap::new();
    for name in subgraphs.keys() {
        visit(name, &uses, &mut state)
            .map_err(|name| Error::Hop { at: format!("subgraphs[{name:?}]"), problem: HopProblem::Recursive })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ValueRef;

    fn node(name: &str, args: Vec<SlotArg>, outputs: usize) -> SlotNode {
        SlotNode {
            op: 0,
            op_name: std::sync::Arc::new(OpName::parse(&format!("higher_order::{name}")).unwrap()),
            args,
            kwargs: vec![],
            outputs: SlotOutputs::Many((0..outputs).map(Some).collect()),
            free: vec![],
        }
    }
    fn sub(name: &str) -> SlotArg {
        SlotArg::Literal(Arg::Subgraph(name.into()))
    }
    fn slot(i: usize) -> SlotArg {
        SlotArg::Value(ValueRef::Slot(i))
    }
    fn graph(n_inputs: usize, n_outputs: usize, nodes: Vec<SlotNode>) -> SlotGraph {
        SlotGraph {
            n_slots: 8,
            n_inputs,
            user_inputs: (0..n_inputs).map(|i| (i, i)).collect(),
            nodes,
            outputs: (0..n_outputs).map(slot).collect(),
            n_user_outputs: n_outputs,
        }
    }

    #[test]
    fn checks_layouts_and_subgraphs() {
        let ok = |main: SlotNode, subs: Vec<(&str, SlotGraph)>| {
            let subgraphs: BTreeMap<String, SlotGraph> = subs.into_iter().map(|(n, g)| (n.to_owned(), g)).collect();
            check(&graph(1, 1, vec![main]), &subgraphs).map_err(|e| e.to_string())
        };
        let grad = node("wrap_with_set_grad_enabled", vec![SlotArg::Literal(Arg::Bool(false)), sub("b"), slot(0)], 2);
        ok(grad.clone(), vec![("b", graph(1, 2, vec![]))]).unwrap();
        assert_eq!(
            ok(grad.clone(), vec![("b", graph(2, 2, vec![]))]).unwrap_err(),
            "graph.nodes[0] (higher_order::wrap_with_set_grad_enabled): subgraph \"b\" takes 2 inputs, given 1"
        );
        assert!(ok(grad.clone(), vec![]).unwrap_err().contains("no subgraph \"b\""));
        let cond = node("cond", vec![slot(0), sub("t"), sub("f"), SlotArg::List(vec![slot(0)])], 1);
        ok(cond.clone(), vec![("t", graph(1, 1, vec![])), ("f", graph(1, 1, vec![]))]).unwrap();
        assert!(ok(cond, vec![("t", graph(1, 1, vec![])), ("f", graph(1, 2, vec![]))])
            .unwrap_err()
            .contains("branches take or return different numbers"));
        let bad = node("wrap_with_set_grad_enabled", vec![sub("b"), slot(0)], 1);
        assert!(ok(bad, vec![("b", graph(1, 1, vec![]))])
            .unwrap_err()
            .contains("expected wrap_with_set_grad_enabled("));
        // A subgraph that runs itself.
        let loop_node =
            node("wrap_with_set_grad_enabled", vec![SlotArg::Literal(Arg::Bool(true)), sub("b"), slot(0)], 2);
        assert!(ok(grad, vec![("b", graph(1, 2, vec![loop_node]))]).unwrap_err().contains("runs itself"));
    }

    #[test]
    fn checks_the_loops() {
        let ok = |main: SlotNode, subs: Vec<(&str, SlotGraph)>| {
            let subgraphs: BTreeMap<String, SlotGraph> = subs.into_iter().map(|(n, g)| (n.to_owned(), g)).collect();
            check(&graph(1, 1, vec![main]), &subgraphs).map_err(|e| e.to_string())
        };
        let list = |n: usize| SlotArg::List(vec![slot(0); n]);
        // map_impl(body, [xs], [args]): the body takes a row of each xs, then the args.
        let map = node("map_impl", vec![sub("b"), list(2), list(1)], 2);
        ok(map.clone(), vec![("b", graph(3, 2, vec![]))]).unwrap();
        assert!(ok(map, vec![("b", graph(2, 2, vec![]))]).unwrap_err().contains("takes 2 inputs, given 3"));
        // scan(combine, [init], [xs], [additional]): returns the carry first.
        let scan = node("scan", vec![sub("b"), list(2), list(1), list(0)], 3);
        ok(scan.clone(), vec![("b", graph(3, 3, vec![]))]).unwrap();
        assert!(ok(scan, vec![("b", graph(3, 1, vec![]))])
            .unwrap_err()
            .contains("returns 1 values, where the op needs 2"));
        // while_loop(cond, body, [carried], [additional]): cond returns one value, body the carried.
        let w = node("while_loop", vec![sub("c"), sub("b"), list(2), list(1)], 2);
        ok(w.clone(), vec![("c", graph(3, 1, vec![])), ("b", graph(3, 2, vec![]))]).unwrap();
        assert!(ok(w, vec![("c", graph(3, 1, vec![])), ("b", graph(3, 3, vec![]))]).unwrap_err().contains("needs 2"));
        // associative_scan(combine, [xs], [additional]): two rows of each xs, then the additional.
        let a = node("associative_scan", vec![sub("b"), list(2), list(1)], 2);
        ok(a.clone(), vec![("b", graph(5, 2, vec![]))]).unwrap();
        assert!(ok(a, vec![("b", graph(3, 2, vec![]))]).unwrap_err().contains("takes 3 inputs, given 5"));
        let no_rows = node("map_impl", vec![sub("b"), list(0), list(1)], 1);
        assert!(ok(no_rows, vec![("b", graph(1, 1, vec![]))]).unwrap_err().contains("with at least one xs"));
    }
}
