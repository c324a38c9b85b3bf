//! Treespecs compiled for the call path: dict keys and namedtuple types turned into Python
//! objects once at load, used to flatten a call's values into leaves (dict entries by key,
//! never by order, checking structure as it goes) and to rebuild the outputs.

use kwexport_core::schema::{DictEntry, Key, TreeSpec};
use kwexport_core::treespec::{format_path, PathElem};
use kwexport_core::Error;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

use crate::errors::{RtError, RtResult};

/// A treespec with its Python objects resolved, for the call path.
#[derive(Debug)]
pub enum CompiledSpec {
    Leaf,
    None,
    Tuple(Vec<CompiledSpec>),
    List(Vec<CompiledSpec>),
    Dict { ordered: bool, keys: Vec<(Py<PyAny>, String)>, children: Vec<CompiledSpec> },
    NamedTuple { ty: Py<PyType>, name: String, fields: Vec<String>, children: Vec<CompiledSpec> },
}

impl CompiledSpec {
    pub fn new(py: Python<'_>, spec: &TreeSpec) -> PyResult<Self> {
        let all = |c: &[TreeSpec]| c.iter().map(|c| CompiledSpec::new(py, c)).collect::<PyResult<Vec<_>>>();
        let dict = |entries: &[DictEntry], ordered: bool| -> PyResult<CompiledSpec> {
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
            let children = entries.iter().map(|e| CompiledSpec::new(py, &e.value)).collect::<PyResult<_>>()?;
            Ok(CompiledSpec::Dict { ordered, keys, children })
        };
        Ok(match spec {
            TreeSpec::Leaf => CompiledSpec::Leaf,
            TreeSpec::None => CompiledSpec::None,
            TreeSpec::Tuple { children } => CompiledSpec::Tuple(all(children)?),
            TreeSpec::List { children } => CompiledSpec::List(all(children)?),
            TreeSpec::Dict { entries } => dict(entries, false)?,
            TreeSpec::OrderedDict { entries } => dict(entries, true)?,
            TreeSpec::NamedTuple { name, module, fields, children } => CompiledSpec::NamedTuple {
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
    ) -> RtResult<()> {
        let mismatch = |expected: String, path: &[PathElem<'_>]| {
            RtError::from(Error::Mismatch { path: format_path(root, path), expected, got: describe(obj) })
        };
        match self {
            CompiledSpec::Leaf => out.push(obj.clone()),
            CompiledSpec::None => {
                if !obj.is_none() {
                    return Err(mismatch("None".into(), path));
                }
            }
            CompiledSpec::Tuple(children) | CompiledSpec::List(children) => {
                let is_list = matches!(self, CompiledSpec::List(_));
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
                    let item = seq.get_item(i)?;
                    path.push(PathElem::Index(i));
                    c.flatten(&item, root, path, out)?;
                    path.pop();
                }
            }
            CompiledSpec::Dict { keys, children, .. } => {
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
            CompiledSpec::NamedTuple { name, fields, children, .. } => {
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
    ) -> RtResult<Bound<'py, PyAny>> {
        let items = |children: &[CompiledSpec], leaves: &mut dyn Iterator<Item = Bound<'py, PyAny>>| {
            let mut it = leaves;
            children.iter().map(|c| c.unflatten(py, &mut it)).collect::<RtResult<Vec<_>>>()
        };
        Ok(match self {
            CompiledSpec::Leaf => leaves.next().ok_or_else(|| RtError::Internal("output leaves ran out".into()))?,
            CompiledSpec::None => py.None().into_bound(py),
            CompiledSpec::Tuple(c) => PyTuple::new(py, items(c, leaves)?)?.into_any(),
            CompiledSpec::List(c) => PyList::new(py, items(c, leaves)?)?.into_any(),
            CompiledSpec::Dict { ordered, keys, children } => {
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
            CompiledSpec::NamedTuple { ty, children, .. } => {
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
) -> RtError {
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
    Error::Mismatch {
        path: format_path(root, path),
        expected: format!("a dict with keys [{}]", key_list(keys)),
        got: format!("one with {}", what.join(" and ")),
    }
    .into()
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
