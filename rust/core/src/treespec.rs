//! Treespecs: how nested Python values flatten to leaves and are rebuilt from them.
//!
//! `validate` checks a parsed [`TreeSpec`] once at load (shape of every node, unique keys,
//! bounded depth) and counts its leaves; `leaf_paths` names each leaf for messages. The
//! runtime compiles the validated spec into its Python form (`kwexport-runtime`'s `tree`).

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::schema::TreeSpec;

/// Deeper than any real model's inputs; shallow enough that recursion is never a risk.
pub const MAX_DEPTH: usize = 64;

/// Checks a treespec's structure and returns its number of leaves.
pub fn validate(spec: &TreeSpec, what: &str) -> Result<usize> {
    fn go(spec: &TreeSpec, what: &str, depth: usize) -> Result<usize> {
        if depth > MAX_DEPTH {
            return Err(Error::TooDeep { entry: what.to_owned(), max: MAX_DEPTH });
        }
        let sum = |children: &[TreeSpec]| -> Result<usize> {
            children.iter().try_fold(0usize, |n, c| Ok(n + go(c, what, depth + 1)?))
        };
        match spec {
            TreeSpec::Leaf => Ok(1),
            TreeSpec::None => Ok(0),
            TreeSpec::Tuple { children } | TreeSpec::List { children } => sum(children),
            TreeSpec::Dict { entries } | TreeSpec::OrderedDict { entries } => {
                let mut seen = HashSet::new();
                for e in entries {
                    if !seen.insert(&e.key) {
                        return Err(Error::DuplicateKey { entry: what.to_owned(), key: e.key.to_string() });
                    }
                }
                entries.iter().try_fold(0usize, |n, e| Ok(n + go(&e.value, what, depth + 1)?))
            }
            TreeSpec::NamedTuple { name, fields, children, .. } => {
                if fields.len() != children.len() {
                    return Err(Error::NamedTupleArity {
                        entry: what.to_owned(),
                        name: name.clone(),
                        fields: fields.len(),
                        children: children.len(),
                    });
                }
                let mut seen = HashSet::new();
                if let Some(dup) = fields.iter().find(|f| !seen.insert(f.as_str())) {
                    return Err(Error::NamedTupleField {
                        entry: what.to_owned(),
                        name: name.clone(),
                        field: dup.clone(),
                    });
                }
                sum(children)
            }
        }
    }
    go(spec, what, 0)
}

/// One step of an argument path, rendered as Python would index it.
#[derive(Debug, Clone)]
pub enum PathElem<'a> {
    /// `[i]`.
    Index(usize),
    /// `[key]`, the key already rendered (`'name'`, `3`).
    Key(&'a str),
    /// `.field`.
    Attr(&'a str),
}

/// Formats a path such as `cfg['shift'][0]` from a root name and its steps.
pub fn format_path(root: &str, path: &[PathElem<'_>]) -> String {
    let mut s = root.to_owned();
    for p in path {
        match p {
            PathElem::Index(i) => s.push_str(&format!("[{i}]")),
            PathElem::Key(k) => s.push_str(&format!("[{k}]")),
            PathElem::Attr(a) => s.push_str(&format!(".{a}")),
        }
    }
    s
}

/// The path of every leaf of `spec`, rooted at `root`, in flattening order:
/// `cfg['shift'][0]`, `pair.left`.
pub fn leaf_paths(spec: &TreeSpec, root: &str, out: &mut Vec<String>) {
    fn go(spec: &TreeSpec, root: &str, path: &mut Vec<String>, out: &mut Vec<String>) {
        let mut walk = |step: String, child: &TreeSpec, path: &mut Vec<String>| {
            path.push(step);
            go(child, root, path, out);
            path.pop();
        };
        match spec {
            TreeSpec::Leaf => out.push(format!("{root}{}", path.concat())),
            TreeSpec::None => {}
            TreeSpec::Tuple { children } | TreeSpec::List { children } => {
                children.iter().enumerate().for_each(|(i, c)| walk(format!("[{i}]"), c, path))
            }
            TreeSpec::Dict { entries } | TreeSpec::OrderedDict { entries } => {
                entries.iter().for_each(|e| walk(format!("[{}]", e.key), &e.value, path))
            }
            TreeSpec::NamedTuple { fields, children, .. } => {
                fields.iter().zip(children).for_each(|(f, c)| walk(format!(".{f}"), c, path))
            }
        }
    }
    go(spec, root, &mut Vec::new(), out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{DictEntry, Key};

    fn leaf() -> TreeSpec {
        TreeSpec::Leaf
    }

    #[test]
    fn counts_leaves() {
        let spec = TreeSpec::Tuple {
            children: vec![
                TreeSpec::List { children: vec![leaf(), TreeSpec::None, leaf()] },
                TreeSpec::Dict {
                    entries: vec![
                        DictEntry { key: Key::Str("a".into()), value: leaf() },
                        DictEntry { key: Key::Int(3), value: TreeSpec::Tuple { children: vec![] } },
                    ],
                },
            ],
        };
        assert_eq!(validate(&spec, "inputs.spec").unwrap(), 3);
    }

    #[test]
    fn rejects_duplicate_keys_and_lying_namedtuples() {
        let dup = TreeSpec::Dict {
            entries: vec![
                DictEntry { key: Key::Str("a".into()), value: leaf() },
                DictEntry { key: Key::Str("a".into()), value: leaf() },
            ],
        };
        assert_eq!(validate(&dup, "outputs").unwrap_err().to_string(), "outputs: duplicate dict key 'a'");
        let nt = TreeSpec::NamedTuple {
            name: "P".into(),
            module: String::new(),
            fields: vec!["a".into()],
            children: vec![leaf(), leaf()],
        };
        assert!(validate(&nt, "outputs").unwrap_err().to_string().contains("1 fields but 2 children"));
    }

    #[test]
    fn bounds_depth() {
        let mut spec = leaf();
        for _ in 0..(MAX_DEPTH + 2) {
            spec = TreeSpec::List { children: vec![spec] };
        }
        assert!(validate(&spec, "inputs.spec").unwrap_err().to_string().contains("deeper than"));
    }

    #[test]
    fn names_leaf_paths() {
        let spec = TreeSpec::Dict {
            entries: vec![
                DictEntry { key: Key::Str("shift".into()), value: TreeSpec::Tuple { children: vec![leaf(), leaf()] } },
                DictEntry {
                    key: Key::Int(3),
                    value: TreeSpec::NamedTuple {
                        name: "P".into(),
                        module: String::new(),
                        fields: vec!["x".into()],
                        children: vec![leaf()],
                    },
                },
            ],
        };
        let mut out = Vec::new();
        leaf_paths(&spec, "cfg", &mut out);
        assert_eq!(out, ["cfg['shift'][0]", "cfg['shift'][1]", "cfg[3].x"]);
    }

    #[test]
    fn formats_paths() {
        let p = [PathElem::Key("'shift'"), PathElem::Index(0), PathElem::Attr("x")];
        assert_eq!(format_path("cfg", &p), "cfg['shift'][0].x");
    }
}
