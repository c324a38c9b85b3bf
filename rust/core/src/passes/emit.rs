//! The nodes a pass writes in place of others: each new value named after the node it
//! replaces, never taking a name the graph already has (`quantized_ops`, `channel_shuffle`).

use std::collections::HashSet;

use crate::schema::{Arg, Graph, Node, OpEntry, Outputs};

/// Every name `g`'s top level binds: its inputs and its nodes' outputs.
pub(super) fn value_names(g: &Graph) -> HashSet<String> {
    let mut names: HashSet<String> = g.inputs.iter().map(|i| i.name.clone()).collect();
    names.extend(g.nodes.iter().flat_map(|n| n.outputs.names().map(str::to_owned)));
    names
}

/// The nodes that replace one, and the op table and names they draw on.
pub(super) struct Emit<'a> {
    ops: &'a mut Vec<OpEntry>,
    names: &'a mut HashSet<String>,
    /// The nodes written so far, in order.
    pub nodes: Vec<Node>,
    /// What the new values' names start with.
    base: String,
}

impl<'a> Emit<'a> {
    /// Nodes whose new values are named `{base}0`, `{base}1`, ... (the first free ones).
    pub fn new(ops: &'a mut Vec<OpEntry>, names: &'a mut HashSet<String>, base: String) -> Self {
        Emit { ops, names, nodes: Vec::new(), base }
    }

    /// A node of `op` binding `outputs`.
    pub fn bind(&mut self, op: &str, args: Vec<Arg>, kwargs: &[(&str, Arg)], outputs: Outputs) {
        let op = super::op_index(self.ops, op);
        let kwargs = kwargs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect();
        self.nodes.push(Node { op, args, kwargs, outputs });
    }

    /// A node of `op` with a new value: a reference to it.
    pub fn call(&mut self, op: &str, args: Vec<Arg>, kwargs: &[(&str, Arg)]) -> Arg {
        let mut i = self.nodes.len();
        let name = loop {
            let name = format!("{}{i}", self.base);
            if self.names.insert(name.clone()) {
                break name;
            }
            i += 1;
        };
        self.bind(op, args, kwargs, Outputs::One(name.clone()));
        Arg::Ref(name)
    }
}
