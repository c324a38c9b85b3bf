//! Graph validation: turns the parsed graph into a [`SlotGraph`], once, at load.
//!
//! Every value is defined exactly once and before its first use (so the graph is acyclic by
//! construction), every weight and user leaf it names exists, and each slot knows the node
//! after which nothing reads it, so the interpreter frees values at their last use.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{Error, GraphProblem, Result};
use crate::schema::{Arg, Graph, InputSource, OpEntry, Outputs};

/// A parsed op name such as `aten::add.Tensor`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OpName {
    /// `aten`, `prims`, `operator`, or a custom library's namespace.
    pub namespace: String,
    /// The op's name within it.
    pub name: String,
    /// `None` for plain Python callables such as `operator::mul`.
    pub overload: Option<String>,
}

impl OpName {
    /// Parses `namespace::name[.overload]`; `None` unless every part is an identifier.
    pub fn parse(s: &str) -> Option<OpName> {
        let (ns, rest) = s.split_once("::")?;
        let (name, overload) = match rest.split_once('.') {
            Some((n, o)) => (n, Some(o.to_owned())),
            None => (rest, None),
        };
        let ident = |t: &str| !t.is_empty() && t.chars().all(|c| c == '_' || c.is_ascii_alphanumeric());
        (ident(ns) && ident(name) && overload.as_deref().is_none_or(ident)).then(|| OpName {
            namespace: ns.to_owned(),
            name: name.to_owned(),
            overload,
        })
    }
}

impl OpName {
    /// Whether this is one of the torch ops outside the default namespaces that a load-time
    /// pass inserts ([`crate::tables::PASS_OPS`]).
    pub fn is_pass_op(&self) -> bool {
        !crate::tables::DEFAULT_NAMESPACES.contains(&self.namespace.as_str())
            && crate::tables::PASS_OPS.contains(&self.to_string().as_str())
    }

    /// Whether this is one of torch's quantize and dequantize ops the format knows
    /// ([`crate::tables::QUANT_OPS`]).
    pub fn is_quant_op(&self) -> bool {
        crate::tables::QUANT_OPS.contains(&self.to_string().as_str())
    }
}

impl std::fmt::Display for OpName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}::{}", self.namespace, self.name)?;
        if let Some(o) = &self.overload {
            write!(f, ".{o}")?;
        }
        Ok(())
    }
}

/// A resolved reference to a value.
#[derive(Debug, Clone, PartialEq)]
pub enum ValueRef {
    /// A runtime value: a user input or a node output.
    Slot(usize),
    /// A weight, by its name in `weights.tensors`.
    Weight(String),
}

/// An argument with its references resolved.
#[derive(Debug, Clone, PartialEq)]
pub enum SlotArg {
    /// A graph value.
    Value(ValueRef),
    /// A literal (anything but `Ref` and `List`).
    Literal(Arg),
    /// A list of these.
    List(Vec<SlotArg>),
}

/// The slots a node's returns go to; `None` where no one reads a return.
#[derive(Debug, Clone, PartialEq)]
pub enum SlotOutputs {
    /// The node binds nothing.
    None,
    /// Its one return.
    One(Option<usize>),
    /// Each return of a tuple- or list-returning op.
    Many(Vec<Option<usize>>),
}

impl SlotOutputs {
    /// `(return position, slot)` for each output someone reads.
    pub fn defined(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let slots: &[Option<usize>] = match self {
            SlotOutputs::None => &[],
            SlotOutputs::One(s) => std::slice::from_ref(s),
            SlotOutputs::Many(slots) => slots,
        };
        slots.iter().enumerate().filter_map(|(i, s)| s.map(|s| (i, s)))
    }
}

/// A node with its values resolved to slots.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotNode {
    /// Index into the document's `ops` table.
    pub op: usize,
    /// That op's name, shared with the op table.
    pub op_name: Arc<OpName>,
    /// Positional arguments.
    pub args: Vec<SlotArg>,
    /// Keyword arguments, in the file's (sorted) order.
    pub kwargs: Vec<(String, SlotArg)>,
    /// Where its returns go.
    pub outputs: SlotOutputs,
    /// Slots read for the last time by this node.
    pub free: Vec<usize>,
}

impl SlotNode {
    /// Calls `f` with each slot the node reads.
    pub fn visit_reads(&self, f: &mut impl FnMut(usize)) {
        self.args.iter().chain(self.kwargs.iter().map(|(_, a)| a)).for_each(|a| visit_slots(a, f));
    }
}

/// A validated graph whose values live in numbered slots.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotGraph {
    /// How many slots a run needs.
    pub n_slots: usize,
    /// How many leaves the graph is run on (user leaves; a subgraph's positional inputs).
    pub n_inputs: usize,
    /// `(slot, user leaf index)` for each user input the graph reads.
    pub user_inputs: Vec<(usize, usize)>,
    /// The nodes, in execution order.
    pub nodes: Vec<SlotNode>,
    /// The flat outputs, then the new values of the mutations' targets.
    pub outputs: Vec<SlotArg>,
    /// How many of `outputs` are user outputs; the rest are mutations, in `graph.mutations`'
    /// order.
    pub n_user_outputs: usize,
}

/// Parses every entry of the op table; nodes share the names.
pub fn op_names(ops: &[OpEntry]) -> Result<Vec<Arc<OpName>>> {
    let mut seen = std::collections::HashSet::new();
    ops.iter()
        .enumerate()
        .map(|(i, e)| {
            if !seen.insert(e.name.as_str()) {
                return Err(Error::DuplicateOp { index: i, name: e.name.clone() });
            }
            OpName::parse(&e.name)
                .map(Arc::new)
                .ok_or_else(|| Error::MalformedOpName { index: i, name: e.name.clone() })
        })
        .collect()
}

/// Validates `graph` against the op table, the number of user leaves and the weight names.
pub fn validate<'g>(
    graph: &'g Graph,
    ops: &[Arc<OpName>],
    n_leaves: usize,
    has_weight: impl Fn(&str) -> bool,
) -> Result<SlotGraph> {
    let mut defs: HashMap<&'g str, ValueRef> = HashMap::new();
    let mut n_slots = 0;
    let mut user_inputs = Vec::new();
    let mut leaf_used = vec![false; n_leaves];

    for (i, input) in graph.inputs.iter().enumerate() {
        let err = |problem| Error::Graph { at: format!("graph.inputs[{i}] ({:?})", input.name), problem };
        let value = match &input.source {
            InputSource::Weight(w) => {
                if !has_weight(w) {
                    return Err(err(GraphProblem::UnknownWeight(w.clone())));
                }
                ValueRef::Weight(w.clone())
            }
            InputSource::User(leaf) => {
                match leaf_used.get_mut(*leaf) {
                    None => return Err(err(GraphProblem::LeafOutOfRange { leaf: *leaf, leaves: n_leaves })),
                    Some(true) => return Err(err(GraphProblem::LeafBoundTwice(*leaf))),
                    Some(used) => *used = true,
                }
                user_inputs.push((n_slots, *leaf));
                n_slots += 1;
                ValueRef::Slot(n_slots - 1)
            }
        };
        if defs.insert(&input.name, value).is_some() {
            return Err(err(GraphProblem::InputDefinedTwice));
        }
    }

    let mut nodes = Vec::with_capacity(graph.nodes.len());
    for (i, node) in graph.nodes.iter().enumerate() {
        let op_name = ops.get(node.op).cloned().ok_or_else(|| Error::Graph {
            at: format!("graph.nodes[{i}]"),
            problem: GraphProblem::UnknownOp { op: node.op, ops: ops.len() },
        })?;
        // Only formatted on error: this loop runs once per node of every load.
        let what = || format!("graph.nodes[{i}] ({op_name})");
        let args = node.args.iter().map(|a| resolve(a, &defs, &what)).collect::<Result<Vec<_>>>()?;
        let kwargs =
            node.kwargs.iter().map(|(k, a)| Ok((k.clone(), resolve(a, &defs, &what)?))).collect::<Result<Vec<_>>>()?;
        let mut define = |name: &'g str| -> Result<usize> {
            let slot = n_slots;
            if defs.insert(name, ValueRef::Slot(slot)).is_some() {
                return Err(Error::Graph { at: what(), problem: GraphProblem::DefinedTwice(name.to_owned()) });
            }
            n_slots += 1;
            Ok(slot)
        };
        let outputs = match &node.outputs {
            Outputs::None(()) => SlotOutputs::None,
            Outputs::One(name) => SlotOutputs::One(Some(define(name)?)),
            Outputs::Many(names) => SlotOutputs::Many(
                names.iter().map(|n| n.as_deref().map(&mut define).transpose()).collect::<Result<_>>()?,
            ),
        };
        nodes.push(SlotNode { op: node.op, op_name, args, kwargs, outputs, free: Vec::new() });
    }

    let outputs = graph
        .outputs
        .iter()
        .map(|a| resolve(a, &defs, &|| "graph.outputs".to_owned()))
        .chain(graph.mutations.iter().map(|m| resolve(&m.value, &defs, &|| "graph.mutations".to_owned())))
        .collect::<Result<Vec<_>>>()?;

    plan_frees(&mut nodes, &outputs, n_slots);
    Ok(SlotGraph { n_slots, n_inputs: n_leaves, user_inputs, nodes, outputs, n_user_outputs: graph.outputs.len() })
}

/// Sets each node's `free` list: the slots it reads for the last time (outputs are read
/// "after" every node, so never freed early); and drops outputs no one reads. Run again
/// whenever a pass removes or rewires nodes.
pub fn plan_frees(nodes: &mut [SlotNode], outputs: &[SlotArg], n_slots: usize) {
    let mut last_use: Vec<Option<usize>> = vec![None; n_slots];
    for (s, node) in nodes.iter().enumerate() {
        node.visit_reads(&mut |slot| last_use[slot] = Some(s));
    }
    let mut is_output = vec![false; n_slots];
    for a in outputs {
        visit_slots(a, &mut |slot| is_output[slot] = true);
    }
    nodes.iter_mut().for_each(|n| n.free.clear());
    for (slot, last) in last_use.iter().enumerate() {
        if let (Some(s), false) = (last, is_output[slot]) {
            nodes[*s].free.push(slot);
        }
    }
    // A node output no one reads is dropped right away.
    for node in nodes {
        let unread = |slot: &mut Option<usize>| {
            if let Some(s) = *slot {
                if last_use[s].is_none() && !is_output[s] {
                    *slot = None;
                }
            }
        };
        match &mut node.outputs {
            SlotOutputs::One(slot) => unread(slot),
            SlotOutputs::Many(slots) => slots.iter_mut().for_each(unread),
            SlotOutputs::None => {}
        }
    }
}

fn resolve(arg: &Arg, defs: &HashMap<&str, ValueRef>, what: &dyn Fn() -> String) -> Result<SlotArg> {
    Ok(match arg {
        Arg::Ref(name) => SlotArg::Value(
            defs.get(name.as_str())
                .cloned()
                .ok_or_else(|| Error::Graph { at: what(), problem: GraphProblem::Undefined(name.clone()) })?,
        ),
        Arg::List(items) => SlotArg::List(items.iter().map(|a| resolve(a, defs, what)).collect::<Result<_>>()?),
        literal => SlotArg::Literal(literal.clone()),
    })
}

/// Validates a subgraph: its inputs are its positional arguments, in order.
pub fn validate_subgraph(sub: &crate::schema::Subgraph, ops: &[Arc<OpName>], name: &str) -> Result<SlotGraph> {
    let graph = Graph {
        inputs: sub
            .inputs
            .iter()
            .enumerate()
            .map(|(i, n)| crate::schema::GraphInput { name: n.clone(), source: InputSource::User(i) })
            .collect(),
        nodes: sub.nodes.clone(),
        outputs: sub.outputs.clone(),
        mutations: Vec::new(),
    };
    validate(&graph, ops, sub.inputs.len(), |_| false).map_err(|e| match e {
        Error::Graph { at, problem } => Error::Graph { at: format!("subgraphs[{name:?}]: {at}"), problem },
        other => other,
    })
}

/// Calls `f` with each slot `arg` reads.
pub fn visit_slots(arg: &SlotArg, f: &mut impl FnMut(usize)) {
    match arg {
        SlotArg::Value(ValueRef::Slot(s)) => f(*s),
        SlotArg::List(items) => items.iter().for_each(|a| visit_slots(a, f)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{GraphInput, Node};

    fn input(name: &str, source: InputSource) -> GraphInput {
        GraphInput { name: name.into(), source }
    }
    fn node(op: usize, args: Vec<Arg>, out: &str) -> Node {
        Node { op, args, kwargs: Default::default(), outputs: Outputs::One(out.into()) }
    }
    fn ops() -> Vec<Arc<OpName>> {
        ["aten::mul.Tensor", "aten::add.Tensor", "aten::neg.default"]
            .iter()
            .map(|o| Arc::new(OpName::parse(o).unwrap()))
            .collect()
    }
    fn r(n: &str) -> Arg {
        Arg::Ref(n.into())
    }

    #[test]
    fn plans_slots_and_frees_at_last_use() {
        let g = Graph {
            inputs: vec![input("w", InputSource::Weight("fc.weight".into())), input("x", InputSource::User(0))],
            nodes: vec![
                node(0, vec![r("x"), r("w")], "a"),
                node(1, vec![r("a"), Arg::List(vec![r("x")])], "b"),
                node(2, vec![r("b")], "unused"),
            ],
            outputs: vec![r("b")],
            mutations: vec![],
        };
        let p = validate(&g, &ops(), 1, |w| w == "fc.weight").unwrap();
        assert_eq!(p.user_inputs, vec![(0, 0)]);
        assert_eq!(p.nodes[0].args[1], SlotArg::Value(ValueRef::Weight("fc.weight".into())));
        assert_eq!(p.nodes[0].free, Vec::<usize>::new());
        assert_eq!(p.nodes[1].free, vec![0, 1]); // x and a, both last read by step 1
        assert_eq!(p.nodes[2].outputs, SlotOutputs::One(None)); // never read
        assert_eq!(p.nodes[2].free, Vec::<usize>::new()); // b is an output
    }

    #[test]
    fn rejects_bad_graphs() {
        let err = |g: Graph| validate(&g, &ops(), 1, |_| false).unwrap_err().to_string();
        let g = Graph {
            inputs: vec![input("x", InputSource::User(0))],
            nodes: vec![node(2, vec![r("y")], "y")],
            outputs: vec![],
            mutations: vec![],
        };
        assert!(err(g).contains("used before it is defined"));
        let g = Graph {
            inputs: vec![input("x", InputSource::User(0))],
            nodes: vec![node(2, vec![r("x")], "x")],
            outputs: vec![],
            mutations: vec![],
        };
        assert!(err(g).contains("defined twice"));
        let g =
            Graph { inputs: vec![input("x", InputSource::User(3))], nodes: vec![], outputs: vec![], mutations: vec![] };
        assert!(err(g).contains("out of range"));
        let g = Graph {
            inputs: vec![input("w", InputSource::Weight("nope".into()))],
            nodes: vec![],
            outputs: vec![],
            mutations: vec![],
        };
        assert!(err(g).contains("not in weights.tensors"));
        let g = Graph { inputs: vec![], nodes: vec![node(7, vec![], "a")], outputs: vec![], mutations: vec![] };
        assert!(err(g).contains("op 7 is not in the op table"));
        let table = [OpEntry { name: "aten add".into(), schema: None }];
        assert!(op_names(&table).unwrap_err().to_string().contains("malformed op name"));
    }

    #[test]
    fn parses_op_names() {
        let op = OpName::parse("aten::add.Tensor").unwrap();
        assert_eq!((op.namespace.as_str(), op.name.as_str(), op.overload.as_deref()), ("aten", "add", Some("Tensor")));
        assert_eq!(OpName::parse("operator::mul").unwrap().overload, None);
        assert!(OpName::parse("os.system").is_none());
        assert!(OpName::parse("aten::__import__('os')").is_none());
    }
}
