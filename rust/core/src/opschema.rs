//! Op-schema drift: torch moves too. Each op's schema is recorded at export; at load it is
//! compared with the running torch's:
//!
//! - identical: fine;
//! - compatible (the same arguments, plus new trailing ones that have defaults, and the
//!   same returns): fine, and noted;
//! - anything else: a registered op upgrader rewrites the nodes, or the file is refused.

use crate::schema::{Arg, Node};

/// A schema string split at its top level: `name(args) -> returns`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema<'a> {
    /// `namespace::name[.overload]`.
    pub name: &'a str,
    /// Each argument's declaration, `*` included, trimmed.
    pub args: Vec<&'a str>,
    /// Everything after `->`, trimmed.
    pub returns: &'a str,
}

/// Splits a schema string; `None` if it isn't one.
pub fn parse(schema: &str) -> Option<Schema<'_>> {
    let open = schema.find('(')?;
    let name = schema[..open].trim();
    let mut depth = 0usize;
    let mut close = None;
    let mut args = Vec::new();
    let mut start = open + 1;
    for (i, c) in schema.char_indices().skip(open) {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    close = Some(i);
                    break;
                }
            }
            ',' if depth == 1 => {
                args.push(schema[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    let close = close?;
    let last = schema[start..close].trim();
    if !last.is_empty() {
        args.push(last);
    }
    let returns = schema[close + 1..].trim().strip_prefix("->")?.trim();
    Some(Schema { name, args, returns })
}

/// How the running torch's schema of an op relates to the recorded one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drift {
    /// The same string.
    Identical,
    /// The current schema adds these trailing arguments, all with defaults.
    Compatible(Vec<String>),
    /// Anything else: the nodes need an op upgrader.
    Incompatible,
}

/// Classifies the drift from `recorded` to `current`.
pub fn compare(recorded: &str, current: &str) -> Drift {
    if recorded == current {
        return Drift::Identical;
    }
    let (Some(old), Some(new)) = (parse(recorded), parse(current)) else {
        return Drift::Incompatible;
    };
    if old.name != new.name || old.returns != new.returns || new.args.len() < old.args.len() {
        return Drift::Incompatible;
    }
    if new.args[..old.args.len()] != old.args[..] {
        return Drift::Incompatible;
    }
    let added = &new.args[old.args.len()..];
    // `*` only moves later arguments to keyword-only, which nodes saved before can't use.
    if added.iter().all(|a| *a == "*" || a.contains('=')) {
        Drift::Compatible(added.iter().filter(|a| **a != "*").map(|a| a.to_string()).collect())
    } else {
        Drift::Incompatible
    }
}

/// Rewrites nodes saved against an old schema of an op so they fit the current one.
pub struct OpUpgrader {
    /// Its name, reported in load notes.
    pub name: &'static str,
    /// The op, `namespace::name.overload`.
    pub op: &'static str,
    /// The recorded schema it applies to.
    pub old_schema: &'static str,
    /// Rewrites one node; an `Err` says why it can't.
    pub rewrite: fn(&mut Node) -> Result<(), String>,
}

/// The registered op upgraders. `linspace` is torch's own historical case: `steps` was
/// optional (default 100) until torch made it required.
pub const OP_UPGRADERS: &[OpUpgrader] = &[OpUpgrader {
    name: "linspace_steps_required",
    op: "aten::linspace.default",
    old_schema: "aten::linspace(Scalar start, Scalar end, int? steps=None, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    rewrite: |node| {
        match node.args.get_mut(2) {
            Some(steps @ Arg::None(())) => *steps = Arg::Int(100),
            Some(_) => {}
            None => match node.kwargs.remove("steps") {
                Some(Arg::None(())) | None => {
                    node.args.resize(2, Arg::None(()));
                    node.args.push(Arg::Int(100));
                }
                Some(given) => {
                    node.args.resize(2, Arg::None(()));
                    node.args.push(given);
                }
            },
        }
        Ok(())
    },
}];

/// The op upgrader for nodes of `op` saved against `recorded`, if one is registered.
pub fn find_upgrader(op: &str, recorded: &str) -> Option<&'static OpUpgrader> {
    OP_UPGRADERS.iter().find(|u| u.op == op && u.old_schema == recorded)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADD: &str = "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor";

    #[test]
    fn parses_nested_defaults() {
        let s = parse("aten::conv2d(Tensor input, SymInt[2] stride=[1, 1], SymInt groups=1) -> Tensor").unwrap();
        assert_eq!(s.name, "aten::conv2d");
        assert_eq!(s.args, vec!["Tensor input", "SymInt[2] stride=[1, 1]", "SymInt groups=1"]);
        assert_eq!(s.returns, "Tensor");
        let s = parse("aten::split.Tensor(Tensor(a -> *) self, SymInt split_size, int dim=0) -> Tensor(a)[]").unwrap();
        assert_eq!(s.args[0], "Tensor(a -> *) self");
        assert_eq!(parse("aten::f() -> ()").unwrap().args, Vec::<&str>::new());
        assert!(parse("garbage").is_none());
    }

    #[test]
    fn classifies_drift() {
        assert_eq!(compare(ADD, ADD), Drift::Identical);
        let more = "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1, bool fast=False) -> Tensor";
        assert_eq!(compare(ADD, more), Drift::Compatible(vec!["bool fast=False".into()]));
        let gelu_old = "aten::gelu(Tensor self) -> Tensor";
        let gelu_new = "aten::gelu(Tensor self, *, str approximate='none') -> Tensor";
        assert_eq!(compare(gelu_old, gelu_new), Drift::Compatible(vec!["str approximate='none'".into()]));
        let required = "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1, int must) -> Tensor";
        assert_eq!(compare(ADD, required), Drift::Incompatible);
        let retyped = "aten::add.Tensor(Tensor self, Scalar other, *, Scalar alpha=1) -> Tensor";
        assert_eq!(compare(ADD, retyped), Drift::Incompatible);
        assert_eq!(compare(ADD, "aten::add.Tensor(Tensor self) -> Tensor"), Drift::Incompatible);
    }

    #[test]
    fn linspace_upgrader_fills_the_old_default() {
        let u = find_upgrader("aten::linspace.default", OP_UPGRADERS[0].old_schema).unwrap();
        let mut node = Node {
            op: 0,
            args: vec![Arg::Int(0), Arg::Int(1), Arg::None(())],
            kwargs: Default::default(),
            outputs: crate::schema::Outputs::One("l".into()),
        };
        (u.rewrite)(&mut node).unwrap();
        assert_eq!(node.args[2], Arg::Int(100));
        node.args.truncate(2);
        (u.rewrite)(&mut node).unwrap();
        assert_eq!(node.args, vec![Arg::Int(0), Arg::Int(1), Arg::Int(100)]);
    }
}
