//! Treespecs: how nested Python values flatten to leaves and are rebuilt from them.
//!
//! `validate` checks a parsed `schema::TreeSpec` once at load (shape of every node, unique
//! keys, bounded depth) and counts its leaves. `Compiled` is the runtime form, with dict
//! keys and namedtuple types already turned into Python objects, used by the call path to
//! flatten inputs (dict entries by key, never by order) and rebuild outputs.

use std::collections::HashSet;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

use crate::artifact;
use crate::error::{Error, Result};
use crate::schema::{DictEntry, Key, TreeSpec};

/// Deeper than any real model's inputs; shallow enough that recursion is never a risk.
pub const MAX_DEPTH: usize = 64;

/// Checks a treespec's structure and returns its number of leaves.
pub fn validate(spec: &TreeSpec, what: &str) -> Result<usize> {
    fn go(spec: &TreeSpec, what: &str, depth: usize) -> Result<usize> {
        if depth > MAX_DEPTH {
            return Err(artifact!("{what}: nested deeper than {MAX_DEPTH} levels"));
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
                        return Err(artifact!("{what}: duplicate dict key {}", e.key));
                    }
                }
                entries.iter().try_fold(0usize, |n, e| Ok(n + go(&e.value, what, depth + 1)?))
            }
            TreeSpec::NamedTuple { name, fields, children, .. } => {
                if fields.len() != children.len() {
                    return Err(artifact!(
                        "{what}: namedtuple {name} has {} fields but {} children",
                        fields.len(),
                        children.len()
                    ));
                }
                let mut seen = HashSet::new();
                if let Some(dup) = fields.iter().find(|f| !seen.insert(f.as_str())) {
                    return Err(artifact!("{what}: namedtuple {name} repeats field {dup:?}"));
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
    Index(usize),
    Key(&'a str),
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

/// A treespec with its Python objects resolved, for the call path.
#[derive(Debug)]
pub enum Compiled {
    Leaf,
    None,
    Tuple(Vec<Compiled>),
    List(Vec<Compiled>),
    Dict { ordered: bool, keys: Vec<(Py<PyAny>, String)>, children: Vec<Compiled> },
    NamedTuple { ty: Py<PyType>, name: String, fields: Vec<String>, children: Vec<Compiled> },
}

impl Compiled {
    pub fn new(py: Python<'_>, spec: &TreeSpec) -> PyResult<Self> {
        let all = |c: &[TreeSpec]| c.iter().map(|c| Compiled::new(py, c)).collect::<PyResult<Vec<_>>>();
        let dict = |entries: &[DictEntry], ordered: bool| -> PyResult<Compiled> {
            let keys = entries
                .iter()
                .map(|e| {
                    let obj = match &e.key {
                        Key::Str(s) => PyString::new(py, s).into_any().unbind(),
                        Key::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
                    };
                    Ok((obj, e.key.to_string()))
                })
                .collect::<PyResult<Vec<_>>>()?;
            let children = entries.iter().map(|e| Compiled::new(py, &e.value)).collect::<PyResult<_>>()?;
            Ok(Compiled::Dict { ordered, keys, children })
        };
        Ok(match spec {
            TreeSpec::Leaf => Compiled::Leaf,
            TreeSpec::None => Compiled::None,
            TreeSpec::Tuple { children } => Compiled::Tuple(all(children)?),
            TreeSpec::List { children } => Compiled::List(all(children)?),
            TreeSpec::Dict { entries } => dict(entries, false)?,
            TreeSpec::OrderedDict { entries } => dict(entries, true)?,
            TreeSpec::NamedTuple { name, module, fields, children } => Compiled::NamedTuple {
                ty: namedtuple_type(py, name, module, fields)?,
                name: name.clone(),
                fields: fields.clone(),
                children: all(children)?,
            },
        })
    }

    /// Appends `obj`'s leaves to `out`, checking its structure against the spec.
    /// `path` locates `obj` for error messages.
    pub fn flatten<'s, 'py>(
        &'s self,
        obj: &Bound<'py, PyAny>,
        root: &str,
        path: &mut Vec<PathElem<'s>>,
        out: &mut Vec<Bound<'py, PyAny>>,
    ) -> Result<(), Error> {
        let mismatch = |expected: String, path: &[PathElem<'_>]| {
            Error::Input(format!("{}: expected {expected}, got {}", format_path(root, path), describe(obj)))
        };
        match self {
            Compiled::Leaf => out.push(obj.clone()),
            Compiled::None => {
                if !obj.is_none() {
                    return Err(mismatch("None".into(), path));
                }
            }
            Compiled::Tuple(children) | Compiled::List(children) => {
                let is_list = matches!(self, Compiled::List(_));
                let seq = if is_list {
                    obj.cast::<PyList>().ok().map(|l| l.as_sequence().clone())
                } else {
                    obj.cast::<PyTuple>().ok().filter(|_| !is_namedtuple(obj)).map(|t| t.as_sequence().clone())
                };
                let kind = if is_list { "list" } else { "tuple" };
                let seq = seq.ok_or_else(|| mismatch(format!("a {kind} of {} items", children.len()), path))?;
                let n = seq.len().unwrap_or(usize::MAX);
                if n != children.len() {
                    return Err(mismatch(format!("a {kind} of {} items", children.len()), path));
                }
                for (i, c) in children.iter().enumerate() {
                    let item = seq.get_item(i).map_err(|e| Error::Input(e.to_string()))?;
                    path.push(PathElem::Index(i));
                    c.flatten(&item, root, path, out)?;
                    path.pop();
                }
            }
            Compiled::Dict { keys, children, .. } => {
                let dict = obj
                    .cast::<PyDict>()
                    .map_err(|_| mismatch(format!("a dict with keys [{}]", key_list(keys)), path))?;
                if dict.len() != keys.len() {
                    return Err(dict_key_mismatch(root, path, dict, keys));
                }
                for ((key, label), c) in keys.iter().zip(children) {
                    let item = dict
                        .get_item(key.bind(obj.py()))
                        .ok()
                        .flatten()
                        .ok_or_else(|| dict_key_mismatch(root, path, dict, keys))?;
                    path.push(PathElem::Key(label));
                    c.flatten(&item, root, path, out)?;
                    path.pop();
                }
            }
            Compiled::NamedTuple { name, fields, children, .. } => {
                let ok = is_namedtuple(obj)
                    && obj.get_type().name().map(|n| n.to_string() == *name).unwrap_or(false)
                    && obj
                        .getattr("_fields")
                        .and_then(|f| f.extract::<Vec<String>>())
                        .map(|f| f == *fields)
                        .unwrap_or(false);
                if !ok {
                    return Err(mismatch(format!("a {name}({})", fields.join(", ")), path));
                }
                let tuple = obj.cast::<PyTuple>().expect("namedtuples are tuples");
                for ((field, c), item) in fields.iter().zip(children).zip(tuple.iter()) {
                    path.push(PathElem::Attr(field));
                    c.flatten(&item, root, path, out)?;
                    path.pop();
                }
            }
        }
        Ok(())
    }

    /// Rebuilds a value of this structure from `leaves`, consuming them in order.
    pub fn unflatten<'py>(
        &self,
        py: Python<'py>,
        leaves: &mut impl Iterator<Item = Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let items = |children: &[Compiled], leaves: &mut dyn Iterator<Item = Bound<'py, PyAny>>| {
            let mut it = leaves;
            children.iter().map(|c| c.unflatten(py, &mut it)).collect::<PyResult<Vec<_>>>()
        };
        Ok(match self {
            Compiled::Leaf => leaves
                .next()
                .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("kwexport: output leaves ran out"))?,
            Compiled::None => py.None().into_bound(py),
            Compiled::Tuple(c) => PyTuple::new(py, items(c, leaves)?)?.into_any(),
            Compiled::List(c) => PyList::new(py, items(c, leaves)?)?.into_any(),
            Compiled::Dict { ordered, keys, children } => {
                let values = items(children, leaves)?;
                let dict = PyDict::new(py);
                for ((k, _), v) in keys.iter().zip(values) {
                    dict.set_item(k.bind(py), v)?;
                }
                if *ordered {
                    py.import("collections")?.getattr("OrderedDict")?.call1((dict,))?
                } else {
                    dict.into_any()
                }
            }
            Compiled::NamedTuple { ty, children, .. } => {
                ty.bind(py).call1(PyTuple::new(py, items(children, leaves)?)?)?
            }
        })
    }
}

fn key_list(keys: &[(Py<PyAny>, String)]) -> String {
    keys.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join(", ")
}

fn dict_key_mismatch(
    root: &str,
    path: &[PathElem<'_>],
    dict: &Bound<'_, PyDict>,
    keys: &[(Py<PyAny>, String)],
) -> Error {
    let py = dict.py();
    let missing: Vec<&str> =
        keys.iter().filter(|(k, _)| !dict.contains(k.bind(py)).unwrap_or(false)).map(|(_, l)| l.as_str()).collect();
    let extra: Vec<String> = dict
        .keys()
        .iter()
        .filter(|k| !keys.iter().any(|(e, _)| e.bind(py).eq(k).unwrap_or(false)))
        .map(|k| k.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into()))
        .collect();
    let mut what = Vec::new();
    if !missing.is_empty() {
        what.push(format!("missing key(s) {}", missing.join(", ")));
    }
    if !extra.is_empty() {
        what.push(format!("unexpected key(s) {}", extra.join(", ")));
    }
    Error::Input(format!(
        "{}: expected a dict with keys [{}], got one with {}",
        format_path(root, path),
        key_list(keys),
        what.join(" and ")
    ))
}

fn is_namedtuple(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyTuple>() && obj.hasattr("_fields").unwrap_or(false)
}

/// A short description of what came, for error messages.
pub fn describe(obj: &Bound<'_, PyAny>) -> String {
    let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    if let Ok(t) = obj.cast::<PyTuple>() {
        format!("a {ty} of {} items", t.len())
    } else if let Ok(l) = obj.cast::<PyList>() {
        format!("a list of {} items", l.len())
    } else if let Ok(d) = obj.cast::<PyDict>() {
        let keys: Vec<String> = d.keys().iter().map(|k| k.repr().map(|r| r.to_string()).unwrap_or_default()).collect();
        format!("a dict with keys [{}]", keys.join(", "))
    } else if obj.is_none() {
        "None".into()
    } else {
        format!("a {ty}")
    }
}

/// The namedtuple class for an output. We never import modules named by the file: if the
/// module is already loaded and holds a namedtuple of that name and fields, reuse it (so
/// `isinstance` holds); otherwise build an equivalent class.
fn namedtuple_type(py: Python<'_>, name: &str, module: &str, fields: &[String]) -> PyResult<Py<PyType>> {
    let modules = py.import("sys")?.getattr("modules")?;
    if let Ok(Some(m)) = modules.cast::<PyDict>().map(|d| d.get_item(module).ok().flatten()) {
        if let Ok(ty) = m.getattr(name).and_then(|t| t.cast_into::<PyType>().map_err(Into::into)) {
            let same = ty.getattr("_fields").and_then(|f| f.extract::<Vec<String>>()).map(|f| f == fields);
            if same.unwrap_or(false) {
                return Ok(ty.unbind());
            }
        }
    }
    let kwargs = PyDict::new(py);
    if !module.is_empty() {
        kwargs.set_item("module", module)?;
    }
    let ty = py.import("collections")?.getattr("namedtuple")?.call((name, fields.to_vec()), Some(&kwargs))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(validate(&dup, "outputs").unwrap_err(), Error::Artifact("outputs: duplicate dict key 'a'".into()));
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
    fn formats_paths() {
        let p = [PathElem::Key("'shift'"), PathElem::Index(0), PathElem::Attr("x")];
        assert_eq!(format_path("cfg", &p), "cfg['shift'][0].x");
    }
}
