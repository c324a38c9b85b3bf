//! Treespecs compiled for the call path: dict keys and namedtuple types turned into Python
//! objects once at load, used to flatten a call's values into leaves (dict entries by key,
//! never by order, checking structure as it goes) and to rebuild the outputs.

use kwexport_core::schema::{ChildKey, Constant, ContainerKind, DictEntry, Key, TreeSpec};
use kwexport_core::treespec::{format_path, PathElem};
use kwexport_core::Error;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

use crate::constants::constant_to_py;
use crate::errors::{RtError, RtResult};

/// A treespec with its Python objects resolved, for the call path.
#[derive(Debug)]
pub enum CompiledSpec {
    /// One value.
    Leaf,
    /// `None`.
    None,
    /// A tuple.
    Tuple(Vec<CompiledSpec>),
    /// A list.
    List(Vec<CompiledSpec>),
    /// A dict, `OrderedDict` or `defaultdict`: entries by key.
    Dict {
        /// What outputs are rebuilt as.
        kind: DictKind,
        /// Each key and its label for paths (`'shift'`).
        keys: Vec<(Py<PyAny>, String)>,
        /// One spec per entry.
        children: Vec<CompiledSpec>,
    },
    /// A namedtuple.
    NamedTuple {
        /// The class (the caller's own if it was already imported, else an equivalent one).
        ty: Py<PyType>,
        /// Its name.
        name: String,
        /// Its fields.
        fields: Vec<String>,
        /// One spec per field.
        children: Vec<CompiledSpec>,
    },
    /// A class registered with torch's pytree.
    Container(Box<Container>),
}

/// What a dict spec rebuilds as.
#[derive(Debug)]
pub enum DictKind {
    /// `dict`.
    Plain,
    /// `collections.OrderedDict`, the class.
    Ordered(Py<PyAny>),
    /// `collections.defaultdict`, the class and its factory.
    Default(Py<PyAny>, Py<PyAny>),
}

/// A registered container class's spec, compiled.
#[derive(Debug)]
pub struct Container {
    /// `module.qualname`, for messages and stand-ins.
    class: String,
    /// Each child's key: path steps for messages, objects for stand-ins.
    keys: Vec<ChildKey>,
    key_objects: Py<PyTuple>,
    labels: Vec<String>,
    /// The flatten context recorded at export; an input's must equal it.
    context: Py<PyAny>,
    children: Vec<CompiledSpec>,
    /// torch's registry of pytree classes, for flattening inputs with their own flatten.
    nodes: Py<PyAny>,
    /// The stand-in class, for recognising stand-ins passed back as inputs.
    standin: Py<PyAny>,
    rebuild: Rebuild,
}

/// How a container output is rebuilt.
#[derive(Debug)]
enum Rebuild {
    /// The class's own registered unflatten, called with the values and the context.
    Unflatten(Py<PyAny>),
    /// `kwexport.StandIn(class, keys, values)`: the class isn't imported, or its fields differ.
    StandIn,
}

impl CompiledSpec {
    /// Compiles a validated spec.
    pub fn new(py: Python<'_>, spec: &TreeSpec) -> PyResult<Self> {
        let all = |c: &[TreeSpec]| c.iter().map(|c| CompiledSpec::new(py, c)).collect::<PyResult<Vec<_>>>();
        let dict = |entries: &[DictEntry], kind: DictKind| -> PyResult<CompiledSpec> {
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
            Ok(CompiledSpec::Dict { kind, keys, children })
        };
        let collections = || py.import("collections");
        Ok(match spec {
            TreeSpec::Leaf => CompiledSpec::Leaf,
            TreeSpec::None => CompiledSpec::None,
            TreeSpec::Tuple { children } => CompiledSpec::Tuple(all(children)?),
            TreeSpec::List { children } => CompiledSpec::List(all(children)?),
            TreeSpec::Dict { entries } => dict(entries, DictKind::Plain)?,
            TreeSpec::OrderedDict { entries } => {
                dict(entries, DictKind::Ordered(collections()?.getattr("OrderedDict")?.unbind()))?
            }
            TreeSpec::DefaultDict { factory, entries } => {
                // A name of the core's table of builtins (validated), looked up in `builtins`.
                let factory = match factory {
                    Some(name) => py.import("builtins")?.getattr(name.as_str())?.unbind(),
                    None => py.None(),
                };
                dict(entries, DictKind::Default(collections()?.getattr("defaultdict")?.unbind(), factory))?
            }
            TreeSpec::Container { kind, module, qualname, context, keys, children } => CompiledSpec::Container(
                Box::new(Container::new(py, *kind, module, qualname, context, keys, all(children)?)?),
            ),
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
            CompiledSpec::Container(c) => c.flatten(obj, root, path, out)?,
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
            CompiledSpec::Dict { kind, keys, children } => {
                let values = items(children, leaves)?;
                let dict = PyDict::new(py);
                for ((k, _), v) in keys.iter().zip(values) {
                    dict.set_item(k.bind(py), v)?;
                }
                match kind {
                    DictKind::Plain => dict.into_any(),
                    DictKind::Ordered(cls) => cls.bind(py).call1((dict,))?,
                    DictKind::Default(cls, factory) => cls.bind(py).call1((factory.bind(py), dict))?,
                }
            }
            CompiledSpec::Container(c) => {
                let values = PyList::new(py, items(&c.children, leaves)?)?;
                match &c.rebuild {
                    Rebuild::Unflatten(f) => f.bind(py).call1((values, c.context.bind(py)))?,
                    Rebuild::StandIn => {
                        c.standin.bind(py).call1((&c.class, c.key_objects.bind(py), values.to_tuple()))?
                    }
                }
            }
            CompiledSpec::NamedTuple { ty, children, .. } => {
                ty.bind(py).call1(PyTuple::new(py, items(children, leaves)?)?)?
            }
        })
    }
}

impl Container {
    fn new(
        py: Python<'_>,
        kind: ContainerKind,
        module: &str,
        qualname: &str,
        context: &Constant,
        keys: &[ChildKey],
        children: Vec<CompiledSpec>,
    ) -> PyResult<Self> {
        let key_objects = keys
            .iter()
            .map(|k| match k {
                ChildKey::Attr(a) | ChildKey::Key(Key::Str(a)) => Ok(PyString::new(py, a).into_any()),
                ChildKey::Key(Key::Int(i)) => Ok(i.into_pyobject(py)?.into_any()),
                ChildKey::Index(i) => Ok(i.into_pyobject(py)?.into_any()),
            })
            .collect::<PyResult<Vec<_>>>()?;
        let labels = keys
            .iter()
            .map(|k| match k {
                ChildKey::Attr(a) => a.clone(),
                ChildKey::Key(key) => key.to_string(),
                ChildKey::Index(i) => i.to_string(),
            })
            .collect();
        let nodes = py.import("torch.utils._pytree")?.getattr("SUPPORTED_NODES")?;
        let context = constant_to_py(py, context)?;
        // The class itself only if this process already imported it (nothing is imported
        // for a file), torch's pytree knows it, and it has every recorded field.
        let rebuild = match imported_class(py, module, qualname)? {
            Some(cls) if has_fields(py, kind, &cls, keys)? => match nodes.get_item(&cls) {
                Ok(node) => Rebuild::Unflatten(node.getattr("unflatten_fn")?.unbind()),
                Err(_) => Rebuild::StandIn,
            },
            _ => Rebuild::StandIn,
        };
        Ok(Container {
            class: format!("{module}.{qualname}"),
            keys: keys.to_vec(),
            key_objects: PyTuple::new(py, key_objects)?.unbind(),
            labels,
            context,
            children,
            nodes: nodes.unbind(),
            standin: py.import("kwexport._standin")?.getattr("StandIn")?.unbind(),
            rebuild,
        })
    }

    /// An input of this class (or a stand-in for it): flattened with the class's own pytree
    /// flatten, whose context must be the one recorded at export.
    fn flatten<'s, 'py>(
        &'s self,
        obj: &Bound<'py, PyAny>,
        root: &str,
        path: &mut Vec<PathElem<'s>>,
        out: &mut Vec<Bound<'py, PyAny>>,
    ) -> RtResult<()> {
        let py = obj.py();
        let expected = || format!("a {} with {}", self.class, self.labels.join(", "));
        let mismatch = |got: String, path: &[PathElem<'_>]| {
            RtError::from(Error::Mismatch { path: format_path(root, path), expected: expected(), got })
        };
        let values: Bound<'py, PyAny> = if obj.is_instance(self.standin.bind(py))? {
            let keys = PyTuple::new(py, obj.try_iter()?.collect::<PyResult<Vec<_>>>()?)?;
            let same = obj.getattr("class_name")?.eq(&self.class)? && keys.eq(self.key_objects.bind(py))?;
            if !same {
                return Err(mismatch(obj.repr()?.to_string(), path));
            }
            obj.call_method0("to_tuple")?
        } else {
            let ty = obj.get_type();
            let class = format!("{}.{}", ty.getattr("__module__")?, ty.getattr("__qualname__")?);
            let node = self.nodes.bind(py).get_item(&ty).ok().filter(|_| class == self.class);
            let Some(node) = node else { return Err(mismatch(describe(obj), path)) };
            let flat = node.getattr("flatten_fn")?.call1((obj,))?;
            let (values, context) = (flat.get_item(0)?, flat.get_item(1)?);
            if !context.eq(self.context.bind(py))? {
                return Err(mismatch(format!("one whose pytree context is {}", context.repr()?), path));
            }
            values
        };
        if values.len()? != self.children.len() {
            return Err(mismatch(format!("{} children", values.len()?), path));
        }
        for (i, (child, key)) in self.children.iter().zip(&self.keys).enumerate() {
            path.push(match key {
                ChildKey::Attr(_) => PathElem::Attr(&self.labels[i]),
                ChildKey::Key(_) => PathElem::Key(&self.labels[i]),
                ChildKey::Index(i) => PathElem::Index(*i),
            });
            child.flatten(&values.get_item(i)?, root, path, out)?;
            path.pop();
        }
        Ok(())
    }
}

/// `module.qualname` if the module is already in `sys.modules`; never imports anything.
fn imported_class<'py>(py: Python<'py>, module: &str, qualname: &str) -> PyResult<Option<Bound<'py, PyType>>> {
    let modules = py.import("sys")?.getattr("modules")?;
    let Ok(Some(mut obj)) = modules.cast::<PyDict>().map(|d| d.get_item(module).ok().flatten()) else {
        return Ok(None);
    };
    for part in qualname.split('.') {
        match obj.getattr(part) {
            Ok(next) => obj = next,
            Err(_) => return Ok(None),
        }
    }
    Ok(obj.cast_into::<PyType>().ok())
}

/// Whether a class has every field the file recorded (only dataclass-like kinds are checked).
fn has_fields(py: Python<'_>, kind: ContainerKind, cls: &Bound<'_, PyType>, keys: &[ChildKey]) -> PyResult<bool> {
    if kind == ContainerKind::PytreeNode {
        return Ok(true);
    }
    let dataclasses = py.import("dataclasses")?;
    if !dataclasses.call_method1("is_dataclass", (cls,))?.is_truthy()? {
        return Ok(false);
    }
    let fields: Vec<String> = dataclasses
        .call_method1("fields", (cls,))?
        .try_iter()?
        .map(|f| f?.getattr("name")?.extract())
        .collect::<PyResult<_>>()?;
    Ok(keys.iter().all(|k| match k {
        ChildKey::Attr(name) | ChildKey::Key(Key::Str(name)) => fields.contains(name),
        _ => false,
    }))
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
