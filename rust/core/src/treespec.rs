//! Treespecs: how nested Python values flatten to leaves and are rebuilt from them.
//!
//! `validate` checks a parsed [`TreeSpec`] once at load (shape of every node, unique keys,
//! bounded depth) and counts its leaves; `leaf_paths` names each leaf for messages. The
//! runtime compiles the validated spec into its Python form (`kwexport-runtime`'s `tree`).

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::schema::{ChildKey, ContainerKind, DictEntry, Key, TreeSpec};
use crate::tables::DEFAULTDICT_FACTORIES;

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
            TreeSpec::Dict { entries } | TreeSpec::OrderedDict { entries } => dict(entries, what, depth),
            TreeSpec::DefaultDict { factory, entries } => {
                if let Some(f) = factory.as_deref().filter(|f| !DEFAULTDICT_FACTORIES.contains(f)) {
                    return Err(Error::DefaultFactory {
                        entry: what.to_owned(),
                        factory: f.to_owned(),
                        allowed: DEFAULTDICT_FACTORIES.join(", "),
                    });
                }
                dict(entries, what, depth)
            }
            TreeSpec::Container { kind, module, qualname, keys, children, .. } => {
                let class = format!("{module}.{qualname}");
                if !is_dotted_identifier(module) || !is_dotted_identifier(qualname) {
                    return Err(Error::ClassName {
                        entry: what.to_owned(),
                        module: module.clone(),
                        qualname: qualname.clone(),
                    });
                }
                if keys.len() != children.len() {
                    return Err(Error::ContainerArity {
                        entry: what.to_owned(),
                        class,
                        keys: keys.len(),
                        children: children.len(),
                    });
                }
                let mut seen = HashSet::new();
                for key in keys {
                    if !seen.insert(key) {
                        return Err(Error::DuplicateChildKey { entry: what.to_owned(), class, key: key.to_string() });
                    }
                    let (fits, expected) = match kind {
                        ContainerKind::ModelOutput => (matches!(key, ChildKey::Key(Key::Str(_))), "string item key"),
                        ContainerKind::Dataclass => (matches!(key, ChildKey::Attr(_)), "field attribute"),
                        ContainerKind::PytreeNode => (true, ""),
                    };
                    if !fits {
                        return Err(Error::ContainerKeyKind {
                            entry: what.to_owned(),
                            class,
                            kind: kind.name(),
                            key: key.to_string(),
                            expected,
                        });
                    }
                }
                sum(children)
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
    fn dict(entries: &[DictEntry], what: &str, depth: usize) -> Result<usize> {
        let mut seen = HashSet::new();
        for e in entries {
            if !seen.insert(&e.key) {
                return Err(Error::DuplicateKey { entry: what.to_owned(), key: e.key.to_string() });
            }
        }
        entries.iter().try_fold(0usize, |n, e| Ok(n + go(&e.value, what, depth + 1)?))
    }
    go(spec, what, 0)
}

/// `a.b.C`: dot-separated Python identifiers (`<locals>` parts allowed, as qualnames have).
fn is_dotted_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|part| {
            part == "<locals>"
                || part.chars().next().is_some_and(|c| c == '_' || c.is_alphabetic())
                    && part.chars().all(|c| c == '_' || c.is_alphanumeric())
        })
}

impl ContainerKind {
    /// The name the file uses.
    pub fn name(self) -> &'static str {
        match self {
            ContainerKind::ModelOutput => "model_output",
            ContainerKind::Dataclass => "dataclass",
            ContainerKind::PytreeNode => "pytree_node",
        }
    }
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
            TreeSpec::Dict { entries } | TreeSpec::OrderedDict { entries } | TreeSpec::DefaultDict { entries, .. } => {
                entries.iter().for_each(|e| walk(format!("[{}]", e.key), &e.value, path))
            }
            TreeSpec::Container { keys, children, .. } => {
                keys.iter().zip(children).for_each(|(k, c)| walk(k.to_string(), c, path))
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
    use crate::schema::Constant;

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

    fn output(kind: ContainerKind, keys: Vec<ChildKey>, n: usize) -> TreeSpec {
        TreeSpec::Container {
            kind,
            module: "transformers.modeling_outputs".into(),
            qualname: "CausalLMOutput".into(),
            context: Constant::List(vec![Constant::Str("logits".into())]),
            keys,
            children: vec![leaf(); n],
        }
    }

    #[test]
    fn validates_containers() {
        let logits = || ChildKey::Key(Key::Str("logits".into()));
        assert_eq!(validate(&output(ContainerKind::ModelOutput, vec![logits()], 1), "outputs").unwrap(), 1);
        let err = |spec: TreeSpec| validate(&spec, "outputs").unwrap_err().to_string();
        assert_eq!(
            err(output(ContainerKind::ModelOutput, vec![logits()], 2)),
            "outputs: transformers.modeling_outputs.CausalLMOutput has 1 keys but 2 children"
        );
        assert_eq!(
            err(output(ContainerKind::ModelOutput, vec![logits(), logits()], 2)),
            "outputs: transformers.modeling_outputs.CausalLMOutput repeats key ['logits']"
        );
        assert_eq!(
            err(output(ContainerKind::ModelOutput, vec![ChildKey::Attr("logits".into())], 1)),
            "outputs: transformers.modeling_outputs.CausalLMOutput is a model_output but its key .logits is not a string item key"
        );
        let mut bad_name = output(ContainerKind::PytreeNode, vec![ChildKey::Index(0)], 1);
        if let TreeSpec::Container { module, .. } = &mut bad_name {
            *module = "os; import sys".into();
        }
        assert!(err(bad_name).contains("invalid class name"));
        let dd = TreeSpec::DefaultDict { factory: Some("eval".into()), entries: vec![] };
        assert!(err(dd).contains("defaultdict factory \"eval\" is not one of list"));
        let mut out = Vec::new();
        leaf_paths(&output(ContainerKind::ModelOutput, vec![logits()], 1), "out", &mut out);
        assert_eq!(out, ["out['logits']"]);
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
