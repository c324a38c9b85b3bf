//! Stage 1, ops: which ops a file may call, resolving each to the running torch's op object,
//! reconciling its recorded schema with the running one (op-schema drift, op upgraders), and
//! reading what later stages need of that schema, once per load.
//!
//! Ops come only from torch's registered op namespaces (`torch.ops.<ns>`) and the core's
//! table of Python operators for symbolic sizes; nothing named by the file is imported.

use std::ffi::CString;

use kwexport_core::error::HopProblem;
use kwexport_core::error::NodeProblem;
use kwexport_core::graph::{OpName, SlotArg, SlotNode, SlotOutputs};
use kwexport_core::hops::{self, HopKind};
use kwexport_core::opschema::{self, Drift};
use kwexport_core::schema::{Arg, Float, Method, Producer};
use kwexport_core::tables::{DEFAULT_NAMESPACES, PY_OPERATORS, SYM_FUNCTIONS};
use kwexport_core::Error;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::abi::Ty;
use crate::errors::{RtError, RtResult};

/// Ops the caller allows beyond torch's built-in namespaces: `ns::*`, `ns::name` (every
/// overload) or `ns::name.overload`.
#[derive(Debug, Default, Clone)]
pub struct AllowOps(Vec<(String, Option<String>, Option<String>)>);

impl AllowOps {
    /// Parses the patterns of `kwexport.load(..., allow_ops=...)`.
    pub fn parse(patterns: &[String]) -> Result<Self, String> {
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
            || op.is_pass_op()
            || op.is_quant_op()
            || self.0.iter().any(|(ns, name, overload)| {
                *ns == op.namespace
                    && name.as_ref().is_none_or(|n| *n == op.name)
                    && overload.as_ref().is_none_or(|o| Some(o) == op.overload.as_ref())
            })
    }
}

/// An op from the table, resolved once per load however many nodes call it.
pub struct ResolvedOp {
    /// What to call on the Python path (`None` for higher-order ops, which kwexport runs).
    pub callable: Py<PyAny>,
    /// Its schema in the running torch; `None` for Python operators and higher-order ops.
    pub schema: Option<OpSchema>,
    /// The higher-order op it is, if it is one.
    pub hop: Option<HopKind>,
}

/// Resolves every op in the table and checks each recorded schema against the running
/// torch, applying op upgraders to `doc`'s nodes where one is registered. Returns the op
/// objects (indexed like `doc.ops`) and notes on compatible drift.
pub fn resolve_ops(
    py: Python<'_>,
    torch: &Bound<'_, PyModule>,
    doc: &mut Method,
    producer: &Producer,
    allow: &AllowOps,
) -> RtResult<(Vec<ResolvedOp>, Vec<String>)> {
    let names = kwexport_core::graph::op_names(&doc.ops)?;
    let version: String = torch.getattr("__version__")?.str()?.to_string();
    let mut resolved = Vec::with_capacity(names.len());
    let mut notes = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let entry = format!("ops[{i}] ({name})");
        if name.namespace == hops::NAMESPACE {
            let hop = HopKind::parse(name)
                .ok_or_else(|| Error::Hop { at: entry.clone(), problem: HopProblem::Unsupported(name.name.clone()) })?;
            resolved.push(ResolvedOp { callable: py.None(), schema: None, hop: Some(hop) });
            continue;
        }
        let op = resolve_op(py, torch, name, allow, &version, &entry)?;
        let schema = op.bind(py).getattr("_schema").ok(); // Python operators have none
        let current = schema.as_ref().map(|s| s.str().map(|s| s.to_string())).transpose()?;
        if let (Some(recorded), Some(current)) = (doc.ops[i].schema.clone(), current.clone()) {
            match opschema::compare(&recorded, &current) {
                Drift::Identical => {}
                Drift::Compatible(added) => notes.push(format!(
                    "{name}: the running torch {version} adds argument(s) {}; their defaults apply",
                    added.join(", ")
                )),
                Drift::Incompatible => match opschema::find_upgrader(&name.to_string(), &recorded) {
                    Some(u) => {
                        for node in doc.graph.nodes.iter_mut().filter(|n| n.op == i) {
                            (u.rewrite)(node).map_err(|problem| Error::OpUpgrade {
                                entry: entry.clone(),
                                upgrader: u.name,
                                problem,
                            })?;
                        }
                        doc.ops[i].schema = Some(current);
                        notes.push(format!("{name}: op upgrader {} rewrote its nodes for torch {version}", u.name));
                    }
                    None => {
                        return Err(Error::OpSchemaChanged {
                            entry,
                            saved_torch: producer.torch.clone(),
                            recorded,
                            torch: version,
                            current,
                        }
                        .into())
                    }
                },
            }
        }
        if doc.ops[i].schema.is_none() && DEFAULT_NAMESPACES.contains(&name.namespace.as_str()) {
            // An aten op a pass inserted records no schema: the running torch's is the one it
            // runs with, which constant folding reads (what the op returns and writes).
            doc.ops[i].schema = current;
        }
        let schema = schema.map(|s| OpSchema::read(&s)).transpose()?;
        // OpOverload.__call__ is a Python frame around `_op`, the C++ callable: skip it. An op
        // a load-time pass inserts runs, off its C path, as kwexport's Python form of what it
        // replaced (`kwexport._passes`): torch's fused kernel takes fewer inputs than the
        // ops it stands for (no autograd, no unbatched or float64 input).
        let callable = if name.is_pass_op() {
            // One function per overload: `_convolution_pointwise_binary` for `.binary`.
            let function = match name.overload.as_deref() {
                None | Some("default") => name.name.clone(),
                Some(overload) => format!("{}_{overload}", name.name),
            };
            py.import("kwexport._passes")?.getattr(function.as_str())?.unbind()
        } else {
            op.bind(py).getattr("_op").map(Bound::unbind).unwrap_or(op)
        };
        resolved.push(ResolvedOp { callable, schema, hop: None });
    }
    Ok((resolved, notes))
}

fn resolve_op(
    py: Python<'_>,
    torch: &Bound<'_, PyModule>,
    op: &OpName,
    allow: &AllowOps,
    version: &str,
    entry: &str,
) -> RtResult<Py<PyAny>> {
    let entry = entry.to_owned();
    if op.namespace == "operator" {
        if op.overload.is_some() || !PY_OPERATORS.contains(&op.name.as_str()) {
            return Err(Error::OperatorNotAllowed { entry, name: op.name.clone() }.into());
        }
        return Ok(py.import("operator")?.getattr(op.name.as_str())?.unbind());
    }
    if op.namespace == "torch" {
        if op.overload.is_some() || !SYM_FUNCTIONS.contains(&op.name.as_str()) {
            return Err(Error::SymFunctionNotAllowed { entry, name: op.name.clone() }.into());
        }
        return Ok(torch.getattr(op.name.as_str())?.unbind());
    }
    if !allow.allows(op) {
        return Err(Error::NamespaceNotAllowed { entry, namespace: op.namespace.clone() }.into());
    }
    let Some(overload) = &op.overload else {
        return Err(Error::MissingOverload { entry, op: op.to_string() }.into());
    };
    if op.is_quant_op() {
        // A node `passes::quantized_ops` left: torch's op, whose library this torch module
        // registers (part of torch, not of the file).
        py.import("torch.ao.quantization.fx._decomposed")?;
    }
    if op.is_pass_op() && op.namespace == "kwexport" {
        // kwexport's own ops (`passes::linear_int8`, `passes::linear_measured`), which its
        // Python package defines.
        py.import("kwexport._passes")?.call_method0("define_ops")?;
    }
    let found = torch
        .getattr("ops")?
        .getattr(op.namespace.as_str())
        .and_then(|ns| ns.getattr(op.name.as_str()))
        .and_then(|packet| packet.getattr(overload.as_str()));
    found.map(Bound::unbind).map_err(|_| RtError::from(Error::OpNotFound { entry, torch: version.to_owned() }))
}

/// One argument of an op's schema.
pub struct SchemaArg {
    /// Its name.
    pub name: String,
    /// Whether it can only be passed by name.
    pub kwarg_only: bool,
    /// `None` without a default; `Some(None)` for a default kwexport can't express.
    pub default: Option<Option<SlotArg>>,
    /// The type as the C ABI sees it, if it covers it.
    pub ty: Option<Ty>,
    /// The type as the schema spells it, for `Program.dispatch`.
    pub type_name: String,
    /// The op writes to this argument (`Tensor(a!)`).
    pub writes: bool,
}

impl SchemaArg {
    /// Whether the op takes a tensor here (so a number passed here is wrapped as torch
    /// wraps it).
    pub fn takes_tensor(&self) -> bool {
        !self.writes && matches!(&self.ty, Some(Ty::Tensor))
            || matches!(&self.ty, Some(Ty::Optional(t)) if **t == Ty::Tensor)
    }
}

/// What node checks and the C path need of an op's schema, read from Python once per load.
pub struct OpSchema {
    /// The arguments, in order.
    pub args: Vec<SchemaArg>,
    /// How many values it returns.
    pub n_returns: usize,
    /// Whether its one return is a list.
    pub returns_list: bool,
    /// Return types as the C ABI sees them; `None` if some isn't covered.
    pub c_returns: Option<Vec<Ty>>,
    /// Return types as the schema spells them, for `Program.dispatch`.
    pub return_types: String,
    /// The op's name and overload for the dispatcher (`""` for `default`).
    pub c_name: (CString, CString),
}

impl OpSchema {
    fn read(schema: &Bound<'_, PyAny>) -> RtResult<Self> {
        let mut args = Vec::new();
        for a in schema.getattr("arguments")?.try_iter()? {
            let a = a?;
            let has_default: bool = a.call_method0("has_default_value")?.extract()?;
            let type_name = a.getattr("real_type")?.str()?.to_string();
            let writes =
                a.getattr("alias_info")?.getattr("is_write").ok().map(|w| w.is_truthy()).transpose()?.unwrap_or(false);
            args.push(SchemaArg {
                name: a.getattr("name")?.extract()?,
                kwarg_only: a.getattr("kwarg_only")?.extract()?,
                default: has_default.then(|| default_arg(&a.getattr("default_value")?)).transpose()?,
                ty: Ty::parse(&type_name),
                type_name,
                writes,
            });
        }
        let returns = schema.getattr("returns")?;
        let mut c_returns = Some(Vec::new());
        let mut names = Vec::new();
        for r in returns.try_iter()? {
            let name = r?.getattr("real_type")?.str()?.to_string();
            let ty = Ty::parse(&name);
            names.push(name);
            c_returns = c_returns.zip(ty).map(|(mut v, t)| {
                v.push(t);
                v
            });
        }
        let n_returns = returns.len()?;
        let returns_list =
            n_returns == 1 && returns.get_item(0)?.getattr("type")?.str()?.to_string().starts_with("List[");
        let cstring = |s: String| CString::new(s).map_err(|e| RtError::Internal(format!("op name: {e}")));
        let c_name =
            (cstring(schema.getattr("name")?.extract()?)?, cstring(schema.getattr("overload_name")?.extract()?)?);
        let return_types = format!("({})", names.join(", "));
        Ok(OpSchema { args, n_returns, returns_list, c_returns, return_types, c_name })
    }

    /// The node's arguments must fit: no more positionals than the op takes, only names it
    /// has, every argument without a default given, and the right number of returns.
    pub fn check(&self, node: &SlotNode, at: impl Fn() -> String) -> Result<(), Error> {
        let err = |problem| Error::NodeArgs { at: at(), problem };
        let n_positional = self.args.iter().filter(|p| !p.kwarg_only).count();
        if node.args.len() > n_positional {
            return Err(err(NodeProblem::TooManyPositional { given: node.args.len(), takes: n_positional }));
        }
        for (name, _) in &node.kwargs {
            match self.args.iter().position(|p| &p.name == name) {
                None => return Err(err(NodeProblem::NoSuchArgument(name.clone()))),
                Some(i) if i < node.args.len() => return Err(err(NodeProblem::GivenTwice(name.clone()))),
                _ => {}
            }
        }
        for (i, p) in self.args.iter().enumerate() {
            if p.default.is_none() && i >= node.args.len() && !node.kwargs.iter().any(|(k, _)| *k == p.name) {
                return Err(err(NodeProblem::Missing(p.name.clone())));
            }
        }
        let ok = match &node.outputs {
            SlotOutputs::None => true,
            SlotOutputs::One(_) => self.n_returns == 1,
            SlotOutputs::Many(slots) => self.returns_list || slots.len() <= self.n_returns,
        };
        if !ok {
            return Err(err(NodeProblem::Returns(self.n_returns)));
        }
        Ok(())
    }

    /// The value for each argument, in schema order: given by position or name, or the
    /// default; `None` where a default can't be expressed.
    pub fn bind<'a>(&'a self, node: &'a SlotNode) -> Option<Vec<&'a SlotArg>> {
        self.args
            .iter()
            .enumerate()
            .map(|(i, p)| match node.args.get(i) {
                Some(a) => Some(a),
                None => node.kwargs.iter().find(|(k, _)| *k == p.name).map(|(_, a)| a).or(p.default.as_ref()?.as_ref()),
            })
            .collect()
    }

    /// The argument a positional or named value goes to.
    pub fn arg(&self, position: Option<usize>, name: Option<&str>) -> Option<&SchemaArg> {
        match (position, name) {
            (Some(i), _) => self.args.get(i),
            (None, Some(n)) => self.args.iter().find(|p| p.name == n),
            _ => None,
        }
    }
}

/// A schema default as a literal: `None`, numbers, strings, lists of them, dtypes, layouts,
/// memory formats, devices. `None` for anything else.
fn default_arg(v: &Bound<'_, PyAny>) -> PyResult<Option<SlotArg>> {
    let lit = |a: Arg| Ok(Some(SlotArg::Literal(a)));
    if v.is_none() {
        return lit(Arg::None(()));
    }
    if let Ok(b) = v.cast::<PyBool>() {
        return lit(Arg::Bool(b.is_true()));
    }
    if v.is_instance_of::<PyInt>() {
        return v.extract::<i64>().map_or(Ok(None), |i| lit(Arg::Int(i)));
    }
    if v.is_instance_of::<PyFloat>() {
        return lit(Arg::Float(Float(v.extract()?)));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return lit(Arg::Str(s.to_str()?.to_owned()));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let mut items = Vec::new();
        for item in v.try_iter()? {
            match default_arg(&item?)? {
                Some(a) => items.push(a),
                None => return Ok(None),
            }
        }
        return Ok(Some(SlotArg::List(items)));
    }
    let kind = v.get_type().name()?.to_string();
    let text = v.str()?.to_string();
    let name = text.strip_prefix("torch.").unwrap_or(&text).to_owned();
    match kind.as_str() {
        "dtype" => lit(Arg::Dtype(name)),
        "layout" => lit(Arg::Layout(name)),
        "memory_format" => lit(Arg::MemoryFormat(name)),
        "device" => lit(Arg::Device(text)),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_ops_patterns() {
        let a = AllowOps::parse(&["mylib::*".into(), "other::scale.default".into()]).unwrap();
        let op = |s: &str| OpName::parse(s).unwrap();
        assert!(a.allows(&op("aten::add.Tensor")));
        assert!(a.allows(&op("mylib::anything.default")));
        assert!(a.allows(&op("other::scale.default")));
        assert!(!a.allows(&op("other::scale.out")));
        assert!(!a.allows(&op("evil::x.default")));
        for bad in ["mylib", "my lib::*", "::*", "a::b.c.d"] {
            assert!(AllowOps::parse(&[bad.into()]).is_err(), "{bad}");
        }
    }
}
