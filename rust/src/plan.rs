//! The execution plan: the validated graph with every op, weight and literal resolved once
//! at load, run as a flat loop over value slots.
//!
//! Each node runs through torch's stable C ABI (`dispatch`) where it covers the node, or
//! through torch's Python op object otherwise. Consecutive nodes of one kind form a
//! segment; C segments run with the GIL released. Values cross between the two forms
//! only where a segment reads what the other kind produced, in one batched call each way,
//! and the slots to convert are worked out here, at load.
//!
//! Ops come only from torch's registered op namespaces (`torch.ops.<ns>`) and a fixed table
//! of Python operators for symbolic sizes; nothing named by the file is imported.

use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::abi::{self, Abi, Ty};
use crate::artifact;
use crate::dispatch::{AbiOp, AbiStep, Consts, Native};
use crate::error::{Error, Result};
use crate::graph::{visit_slots, ArgPlan, GraphPlan, OpName, OutPlan, StepPlan, ValueRef};
use crate::opschema::{self, Drift};
use crate::schema::{Arg, Constant, Document, Float};

/// Op namespaces a file may use without the caller's say-so.
pub const DEFAULT_NAMESPACES: &[&str] = &["aten", "prims"];

/// Python operators that graphs use on symbolic sizes (`s0 * 4`), by their `operator` name.
const PY_OPERATORS: &[&str] = &[
    "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos", "abs", "eq", "ne", "lt", "le", "gt", "ge",
    "and_", "or_", "not_",
];

pub(crate) const LAYOUTS: &[&str] =
    &["strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged"];
pub(crate) const MEMORY_FORMATS: &[&str] =
    &["contiguous_format", "channels_last", "channels_last_3d", "preserve_format"];

/// Which dispatch paths a plan may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    /// The stable C ABI where it covers a node and saves more than the conversions around
    /// it cost; Python otherwise.
    Auto,
    /// The stable C ABI for every node it covers, whatever the cost.
    Abi,
    /// torch's Python op objects for every node.
    Python,
}

impl Dispatch {
    pub fn parse(s: &str) -> Option<Dispatch> {
        match s {
            "auto" => Some(Dispatch::Auto),
            "abi" => Some(Dispatch::Abi),
            "python" => Some(Dispatch::Python),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dispatch::Auto => "auto",
            Dispatch::Abi => "abi",
            Dispatch::Python => "python",
        }
    }
}

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

enum Segment {
    Python {
        /// Slots whose native values are read here: converted to Python first.
        to_py: Vec<usize>,
        steps: Vec<Step>,
    },
    Abi {
        /// Slots whose Python values are read here: converted to native first.
        to_native: Vec<usize>,
        steps: Vec<AbiStep>,
        /// Python forms of the slots these steps free, dropped once the GIL is back.
        free_py: Vec<usize>,
        /// How long the segment took last time, in nanoseconds.
        last_ns: AtomicU64,
    },
}

/// C segments that took at least this long last time run with the GIL released. Shorter ones
/// keep it: with several threads, handing the GIL over costs more than a few small ops.
const RELEASE_GIL_AFTER_NS: u64 = 20_000;

pub struct Plan {
    n_slots: usize,
    user_inputs: Vec<(usize, usize)>,
    segments: Vec<Segment>,
    /// Native slots the outputs read, converted after the last segment.
    outputs_to_py: Vec<usize>,
    outputs: Vec<ArgT>,
    abi: Option<&'static Abi>,
    /// Weights and wrapped numbers that C steps read, as handles.
    consts: Vec<abi::Tensor>,
    tensor_type: Py<PyAny>,
    /// Nodes on each path: `(stable ABI, Python)`.
    pub counts: (usize, usize),
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

/// One argument of an op's schema.
struct Param {
    name: String,
    kwarg_only: bool,
    /// `None` without a default; `Some(None)` for a default kwexport can't express.
    default: Option<Option<ArgPlan>>,
    /// The type as the C ABI sees it, if it covers it.
    ty: Option<Ty>,
    /// The op writes to this argument (`Tensor(a!)`).
    writes: bool,
}

/// What node checks and the C path need of an op's schema, read from Python once.
struct OpSignature {
    params: Vec<Param>,
    n_returns: usize,
    returns_list: bool,
    abi: AbiOp,
}

impl OpSignature {
    fn read(schema: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut params = Vec::new();
        for a in schema.getattr("arguments")?.try_iter()? {
            let a = a?;
            let has_default: bool = a.call_method0("has_default_value")?.extract()?;
            let writes =
                a.getattr("alias_info")?.getattr("is_write").ok().map(|w| w.is_truthy()).transpose()?.unwrap_or(false);
            params.push(Param {
                name: a.getattr("name")?.extract()?,
                kwarg_only: a.getattr("kwarg_only")?.extract()?,
                default: has_default.then(|| default_arg(&a.getattr("default_value")?)).transpose()?,
                ty: Ty::parse(&a.getattr("real_type")?.str()?.to_string()),
                writes,
            });
        }
        let returns = schema.getattr("returns")?;
        let mut return_types = Some(Vec::new());
        for r in returns.try_iter()? {
            let ty = Ty::parse(&r?.getattr("real_type")?.str()?.to_string());
            return_types = return_types.zip(ty).map(|(mut v, t)| {
                v.push(t);
                v
            });
        }
        let n_returns = returns.len()?;
        let returns_list =
            n_returns == 1 && returns.get_item(0)?.getattr("type")?.str()?.to_string().starts_with("List[");
        let cstring = |s: String| CString::new(s).map_err(|e| PyRuntimeError::new_err(e.to_string()));
        let abi = AbiOp {
            op: cstring(schema.getattr("name")?.extract()?)?,
            overload: cstring(schema.getattr("overload_name")?.extract()?)?,
            params: params.iter().map(|p| (p.ty.clone(), p.writes)).collect(),
            returns: return_types,
        };
        Ok(OpSignature { params, n_returns, returns_list, abi })
    }

    /// The node's arguments must fit: no more positionals than the op takes, only names it
    /// has, every argument without a default given, and the right number of returns.
    fn check(&self, step: &StepPlan, what: impl Fn() -> String) -> Result<()> {
        let n_positional = self.params.iter().filter(|p| !p.kwarg_only).count();
        if step.args.len() > n_positional {
            return Err(artifact!(
                "{}: {} positional arguments, but the op takes {n_positional}",
                what(),
                step.args.len()
            ));
        }
        for (name, _) in &step.kwargs {
            match self.params.iter().position(|p| &p.name == name) {
                None => return Err(artifact!("{}: the op has no argument {name:?}", what())),
                Some(i) if i < step.args.len() => {
                    return Err(artifact!("{}: argument {name:?} given by position and by name", what()))
                }
                _ => {}
            }
        }
        for (i, p) in self.params.iter().enumerate() {
            if p.default.is_none() && i >= step.args.len() && !step.kwargs.iter().any(|(k, _)| *k == p.name) {
                return Err(artifact!("{}: required argument {:?} is missing", what(), p.name));
            }
        }
        let ok = match &step.outputs {
            OutPlan::None => true,
            OutPlan::One(_) => self.n_returns == 1,
            OutPlan::Many(slots) => self.returns_list || slots.len() <= self.n_returns,
        };
        if !ok {
            return Err(artifact!("{}: outputs do not match the op's {} returns", what(), self.n_returns));
        }
        Ok(())
    }

    /// The value for each parameter, in schema order: given by position or name, or the
    /// default; `None` where a default can't be expressed.
    fn bind<'a>(&'a self, step: &'a StepPlan) -> Option<Vec<&'a ArgPlan>> {
        self.params
            .iter()
            .enumerate()
            .map(|(i, p)| match step.args.get(i) {
                Some(a) => Some(a),
                None => step.kwargs.iter().find(|(k, _)| *k == p.name).map(|(_, a)| a).or(p.default.as_ref()?.as_ref()),
            })
            .collect()
    }

    /// The parameter a positional or named argument goes to.
    fn param(&self, position: Option<usize>, name: Option<&str>) -> Option<&Param> {
        match (position, name) {
            (Some(i), _) => self.params.get(i),
            (None, Some(n)) => self.params.iter().find(|p| p.name == n),
            _ => None,
        }
    }
}

/// A schema default as a literal: `None`, numbers, strings, lists of them, dtypes, layouts,
/// memory formats, devices. `None` for anything else.
fn default_arg(v: &Bound<'_, PyAny>) -> PyResult<Option<ArgPlan>> {
    let lit = |a: Arg| Ok(Some(ArgPlan::Literal(a)));
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
        return Ok(Some(ArgPlan::List(items)));
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

/// Constant tensors for the plan: weights, and numbers wrapped as torch wraps a number
/// passed where an op takes a tensor, each made once per load.
struct ConstTable<'a, 'py> {
    py: Python<'py>,
    torch: &'a Bound<'py, PyModule>,
    weights: &'a BTreeMap<String, Py<PyAny>>,
    /// Tensors C steps read, by index; handles are made for all of them at the end.
    tensors: Vec<Py<PyAny>>,
    weight_index: HashMap<String, usize>,
    /// Wrapped numbers by `number_key`, with their index in `tensors` once a C step uses them.
    numbers: Vec<((u8, u64), Option<Py<PyAny>>, Option<usize>)>,
}

impl ConstTable<'_, '_> {
    fn wrapped(&mut self, lit: &Arg) -> Option<(usize, Py<PyAny>)> {
        let key = number_key(lit)?;
        let i = match self.numbers.iter().position(|(k, _, _)| *k == key) {
            Some(i) => i,
            None => {
                let t = wrapped_number(self.py, self.torch, lit).ok().flatten();
                self.numbers.push((key, t, None));
                self.numbers.len() - 1
            }
        };
        self.numbers[i].1.as_ref().map(|t| (i, t.clone_ref(self.py)))
    }
}

/// A number literal's kind and bits: `1`, `1.0`, `-0.0` and `True` wrap differently.
fn number_key(lit: &Arg) -> Option<(u8, u64)> {
    match lit {
        Arg::Int(i) => Some((0, *i as u64)),
        Arg::Float(f) => Some((1, f.0.to_bits())),
        Arg::Bool(b) => Some((2, *b as u64)),
        _ => None,
    }
}

impl Consts for ConstTable<'_, '_> {
    fn weight(&mut self, name: &str) -> usize {
        if let Some(&i) = self.weight_index.get(name) {
            return i;
        }
        self.tensors.push(self.weights[name].clone_ref(self.py));
        self.weight_index.insert(name.to_owned(), self.tensors.len() - 1);
        self.tensors.len() - 1
    }

    fn number(&mut self, lit: &Arg) -> Option<usize> {
        let (i, t) = self.wrapped(lit)?;
        if let Some(at) = self.numbers[i].2 {
            return Some(at);
        }
        self.tensors.push(t);
        self.numbers[i].2 = Some(self.tensors.len() - 1);
        self.numbers[i].2
    }
}

/// A number as torch passes it to a `Tensor` argument: a 0-dim "wrapped number" tensor,
/// which type promotion treats like the scalar it came from (`int32_tensor * 0.5` is
/// float32, not float64). torch has no public constructor for one, so it is taken from
/// autograd's record of a multiplication by the number, then checked to promote exactly as
/// the number does; `None` if anything differs, and the node keeps the plain number.
fn wrapped_number<'py>(py: Python<'py>, torch: &Bound<'py, PyModule>, lit: &Arg) -> PyResult<Option<Py<PyAny>>> {
    let value = match lit {
        Arg::Int(i) => i.into_pyobject(py)?.into_any(),
        Arg::Float(f) => f.0.into_pyobject(py)?.into_any(),
        Arg::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        _ => return Ok(None),
    };
    let c = torch.getattr("_C")?;
    let was_enabled = torch.call_method0("is_grad_enabled")?;
    c.call_method1("_set_grad_enabled", (true,))?;
    let taken = (|| -> PyResult<Bound<'py, PyAny>> {
        let kw = PyDict::new(py);
        kw.set_item("requires_grad", true)?;
        let probe = torch.call_method("zeros", (PyTuple::empty(py),), Some(&kw))?;
        probe.call_method1("mul", (&value,))?.getattr("grad_fn")?.getattr("_saved_other")
    })();
    c.call_method1("_set_grad_enabled", (was_enabled,))?;
    let Ok(wrapped) = taken else { return Ok(None) };
    let promotes_alike = |dtype: &str, shape: Vec<usize>| -> PyResult<bool> {
        let kw = PyDict::new(py);
        kw.set_item("dtype", torch.getattr(dtype)?)?;
        let t = torch.call_method("zeros", (shape,), Some(&kw))?;
        let a = torch.call_method1("result_type", (&t, &wrapped))?;
        let b = torch.call_method1("result_type", (&t, &value))?;
        a.eq(b)
    };
    let same = wrapped.getattr("dim")?.call0()?.extract::<usize>()? == 0
        && wrapped.call_method0("item")?.eq(&value)?
        && wrapped.getattr("requires_grad")?.extract::<bool>().map(|r| !r)?
        && promotes_alike("int32", vec![])?
        && promotes_alike("bool", vec![2])?
        && promotes_alike("float16", vec![])?;
    Ok(same.then(|| wrapped.unbind()))
}

/// Resolves weights and literals, checks each node against its op's schema, and chooses
/// each node's path. The outer `PyResult` is an unexpected Python failure; the inner
/// `Result` says the file is at fault.
pub fn build(
    py: Python<'_>,
    torch: &Bound<'_, PyModule>,
    graph: &GraphPlan,
    ops: &[ResolvedOp],
    weights: &BTreeMap<String, Py<PyAny>>,
    leaf_is_tensor: &[bool],
    dispatch: Dispatch,
) -> PyResult<Result<Plan>> {
    let abi = match dispatch {
        Dispatch::Auto | Dispatch::Abi => Abi::get(py),
        Dispatch::Python => None,
    };
    let mut consts =
        ConstTable { py, torch, weights, tensors: Vec::new(), weight_index: HashMap::new(), numbers: Vec::new() };
    // Which slots always hold tensors: tensor user leaves, and node outputs whose schema
    // return is a tensor. (Python operators on sizes return numbers.)
    let mut tensor_slot = vec![false; graph.n_slots];
    for &(slot, leaf) in &graph.user_inputs {
        tensor_slot[slot] = leaf_is_tensor.get(leaf).copied().unwrap_or(false);
    }
    for step in &graph.steps {
        let returns = ops[step.op].signature.as_ref().and_then(|s| s.abi.returns.as_deref()).unwrap_or(&[]);
        for (i, s) in step.outputs.defined() {
            tensor_slot[s] = match returns {
                [Ty::List(inner)] => **inner == Ty::Tensor,
                _ => returns.get(i) == Some(&Ty::Tensor),
            };
        }
    }
    let is_tensor = |s: usize| tensor_slot[s];
    let mut compiled = Vec::with_capacity(graph.steps.len());
    for (i, step) in graph.steps.iter().enumerate() {
        let op = &ops[step.op];
        if let Some(sig) = &op.signature {
            if let Err(e) = sig.check(step, || format!("graph.nodes[{i}] ({})", step.op_name)) {
                return Ok(Err(e));
            }
        }
        compiled.push(abi.zip(op.signature.as_ref()).and_then(|(abi, sig)| {
            let bound = sig.bind(step)?;
            AbiStep::compile(abi, &sig.abi, step, &bound, &is_tensor, &mut consts)
        }));
    }
    if dispatch == Dispatch::Auto {
        keep_profitable(&mut compiled, graph);
    }
    let mut execs = Vec::with_capacity(graph.steps.len());
    for (i, (step, c)) in graph.steps.iter().zip(compiled).enumerate() {
        match c {
            Some(s) => execs.push(Exec::Abi(s)),
            None => match python_step(py, torch, step, &ops[step.op], weights, &mut consts, i)? {
                Ok(s) => execs.push(Exec::Python(s)),
                Err(e) => return Ok(Err(e)),
            },
        }
    }
    let outputs = match graph
        .outputs
        .iter()
        .map(|a| arg(py, torch, a, weights, None, &mut consts, "graph.outputs"))
        .collect::<PyResult<Result<Vec<_>>>>()?
    {
        Ok(o) => o,
        Err(e) => return Ok(Err(e)),
    };
    let handles = match abi {
        Some(abi) => consts.tensors.iter().map(|t| abi.handle_of(t.bind(py))).collect::<PyResult<Vec<_>>>()?,
        None => Vec::new(),
    };
    let n_abi = execs.iter().filter(|e| matches!(e, Exec::Abi(_))).count();
    let (segments, outputs_to_py) = segment(graph, execs);
    Ok(Ok(Plan {
        n_slots: graph.n_slots,
        user_inputs: graph.user_inputs.clone(),
        segments,
        outputs_to_py,
        outputs,
        abi,
        consts: handles,
        tensor_type: torch.getattr("Tensor")?.unbind(),
        counts: (n_abi, graph.steps.len() - n_abi),
    }))
}

enum Exec {
    Python(Step),
    Abi(AbiStep),
}

// Rough costs in tenths of a microsecond (2-core x86 VM, torch 2.13, small tensors): a node
// through the C ABI saves about 0.5 µs over torch's Python op object; a value crossing
// between the paths costs about 0.2 µs to a handle and 0.3 µs to a Python tensor; a change
// of path about 0.1 µs.
const SAVED_PER_NODE: usize = 5;
const TO_NATIVE: usize = 2;
const TO_PY: usize = 3;
const SWITCH: usize = 1;

/// Sends a run of C-capable nodes back to Python where converting values into and out of
/// it would cost more than it saves: a lone `mul` between two Python `add`s, say.
fn keep_profitable(compiled: &mut [Option<AbiStep>], graph: &GraphPlan) {
    // The last step that reads each slot; the outputs read "after" every step.
    let mut last_read = vec![None; graph.n_slots];
    for (i, step) in graph.steps.iter().enumerate() {
        step.visit_reads(&mut |s| last_read[s] = Some(i));
    }
    graph.outputs.iter().for_each(|a| visit_slots(a, &mut |s| last_read[s] = Some(usize::MAX)));

    let mut start = 0;
    while start < compiled.len() {
        if compiled[start].is_none() {
            start += 1;
            continue;
        }
        let end = (start..compiled.len()).find(|&i| compiled[i].is_none()).unwrap_or(compiled.len());
        let mut defined = std::collections::HashSet::new();
        let (mut to_native, mut to_py) = (std::collections::HashSet::new(), 0);
        for step in &graph.steps[start..end] {
            step.visit_reads(&mut |s| {
                if !defined.contains(&s) {
                    to_native.insert(s);
                }
            });
            defined.extend(step.outputs.defined().map(|(_, s)| s));
        }
        for &s in &defined {
            if last_read[s].is_some_and(|r| r >= end) {
                to_py += 1;
            }
        }
        let cost = 2 * SWITCH + TO_NATIVE * to_native.len() + TO_PY * to_py;
        if cost > SAVED_PER_NODE * (end - start) {
            compiled[start..end].iter_mut().for_each(|c| *c = None);
        }
        start = end;
    }
}

fn python_step(
    py: Python<'_>,
    torch: &Bound<'_, PyModule>,
    step: &StepPlan,
    op: &ResolvedOp,
    weights: &BTreeMap<String, Py<PyAny>>,
    consts: &mut ConstTable<'_, '_>,
    i: usize,
) -> PyResult<Result<Step>> {
    let what = format!("graph.nodes[{i}] ({})", step.op_name);
    let sig = op.signature.as_ref();
    let mut args = Vec::with_capacity(step.args.len());
    for (position, a) in step.args.iter().enumerate() {
        match arg(py, torch, a, weights, sig.and_then(|s| s.param(Some(position), None)), consts, &what)? {
            Ok(v) => args.push(v),
            Err(e) => return Ok(Err(e)),
        }
    }
    let mut kwargs = Vec::with_capacity(step.kwargs.len());
    for (name, a) in &step.kwargs {
        match arg(py, torch, a, weights, sig.and_then(|s| s.param(None, Some(name))), consts, &what)? {
            Ok(v) => kwargs.push((PyString::intern(py, name).unbind(), v)),
            Err(e) => return Ok(Err(e)),
        }
    }
    Ok(Ok(Step { op: op.callable.clone_ref(py), args, kwargs, outputs: step.outputs.clone(), free: step.free.clone() }))
}

/// Groups steps into segments and works out, by following the slots through them in order,
/// which values each segment must convert before it runs.
fn segment(graph: &GraphPlan, execs: Vec<Exec>) -> (Vec<Segment>, Vec<usize>) {
    let n = graph.n_slots;
    let (mut has_py, mut has_native) = (vec![false; n], vec![false; n]);
    for &(slot, _) in &graph.user_inputs {
        has_py[slot] = true;
    }
    let mut segments: Vec<Segment> = Vec::new();
    let mut reads = Vec::new();
    for exec in execs {
        match exec {
            Exec::Python(step) => {
                if !matches!(segments.last(), Some(Segment::Python { .. })) {
                    segments.push(Segment::Python { to_py: Vec::new(), steps: Vec::new() });
                }
                let Some(Segment::Python { to_py, steps }) = segments.last_mut() else { unreachable!() };
                reads.clear();
                step.args.iter().chain(step.kwargs.iter().map(|(_, a)| a)).for_each(|a| slots_of(a, &mut reads));
                for &s in &reads {
                    if !has_py[s] {
                        has_py[s] = true;
                        to_py.push(s);
                    }
                }
                for (_, s) in step.outputs.defined() {
                    (has_py[s], has_native[s]) = (true, false);
                }
                for &s in &step.free {
                    (has_py[s], has_native[s]) = (false, false);
                }
                steps.push(step);
            }
            Exec::Abi(step) => {
                if !matches!(segments.last(), Some(Segment::Abi { .. })) {
                    segments.push(Segment::Abi {
                        to_native: Vec::new(),
                        steps: Vec::new(),
                        free_py: Vec::new(),
                        last_ns: AtomicU64::new(0),
                    });
                }
                let Some(Segment::Abi { to_native, steps, free_py, .. }) = segments.last_mut() else { unreachable!() };
                reads.clear();
                step.reads(&mut reads);
                for &s in &reads {
                    if !has_native[s] {
                        has_native[s] = true;
                        to_native.push(s);
                    }
                }
                for s in step.writes() {
                    (has_py[s], has_native[s]) = (false, true);
                }
                for &s in &step.free {
                    if has_py[s] {
                        free_py.push(s);
                    }
                    (has_py[s], has_native[s]) = (false, false);
                }
                steps.push(step);
            }
        }
    }
    reads.clear();
    graph.outputs.iter().for_each(|a| visit_slots(a, &mut |s| reads.push(s)));
    let mut outputs_to_py = Vec::new();
    for &s in &reads {
        if !has_py[s] {
            has_py[s] = true;
            outputs_to_py.push(s);
        }
    }
    (segments, outputs_to_py)
}

fn slots_of(a: &ArgT, out: &mut Vec<usize>) {
    match a {
        ArgT::Slot(s) => out.push(*s),
        ArgT::Const(_) => {}
        ArgT::List(items) => items.iter().for_each(|i| slots_of(i, out)),
    }
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
    param: Option<&Param>,
    consts: &mut ConstTable<'_, '_>,
    what: &str,
) -> PyResult<Result<ArgT>> {
    Ok(Ok(match a {
        ArgPlan::Value(ValueRef::Slot(s)) => ArgT::Slot(*s),
        ArgPlan::Value(ValueRef::Weight(w)) => ArgT::Const(weights[w].clone_ref(py)),
        ArgPlan::Literal(lit) => {
            // A number where the op takes a tensor: wrap it once here, as torch would on
            // every call.
            let takes_tensor = param.is_some_and(|p| {
                !p.writes && matches!(&p.ty, Some(Ty::Tensor))
                    || matches!(&p.ty, Some(Ty::Optional(t)) if **t == Ty::Tensor)
            });
            match takes_tensor.then(|| consts.wrapped(lit)).flatten() {
                Some((_, wrapped)) => ArgT::Const(wrapped),
                None => match literal(py, torch, lit, what)? {
                    Ok(v) => ArgT::Const(v),
                    Err(e) => return Ok(Err(e)),
                },
            }
        }
        ArgPlan::List(items) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                match arg(py, torch, item, weights, None, consts, what)? {
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
        let mut pys: Vec<Option<Bound<'py, PyAny>>> = vec![None; self.n_slots];
        let mut natives: Vec<Option<Native>> = Vec::new();
        natives.resize_with(self.n_slots, || None);
        for &(slot, leaf) in &self.user_inputs {
            pys[slot] = Some(leaves[leaf].clone());
        }
        for segment in &self.segments {
            match segment {
                Segment::Python { to_py, steps } => {
                    self.to_py(py, to_py, &natives, &mut pys)?;
                    for step in steps {
                        run_python(py, step, &mut pys, &mut natives)?;
                    }
                }
                Segment::Abi { to_native, steps, free_py, last_ns } => {
                    let abi = self.abi.expect("C steps are only planned when the ABI is available");
                    self.to_native(py, abi, to_native, &pys, &mut natives)?;
                    let consts = &self.consts;
                    let natives = &mut natives;
                    let mut run = move || {
                        let mut stack = Vec::with_capacity(16);
                        steps.iter().try_for_each(|s| s.run(abi, natives, consts, &mut stack))
                    };
                    let started = Instant::now();
                    let result =
                        if last_ns.load(Ordering::Relaxed) >= RELEASE_GIL_AFTER_NS { py.detach(run) } else { run() };
                    last_ns.store(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    result.map_err(PyRuntimeError::new_err)?;
                    for &s in free_py {
                        pys[s] = None;
                    }
                }
            }
        }
        self.to_py(py, &self.outputs_to_py, &natives, &mut pys)?;
        self.outputs.iter().map(|a| value(py, a, &pys)).collect()
    }

    /// Python values for native ones: numbers directly, tensors in one call to torch.
    fn to_py<'py>(
        &self,
        py: Python<'py>,
        slots: &[usize],
        natives: &[Option<Native>],
        pys: &mut [Option<Bound<'py, PyAny>>],
    ) -> PyResult<()> {
        let mut tensors = Vec::new();
        for &s in slots {
            pys[s] = Some(match &natives[s] {
                Some(Native::Tensor(t)) => {
                    let abi = self.abi.expect("native tensors come from the ABI");
                    tensors.push((s, abi.share(t).map(|h| abi.adopt(h)).map_err(PyRuntimeError::new_err)?));
                    continue;
                }
                Some(Native::Int(i)) => i.into_pyobject(py)?.into_any(),
                Some(Native::Float(f)) => f.into_pyobject(py)?.into_any(),
                Some(Native::Bool(b)) => PyBool::new(py, *b).to_owned().into_any(),
                None => return Err(internal(s)),
            });
        }
        if let (Some(abi), false) = (self.abi, tensors.is_empty()) {
            let (targets, handles): (Vec<usize>, Vec<abi::Tensor>) = tensors.into_iter().unzip();
            for (s, t) in targets.into_iter().zip(abi.tensors_of(py, handles)?.iter()) {
                pys[s] = Some(t);
            }
        }
        Ok(())
    }

    /// Native values for Python ones: numbers directly, tensors in one call to torch.
    fn to_native(
        &self,
        py: Python<'_>,
        abi: &Abi,
        slots: &[usize],
        pys: &[Option<Bound<'_, PyAny>>],
        natives: &mut [Option<Native>],
    ) -> PyResult<()> {
        let tensor_type = self.tensor_type.bind(py);
        let mut tensors = Vec::new();
        for &s in slots {
            let v = pys[s].as_ref().ok_or_else(|| internal(s))?;
            natives[s] = Some(if v.is_instance(tensor_type)? {
                tensors.push((s, v.clone()));
                continue;
            } else if let Ok(b) = v.cast::<PyBool>() {
                Native::Bool(b.is_true())
            } else if v.is_instance_of::<PyInt>() {
                Native::Int(v.extract()?)
            } else if v.is_instance_of::<PyFloat>() {
                Native::Float(v.extract()?)
            } else {
                return Err(PyRuntimeError::new_err(format!(
                    "kwexport internal error: slot {s} holds a {} where the C path needs a tensor or a number",
                    v.get_type().name()?
                )));
            });
        }
        for (s, t) in tensors {
            natives[s] = Some(Native::Tensor(abi.handle_of(&t)?));
        }
        Ok(())
    }
}

fn internal(slot: usize) -> PyErr {
    Error::Artifact(format!("kwexport internal error: slot {slot} read after free")).into()
}

fn run_python<'py>(
    py: Python<'py>,
    step: &Step,
    pys: &mut [Option<Bound<'py, PyAny>>],
    natives: &mut [Option<Native>],
) -> PyResult<()> {
    let args = step.args.iter().map(|a| value(py, a, pys)).collect::<PyResult<Vec<_>>>()?;
    let args = PyTuple::new(py, args)?;
    let result = if step.kwargs.is_empty() {
        step.op.bind(py).call1(args)?
    } else {
        let kwargs = PyDict::new(py);
        for (k, a) in &step.kwargs {
            kwargs.set_item(k.bind(py), value(py, a, pys)?)?;
        }
        step.op.bind(py).call(args, Some(&kwargs))?
    };
    match &step.outputs {
        OutPlan::None => {}
        OutPlan::One(slot) => {
            if let Some(s) = slot {
                pys[*s] = Some(result);
            }
        }
        OutPlan::Many(out) => {
            for (i, slot) in out.iter().enumerate() {
                if let Some(s) = slot {
                    pys[*s] = Some(result.get_item(i)?);
                }
            }
        }
    }
    for &s in &step.free {
        pys[s] = None;
        natives[s] = None;
    }
    Ok(())
}

fn value<'py>(py: Python<'py>, a: &ArgT, slots: &[Option<Bound<'py, PyAny>>]) -> PyResult<Bound<'py, PyAny>> {
    match a {
        ArgT::Slot(s) => slots[*s].clone().ok_or_else(|| internal(*s)),
        ArgT::Const(c) => Ok(c.bind(py).clone()),
        ArgT::List(items) => {
            let items = items.iter().map(|i| value(py, i, slots)).collect::<PyResult<Vec<_>>>()?;
            Ok(PyList::new(py, items)?.into_any())
        }
    }
}
