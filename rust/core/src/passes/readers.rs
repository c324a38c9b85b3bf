//! Who reads each value of a graph, and which weight each graph input is: what the pattern
//! passes need to know before they fuse nodes (a fused intermediate must have no other
//! reader) or rewrite a weight.

use std::collections::HashMap;

use crate::schema::{Graph, InputSource, Node, OpEntry, Outputs};

/// The weight (its name in the file) each of `g`'s weight inputs names, by input name.
pub fn weight_inputs(g: &Graph) -> HashMap<&str, &str> {
    g.inputs
        .iter()
        .filter_map(|i| match &i.source {
            InputSource::Weight(w) => Some((i.name.as_str(), w.as_str())),
            InputSource::User(_) => None,
        })
        .collect()
}

/// A reader that is not a node: a graph output or a mutation's value.
pub const OUTSIDE: usize = usize::MAX;

/// The node indices that read each value of a graph's top level, in order, by value name.
pub type Readers = HashMap<String, Vec<usize>>;

/// Who reads each value of `g`'s top level, with [`OUTSIDE`] for a graph output or mutation.
pub fn readers(g: &Graph) -> Readers {
    let mut readers: Readers = HashMap::new();
    let mut read = |r: &str, by: usize| match readers.get_mut(r) {
        Some(v) => v.push(by),
        None => {
            readers.insert(r.to_owned(), vec![by]);
        }
    };
    for (i, n) in g.nodes.iter().enumerate() {
        for a in n.args.iter().chain(n.kwargs.values()) {
            a.for_each_ref(&mut |r| read(r, i));
        }
    }
    for a in g.outputs.iter().chain(g.mutations.iter().map(|w| &w.value)) {
        a.for_each_ref(&mut |r| read(r, OUTSIDE));
    }
    readers
}

/// The node's only output, if it has exactly one.
pub fn one(n: &Node) -> Option<&str> {
    match &n.outputs {
        Outputs::One(o) => Some(o.as_str()),
        _ => None,
    }
}

/// The node that alone reads `n`'s one output (read once, by a node).
pub fn sole_reader(readers: &Readers, n: &Node) -> Option<usize> {
    match readers.get(one(n)?)?.as_slice() {
        [j] if *j != OUTSIDE => Some(*j),
        _ => None,
    }
}

/// Whether an op may write one of its arguments, or is a higher-order op (whose body may): a
/// schema that marks a write, or none (a Python operator, a higher-order op) but for the ops
/// passes insert, which write nothing unless torch names them in place (a trailing `_`).
pub fn may_write(op: &OpEntry) -> bool {
    match op.schema.as_deref() {
        Some(s) => s.contains('!'),
        None => {
            let (namespace, name) = op.name.split_once("::").unwrap_or(("", &op.name));
            let base = name.split('.').next().unwrap_or(name);
            !matches!(namespace, "aten" | "kwexport") || base.ends_with('_')
        }
    }
}

/// Whether a schema's op returns an alias of an argument (`-> Tensor(a)`: a view).
pub fn returns_alias(schema: &str) -> bool {
    schema.split("->").nth(1).is_some_and(|r| r.contains("Tensor("))
}
