//! The execution plan: the validated graph with every op, weight and literal resolved to a
//! Python object once at load, run as a flat loop over value slots.
//!
//! Ops come only from torch's registered op namespaces (`torch.ops.<ns>`) and a fixed table
//! of Python operators for symbolic sizes; nothing named by the file is imported.

use std::collections::BTreeMap;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::artifact;
use crate::error::{Error, Result};
use crate::graph::{ArgPlan, GraphPlan, OpName, OutPlan, ValueRef};
use crate::opschema::{self, Drift};
use crate::schema::{Arg, Constant, Document};

/// Op namespaces a file may use without the caller's say-so.
pub const DEFAULT_NAMESPACES: &[&str] = &["aten", "prims"];

/// Python operators that graphs use on symbolic sizes (`s0 * 4`), by their `operator` name.
const PY_OPERATORS: &[&str] = &[
    "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos", "abs", "eq", "ne", "lt", "le", "gt", "ge",
    "and_", "or_", "not_",
];

const LAYOUTS: &[&str] =
    &["strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged"];
const MEMORY_FORMATS: &[&str] = &["contiguous_format", "channels_last", "channels_last_3d", "preserve_format"];

enum ArgT {
    Slot(usize),
    Const(Py<PyAny>),
    List(Vec<ArgT>),
}

struct Step {
    op: Py<PyAny>,
    args: Vec<ArgT>,
    kwargs: Vec<(Py<PyString>, ArgT)>,
    outputs: OutPlan,
    free: Vec<usize>,
}

pub struct Plan {
    n_slots: usize,
    user_inputs: Vec<(usize, usize)>,
    steps: Vec<Step>,
    outputs: Vec<ArgT>,
}

/// Resolves every op in the table and checks each recorded schema against the running
/// torch, applying op upgraders to `doc`'s nodes where one is registered. Returns the op
/// objects (indexed like `doc.ops`) and notes on compatible drift.
pub fn resolve_ops(
    py: Python<'_>,
    torch: &Bound<'_, PyModule>,
    doc: &mut Document,
    allow: &AllowOps,
) -> PyResult<Result<(Vec<ResolvedOp>, Vec<String>)>> {
    let names = match crate::graph::op_names(&doc.ops) {
        Ok(n) => n,
        Err(e) => return Ok(Err(e)),
    };
    let version: String = torch.getattr("__version__")?.str()?.to_string();
    let mut resolved = Vec::with_capacity(names.len());
    let mut notes = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let what = format!("ops[{i}] ({name})");
        let op = match resolve_op(py, torch, name, allow, &version, &what)? {
            Ok(op) => op,
            Err(e) => return Ok(Err(e)),
        };
        let schema = op.bind(py).getattr("_schema").ok(); // Python operators have none
        let current = schema.as_ref().map(|s| s.str().map(|s| s.to_string())).transpose()?;
        if let (Some(recorded), Some(current)) = (doc.ops[i].schema.clone(), current) {
            match opschema::compare(&recorded, &current) {
                Drift::Identical => {}
                Drift::Compatible(added) => notes.push(format!(
                    "{name}: the running torch {version} adds argument(s) {}; their defaults apply",
                    added.join(", ")
                )),
                Drift::Incompatible => match opschema::find_upgrader(&name.to_string(), &recorded) {
                    Some(u) => {
                        for node in doc.graph.nodes.iter_mut().filter(|n| n.op == i) {
                            if let Err(e) = (u.rewrite)(node) {
                                return Ok(Err(artifact!("{what}: op upgrader {}: {e}", u.name)));
                            }
                        }
                        doc.ops[i].schema = Some(current);
                        notes.push(format!("{name}: op upgrader {} rewrote its nodes for torch {version}", u.name));
                    }
                    None => {
                        return Ok(Err(artifact!(
                            "{what}: the op's schema changed incompatibly and no op upgrader is registered: \
                             saved with torch {} as `{recorded}`, the running torch {version} has `{current}`",
                            doc.producer.torch
                        )))
                    }
                },
            }
        }
        let signature = schema.map(|s| OpSignature::read(&s)).transpose()?;
        // OpOverload.__call__ is a Python frame around `_op`, the C++ callable: skip it.
        let callable = op.bind(py).getattr("_op").map(Bound::unbind).unwrap_or(op);
        resolved.push(ResolvedOp { callable, signature });
    }
    Ok(Ok((resolved, notes)))
}

/// An op from the table, resolved once per load however many nodes call it.
pub struct ResolvedOp {
    callable: Py<PyAny>,
    signature: Option<OpSignature>,
}

/// What node checks need of an op's schema, read from Python once.
struct OpSignature {
    /// `(name, keyword-only, has a default)` per argument.
    params: Vec<(String, bool, bool)>,
    n_returns: usize,
    returns_list: bool,
}

impl OpSignature {
    fn read(schema: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut params = Vec::new();
        for a in schema.getattr("arguments")?.try_iter()? {
            let a = a?;
            let name: String = a.getattr("name")?.extract()?;
            let kwarg_only: bool = a.getattr("kwarg_only")?.extract()?;
            let has_default: bool = a.call_method0("has_default_value")?.extract()?;
            params.push((name, kwarg_only, has_default));
        }
        let returns = schema.getattr("returns")?;
        let n_returns = returns.len()?;
        let returns_list = n_returns == 1 && returns.get_item(0)?.getattr("type")?.str()?.to_string().ends_with("[]");
        Ok(OpSignature { params, n_returns, returns_list })
    }

    /// The node's arguments must fit: no more positionals than the op takes, only names it
    /// has, every argument without a default given, and the right number of returns.
    fn check(&self, step: &crate::graph::StepPlan, what: &str) -> Result<()> {
        let n_positional = self.params.iter().filter(|p| !p.1).count();
        if step.args.len() > n_positional {
            return Err(artifact!("{what}: {} positional arguments, but the op takes {n_positional}", step.args.len()));
        }
        for (name, _) in &step.kwargs {
            match self.params.iter().position(|p| &p.0 == name) {
                None => return Err(artifact!("{what}: the op has no argument {name:?}")),
                Some(i) if i < step.args.len() => {
                    return Err(artifact!("{what}: argument {name:?} given by position and by name"))
                }
                _ => {}
            }
        }
        for (i, (name, _, has_default)) in self.params.iter().enumerate() {
            if !has_default && i >= step.args.len() && !step.kwargs.iter().any(|(k, _)| k == name) {
                return Err(artifact!("{what}: required argument {name:?} is missing"));
            }
        }
        let ok = match &step.outputs {
            OutPlan::None => true,
            OutPlan::One(_) => self.n_returns == 1,
            OutPlan::Many(slots) => self.returns_list || slots.len() <= self.n_returns,
        };
        if !ok {
            return Err(artifact!("{what}: outputs do not match the op's {} returns", self.n_returns));
        }
        Ok(())
    }
}

/// Resolves weights and literals and checks each node against its op's schema. The outer
/// `PyResult` is an unexpected Python failure; the inner `Result` says the file is at fault.
pub fn build(
    py: Python<'_>,
    torch: &Bound<'_, PyModule>,
    graph: &GraphPlan,
    ops: &[ResolvedOp],
    weights: &BTreeMap<String, Py<PyAny>>,
) -> PyResult<Result<Plan>> {
    let mut steps = Vec::with_capacity(graph.steps.len());
    for (i, step) in graph.steps.iter().enumerate() {
        let what = format!("graph.nodes[{i}] ({})", step.op_name); // cheap beside the Python work below
        let op = &ops[step.op];
        if let Some(Err(e)) = op.signature.as_ref().map(|sig| sig.check(step, &what)) {
            return Ok(Err(e));
        }
        let convert = |a: &ArgPlan| arg(py, torch, a, weights, &what);
        let args = match step.args.iter().map(convert).collect::<PyResult<Result<Vec<_>>>>()? {
            Ok(a) => a,
            Err(e) => return Ok(Err(e)),
        };
        let mut kwargs = Vec::with_capacity(step.kwargs.len());
        for (name, a) in &step.kwargs {
            match convert(a)? {
                Ok(v) => kwargs.push((PyString::intern(py, name).unbind(), v)),
                Err(e) => return Ok(Err(e)),
            }
        }
        steps.push(Step {
            op: op.callable.clone_ref(py),
            args,
            kwargs,
            outputs: step.outputs.clone(),
            free: step.free.clone(),
        });
    }
    let outputs = match graph
        .outputs
        .iter()
        .map(|a| arg(py, torch, a, weights, "graph.outputs"))
        .collect::<PyResult<Result<Vec<_>>>>()?
    {
        Ok(o) => o,
        Err(e) => return Ok(Err(e)),
    };
    Ok(Ok(Plan { n_slots: graph.n_slots, user_inputs: graph.user_inputs.clone(), steps, outputs }))
}

/// Ops the caller allows beyond torch's built-in namespaces: `ns::*`, `ns::name` (every
/// overload) or `ns::name.overload`.
#[derive(Debug, Default, Clone)]
pub struct AllowOps(Vec<(String, Option<String>, Option<String>)>);

impl AllowOps {
    pub fn parse(patterns: &[String]) -> std::result::Result<Self, String> {
        let mut out = Vec::new();
        for p in patterns {
            let bad = || {
                format!(
                    "allow_ops: {p:?} is not of the form 'namespace::*', 'namespace::op' or 'namespace::op.overload'"
                )
            };
            let (ns, rest) = p.split_once("::").ok_or_else(bad)?;
            let entry = if rest == "*" {
                (ns.to_owned(), None, None)
            } else {
                let op = OpName::parse(p).ok_or_else(bad)?;
                (op.namespace, Some(op.name), op.overload)
            };
            if OpName::parse(&format!("{}::x", entry.0)).is_none() {
                return Err(bad());
            }
            out.push(entry);
        }
        Ok(AllowOps(out))
    }

    fn allows(&self, op: &OpName) -> bool {
        DEFAULT_NAMESPACES.contains(&op.namespace.as_str())
            || self.0.iter().any(|(ns, name, overload)| {
                *ns == op.namespace
                    && name.as_ref().is_none_or(|n| *n == op.name)
                    && overload.as_ref().is_none_or(|o| Some(o) == op.overload.as_ref())
            })
    }
}

fn resolve_op(
    py: Python<'_>,
    torch: &Bound<'_, PyModule>,
    op: &OpName,
    allow: &AllowOps,
    version: &str,
    what: &str,
) -> PyResult<Result<Py<PyAny>>> {
    if op.namespace == "operator" {
        if op.overload.is_some() || !PY_OPERATORS.contains(&op.name.as_str()) {
            return Ok(Err(artifact!("{what}: operator.{} is not an allowed Python operator", op.name)));
        }
        return Ok(Ok(py.import("operator")?.getattr(op.name.as_str())?.unbind()));
    }
    if !allow.allows(op) {
        return Ok(Err(artifact!(
            "{what}: op namespace {:?} is not allowed (pass allow_ops=[\"{}::*\"] to load it, once its library is registered)",
            op.namespace,
            op.namespace
        )));
    }
    let Some(overload) = &op.overload else {
        return Ok(Err(artifact!("{what}: a torch op needs an overload name, e.g. {}.default", op)));
    };
    let found = torch
        .getattr("ops")?
        .getattr(op.namespace.as_str())
        .and_then(|ns| ns.getattr(op.name.as_str()))
        .and_then(|packet| packet.getattr(overload.as_str()));
    Ok(found.map(Bound::unbind).map_err(|_| {
        artifact!("{what}: op not found in the running torch {version} (custom ops must be registered before loading)")
    }))
}

fn arg(
    py: Python<'_>,
    torch: &Bound<'_, PyModule>,
    a: &ArgPlan,
    weights: &BTreeMap<String, Py<PyAny>>,
    what: &str,
) -> PyResult<Result<ArgT>> {
    Ok(Ok(match a {
        ArgPlan::Value(ValueRef::Slot(s)) => ArgT::Slot(*s),
        ArgPlan::Value(ValueRef::Weight(w)) => ArgT::Const(weights[w].clone_ref(py)),
        ArgPlan::Literal(lit) => match literal(py, torch, lit, what)? {
            Ok(v) => ArgT::Const(v),
            Err(e) => return Ok(Err(e)),
        },
        ArgPlan::List(items) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                match arg(py, torch, item, weights, what)? {
                    Ok(v) => out.push(v),
                    Err(e) => return Ok(Err(e)),
                }
            }
            // A list of constants is built once, here, rather than on every call.
            if out.iter().all(|a| matches!(a, ArgT::Const(_))) {
                let consts = out.iter().map(|a| match a {
                    ArgT::Const(c) => c.bind(py).clone(),
                    _ => unreachable!("all constants"),
                });
                ArgT::Const(PyList::new(py, consts)?.into_any().unbind())
            } else {
                ArgT::List(out)
            }
        }
    }))
}

fn literal(py: Python<'_>, torch: &Bound<'_, PyModule>, lit: &Arg, what: &str) -> PyResult<Result<Py<PyAny>>> {
    let named = |allowed: &[&str], name: &str, kind: &str| -> PyResult<Result<Py<PyAny>>> {
        if allowed.contains(&name) {
            Ok(Ok(torch.getattr(name)?.unbind()))
        } else {
            Ok(Err(artifact!("{what}: unknown {kind} {name:?}")))
        }
    };
    Ok(Ok(match lit {
        Arg::None(()) => py.None(),
        Arg::Bool(b) => b.into_pyobject(py)?.to_owned().into_any().unbind(),
        Arg::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        Arg::Float(f) => f.0.into_pyobject(py)?.into_any().unbind(),
        Arg::Str(s) => PyString::new(py, s).into_any().unbind(),
        Arg::Dtype(d) => match crate::dtype::DType::parse(d) {
            Some(dt) => torch.getattr(dt.name)?.unbind(),
            None => return Ok(Err(artifact!("{what}: unsupported dtype {d:?}"))),
        },
        Arg::Device(d) => match torch.getattr("device")?.call1((d.as_str(),)) {
            Ok(dev) => dev.unbind(),
            Err(_) => return Ok(Err(artifact!("{what}: invalid device {d:?}"))),
        },
        Arg::Layout(l) => return named(LAYOUTS, l, "layout"),
        Arg::MemoryFormat(m) => return named(MEMORY_FORMATS, m, "memory format"),
        Arg::Ref(_) | Arg::List(_) => unreachable!("resolved by graph::plan"),
    }))
}

/// A JSON constant as the Python value it stands for.
pub fn constant_to_py(py: Python<'_>, c: &Constant) -> PyResult<Py<PyAny>> {
    Ok(match c {
        Constant::None(()) => py.None(),
        Constant::Bool(b) => b.into_pyobject(py)?.to_owned().into_any().unbind(),
        Constant::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        Constant::Float(f) => f.0.into_pyobject(py)?.into_any().unbind(),
        Constant::Str(s) => PyString::new(py, s).into_any().unbind(),
        Constant::Tuple(items) => {
            let items = items.iter().map(|i| constant_to_py(py, i)).collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, items)?.into_any().unbind()
        }
        Constant::List(items) => {
            let items = items.iter().map(|i| constant_to_py(py, i)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any().unbind()
        }
    })
}

impl Plan {
    /// Runs the graph on the flat user leaves and returns the flat outputs.
    pub fn run<'py>(&self, py: Python<'py>, leaves: &[Bound<'py, PyAny>]) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut slots: Vec<Option<Bound<'py, PyAny>>> = vec![None; self.n_slots];
        for &(slot, leaf) in &self.user_inputs {
            slots[slot] = Some(leaves[leaf].clone());
        }
        for step in &self.steps {
            let args = step.args.iter().map(|a| value(py, a, &slots)).collect::<PyResult<Vec<_>>>()?;
            let args = PyTuple::new(py, args)?;
            let result = if step.kwargs.is_empty() {
                step.op.bind(py).call1(args)?
            } else {
                let kwargs = PyDict::new(py);
                for (k, a) in &step.kwargs {
                    kwargs.set_item(k.bind(py), value(py, a, &slots)?)?;
                }
                step.op.bind(py).call(args, Some(&kwargs))?
            };
            match &step.outputs {
                OutPlan::None => {}
                OutPlan::One(slot) => {
                    if let Some(s) = slot {
                        slots[*s] = Some(result);
                    }
                }
                OutPlan::Many(out) => {
                    for (i, slot) in out.iter().enumerate() {
                        if let Some(s) = slot {
                            slots[*s] = Some(result.get_item(i)?);
                        }
                    }
                }
            }
            for &s in &step.free {
                slots[s] = None;
            }
        }
        self.outputs.iter().map(|a| value(py, a, &slots)).collect()
    }
}

fn value<'py>(py: Python<'py>, a: &ArgT, slots: &[Option<Bound<'py, PyAny>>]) -> PyResult<Bound<'py, PyAny>> {
    match a {
        ArgT::Slot(s) => slots[*s]
            .clone()
            .ok_or_else(|| PyErr::from(Error::Artifact(format!("kwexport internal error: slot {s} read after free")))),
        ArgT::Const(c) => Ok(c.bind(py).clone()),
        ArgT::List(items) => {
            let items = items.iter().map(|i| value(py, i, slots)).collect::<PyResult<Vec<_>>>()?;
            Ok(PyList::new(py, items)?.into_any())
        }
    }
}
