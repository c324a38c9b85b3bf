//! `Method`: one callable of a loaded file. A call binds (core's binder), flattens (tree),
//! checks (checks), runs (exec), writes the state back and rebuilds the outputs (tree).
//! Methods of one file share its weights and state (`program::FileParts`).

use std::collections::BTreeMap;
use std::sync::Arc;

use kwexport_core::binder::{Binder, Binding, Source};
use kwexport_core::checks::{Checker, Symbol};
use kwexport_core::schema::{Key, LeafSpec, MutationTarget, ParamKind, TreeSpec};
use kwexport_core::treespec::PathElem;
use kwexport_core::Error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::checks::{LeafCheck, Seen};
use crate::constants::constant_to_py;
use crate::errors::{RtError, RtResult};
use crate::exec::{LeafHandles, NodeTime};
use crate::fallback::{self, Fallback};
use crate::ops::ResolvedOp;
use crate::plan::{self, Plan, Why};
use crate::program::FileParts;
use crate::tree::CompiledSpec;

/// Where a top-level keyword entry of the input spec gets its value.
enum KwTarget {
    /// A keyword-only parameter, by index.
    Param(usize),
    /// An entry of `**kwargs`, by name.
    Extra(String),
}

/// The input spec's root, `(args, kwargs)`, split by parameter.
struct TopLevel {
    /// One spec per positional parameter, in order.
    positional: Vec<CompiledSpec>,
    /// One spec per `*args` item seen at export.
    var_positional: Vec<CompiledSpec>,
    keywords: Vec<(KwTarget, CompiledSpec)>,
    /// The `**kwargs` names seen at export, for messages.
    extra_names: Vec<String>,
}

/// Where a mutation's new value goes after a call.
enum Write {
    /// `state.tensors[i]`.
    State(usize),
    /// Nowhere: the graph wrote the state in place (`passes::inplace_state`).
    InPlace,
    /// The caller's tensor at user leaf `i`.
    Input(usize),
}

#[pyclass(frozen, module = "kwexport", name = "Method")]
pub struct Method {
    name: String,
    file: Arc<FileParts>,
    binder: Binder,
    defaults: Vec<Option<Py<PyAny>>>,
    top: TopLevel,
    leaf_checks: Vec<LeafCheck>,
    leaf_paths: Vec<String>,
    /// Each tensor leaf's sizes as exported: static, or `None` where symbolic.
    leaf_sizes: Vec<Option<Vec<Option<i64>>>>,
    symbols: Vec<Symbol>,
    plan: Plan,
    outputs: CompiledSpec,
    /// The all-Python plan for calls the C path must not take; `None` where `plan` has no
    /// C steps.
    fallback: Option<Fallback>,
    signature_obj: PyOnceLock<Py<PyAny>>,
    /// What each output after the user outputs writes back.
    writes: Vec<Write>,
}

/// What one method is built from: its header entry, checked, and its resolved ops.
pub struct Parts<'a> {
    pub name: &'a str,
    pub doc: &'a kwexport_core::schema::Method,
    pub checked: kwexport_core::artifact::CheckedMethod,
    pub ops: Vec<ResolvedOp>,
    /// The weights its graph writes in place.
    pub in_place: Vec<String>,
}

impl Method {
    /// Builds a method over the file's materialized weights (state included).
    pub fn build(
        py: Python<'_>,
        torch: &Bound<'_, PyModule>,
        parts: Parts<'_>,
        weights: &BTreeMap<String, Py<PyAny>>,
        grad_weights: bool,
        file: &Arc<FileParts>,
    ) -> RtResult<Method> {
        let Parts { name, doc, checked: a, ops, in_place } = parts;
        let writes = doc
            .graph
            .mutations
            .iter()
            .map(|m| match &m.target {
                MutationTarget::Weight(w) if in_place.contains(w) => Ok(Write::InPlace),
                MutationTarget::Weight(w) => file
                    .state
                    .as_ref()
                    .and_then(|(state, _)| state.names.iter().position(|n| n == w))
                    .map(Write::State)
                    .ok_or_else(|| RtError::Internal(format!("mutation of {w:?}, which is not state"))),
                MutationTarget::User(leaf) => Ok(Write::Input(*leaf)),
            })
            .collect::<RtResult<Vec<_>>>()?;
        let leaf_is_tensor: Vec<bool> = doc.inputs.leaves.iter().map(|l| matches!(l, LeafSpec::Tensor(_))).collect();
        let on_cpu = file.placement.target == "cpu";
        let dispatch = file.options.dispatch;
        let fast = file.options.optimize == kwexport_core::passes::Level::Fast;
        let bf16 = file.options.bf16;
        let mut cx = plan::Context { torch, ops: &ops, weights, subgraphs: &a.subgraphs, dispatch, on_cpu, fast, bf16 };
        // Constants made while planning (weights' transposes, cast numbers, folded nodes) are
        // plain tensors: made with grad mode on, a transpose of a weight that requires grad
        // records a view node, which costs more than the view.
        let is_state = |w: &str| file.state.as_ref().is_some_and(|(s, _)| s.names.iter().any(|n| n == w));
        let folded = match fast {
            true => plan::with_grad_mode(torch, false, || plan::fold::constants(&cx, &a.graph, &doc.ops, is_state))??,
            false => None,
        };
        let (graph, weights) = match &folded {
            Some((graph, weights)) => (graph, weights),
            None => (&a.graph, weights),
        };
        cx.weights = weights;
        let mut plan = plan::with_grad_mode(torch, false, || plan::build(&cx, graph, &leaf_is_tensor))??;
        if grad_weights {
            plan.set_grad_off_when_unused(torch)?;
        }
        let leaf_checks = doc
            .inputs
            .leaves
            .iter()
            .zip(&a.leaf_dims)
            .enumerate()
            .map(|(i, (leaf, dims))| LeafCheck::new(py, torch, leaf, dims.as_ref(), i, &file.placement))
            .collect::<RtResult<Vec<_>>>()?;
        let defaults = a
            .binder
            .params
            .iter()
            .map(|p| match (&p.default, &p.default_weight) {
                (Some(d), _) => constant_to_py(py, d).map(Some),
                // A tensor default is one tensor, shared by every call that leaves it out, as
                // Python shares a default object.
                (None, Some(w)) => weights
                    .get(w)
                    .map(|t| Some(t.clone_ref(py)))
                    .ok_or_else(|| RtError::Internal(format!("weight {w}")).into()),
                (None, None) => Ok(None),
            })
            .collect::<PyResult<Vec<_>>>()?;

        let (args, kwargs) = kwexport_core::artifact::split_root(&doc.inputs.spec)?;
        let n_pos = a.binder.n_positional();
        let compile_all =
            |specs: &[TreeSpec]| specs.iter().map(|s| CompiledSpec::new(py, s)).collect::<PyResult<Vec<_>>>();
        let mut keywords = Vec::with_capacity(kwargs.len());
        let mut extra_names = Vec::new();
        for e in kwargs {
            let Key::Str(kw) = &e.key else {
                return Err(RtError::Internal("a non-string keyword entry passed validation".into()));
            };
            let target = match a.binder.params.iter().position(|p| &p.name == kw && p.kind == ParamKind::KeywordOnly) {
                Some(i) => KwTarget::Param(i),
                None => {
                    extra_names.push(kw.clone());
                    KwTarget::Extra(kw.clone())
                }
            };
            keywords.push((target, CompiledSpec::new(py, &e.value)?));
        }
        let top = TopLevel {
            positional: compile_all(&args[..n_pos])?,
            var_positional: compile_all(&args[n_pos..])?,
            keywords,
            extra_names,
        };
        let plan_has_c_steps = plan.n_c > 0;
        let leaf_sizes = doc
            .inputs
            .leaves
            .iter()
            .map(|l| match l {
                LeafSpec::Tensor(t) => Some(
                    t.shape
                        .iter()
                        .map(|d| match d {
                            kwexport_core::schema::Dim::Static(n) => Some(*n),
                            _ => None,
                        })
                        .collect(),
                ),
                LeafSpec::Constant(_) => None,
            })
            .collect();
        if let Some(graphs) = &file.graphs {
            let ops: Vec<String> = kwexport_core::graph::op_names(&doc.ops)?.iter().map(|o| o.to_string()).collect();
            let mutated: Vec<usize> =
                writes.iter().filter_map(|w| if let Write::Input(leaf) = w { Some(*leaf) } else { None }).collect();
            graphs.bind(py).call_method1("register", (name, mutated, ops))?;
        }
        Ok(Method {
            leaf_sizes,
            name: name.to_owned(),
            file: file.clone(),
            defaults,
            top,
            leaf_checks,
            plan,
            outputs: CompiledSpec::new(py, &doc.outputs)?,
            signature_obj: PyOnceLock::new(),
            leaf_paths: a.leaf_paths,
            symbols: a.symbols,
            binder: a.binder,
            writes,
            fallback: plan_has_c_steps.then(|| {
                let (graph, subgraphs) = (graph.clone(), a.subgraphs);
                let weights = weights.iter().map(|(k, v)| (k.clone(), v.clone_ref(py))).collect();
                Fallback::new(fallback::Parts { ops, weights, graph, subgraphs, leaf_is_tensor, on_cpu, grad_weights })
            }),
        })
    }

    /// The method's name in its file.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file's shared parts (its state and lock).
    pub fn file(&self) -> &FileParts {
        &self.file
    }

    /// The index of the input leaf at `path` (`input_ids`, `cfg['shift'][0]`).
    pub fn leaf(&self, path: &str) -> Option<usize> {
        self.leaf_paths.iter().position(|p| p == path)
    }

    /// How many input leaves a call flattens to.
    pub fn n_leaves(&self) -> usize {
        self.leaf_checks.len()
    }

    /// Each leaf's sizes: `Some(n)` where static, `None` where symbolic; `None` for constants.
    pub fn leaf_sizes(&self, leaf: usize) -> Option<&[Option<i64>]> {
        self.leaf_sizes.get(leaf)?.as_deref()
    }

    /// One call on leaves made by the caller, in leaf order: checked, run (replayed, where
    /// the program's CUDA graphs take it), state written back. The caller holds the state
    /// lock where the method writes state. Returns the user outputs, flat.
    pub fn run_leaves<'py>(slf: &Bound<'py, Self>, leaves: &[Bound<'py, PyAny>]) -> RtResult<Vec<Bound<'py, PyAny>>> {
        let checked = slf.get().check(leaves)?;
        Self::run_checked(slf, leaves, checked, &mut None)
    }

    /// Runs checked leaves and writes the state back; returns the user outputs, flat. With
    /// CUDA graphs the program's cache replays the call where it takes it (not while
    /// profiling, which times nodes one by one).
    fn run_checked<'py>(
        slf: &Bound<'py, Self>,
        leaves: &[Bound<'py, PyAny>],
        checked: (bool, LeafHandles),
        profile: &mut Option<Vec<NodeTime>>,
    ) -> RtResult<Vec<Bound<'py, PyAny>>> {
        let (this, py) = (slf.get(), slf.py());
        if let (Some(graphs), None) = (&this.file.graphs, &profile) {
            let run = slf.getattr(pyo3::intern!(py, "_run_leaves"))?;
            let replayed = graphs.bind(py).call1((&this.name, run, PyList::new(py, leaves)?))?;
            if !replayed.is_none() {
                return Ok(replayed.extract()?);
            }
        }
        this.run_plain(py, leaves, checked, profile)
    }

    /// Runs checked leaves on the plan and writes the state back.
    fn run_plain<'py>(
        &self,
        py: Python<'py>,
        leaves: &[Bound<'py, PyAny>],
        checked: (bool, LeafHandles),
        profile: &mut Option<Vec<NodeTime>>,
    ) -> RtResult<Vec<Bound<'py, PyAny>>> {
        let mut flat = self.run(py, leaves, checked, profile)?;
        let new_values = flat.split_off(flat.len() - self.writes.len());
        self.write_back(py, leaves, new_values)?;
        Ok(flat)
    }

    /// Binds and flattens a call into the graph's user leaves, checking structure.
    fn flatten<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> RtResult<Vec<Bound<'py, PyAny>>> {
        let mut kw: Vec<(Bound<'py, PyString>, Bound<'py, PyAny>)> = Vec::new();
        if let Some(kwargs) = kwargs {
            for (k, v) in kwargs.iter() {
                kw.push((k.cast_into::<PyString>()?, v));
            }
        }
        let names = kw.iter().map(|(k, _)| k.to_str()).collect::<PyResult<Vec<_>>>()?;
        let binding = self.binder.bind(args.len(), &names)?;

        let fetch = |i: usize, src: Source| -> RtResult<Bound<'py, PyAny>> {
            Ok(match src {
                Source::Positional(p) => args.get_item(p)?,
                Source::Keyword(k) => kw[k].1.clone(),
                Source::Default => self.defaults[i]
                    .as_ref()
                    .ok_or_else(|| RtError::Internal(format!("parameter {i} bound to a default it lacks")))?
                    .bind(args.py())
                    .clone(),
            })
        };
        let mut leaves = Vec::with_capacity(self.leaf_checks.len());
        let mut path = Vec::new();
        let mut var_kw: &[usize] = &[];
        let mut values: Vec<Option<Bound<'py, PyAny>>> = vec![None; self.binder.params.len()];
        for (i, b) in binding.iter().enumerate() {
            match b {
                Binding::One(src) => values[i] = Some(fetch(i, *src)?),
                Binding::VarPositional(range) => {
                    if range.len() != self.top.var_positional.len() {
                        return Err(Error::VarPositionalCount {
                            name: self.binder.params[i].name.clone(),
                            expected: self.top.var_positional.len(),
                            got: range.len(),
                        }
                        .into());
                    }
                }
                Binding::VarKeyword(ks) => var_kw = ks,
            }
        }
        let unbound = |i: usize| RtError::Internal(format!("parameter {i} left unbound"));
        for (i, spec) in self.top.positional.iter().enumerate() {
            let v = values[i].as_ref().ok_or_else(|| unbound(i))?;
            spec.flatten(v, &self.binder.params[i].name, &mut path, &mut leaves)?;
        }
        if let Some(vp) = self.binder.var_positional() {
            let name = &self.binder.params[vp].name;
            for (j, spec) in self.top.var_positional.iter().enumerate() {
                let item = args.get_item(self.binder.n_positional() + j)?;
                path.push(PathElem::Index(j));
                spec.flatten(&item, name, &mut path, &mut leaves)?;
                path.pop();
            }
        }
        if var_kw.len() != self.top.extra_names.len() {
            let unexpected: Vec<&str> =
                var_kw.iter().map(|&k| names[k]).filter(|n| !self.top.extra_names.iter().any(|e| e == n)).collect();
            if let Some(n) = unexpected.first() {
                return Err(self.extra_error(n, false).into());
            }
        }
        for (target, spec) in &self.top.keywords {
            match target {
                KwTarget::Param(i) => {
                    let v = values[*i].as_ref().ok_or_else(|| unbound(*i))?;
                    spec.flatten(v, &self.binder.params[*i].name, &mut path, &mut leaves)?;
                }
                KwTarget::Extra(name) => {
                    let v = var_kw
                        .iter()
                        .find(|&&k| names[k] == name)
                        .map(|&k| &kw[k].1)
                        .ok_or_else(|| self.extra_error(name, true))?;
                    spec.flatten(v, name, &mut path, &mut leaves)?;
                }
            }
        }
        Ok(leaves)
    }

    /// Copies each mutation's new value into the state or the caller's input, as
    /// `torch.export`'s `ep.module()` does.
    fn write_back<'py>(
        &self,
        py: Python<'py>,
        leaves: &[Bound<'py, PyAny>],
        values: Vec<Bound<'py, PyAny>>,
    ) -> RtResult<()> {
        for (write, value) in self.writes.iter().zip(values) {
            let target = match (write, &self.file.state) {
                (Write::InPlace, _) => continue,
                (Write::State(i), Some((state, _))) => state.tensors[*i].bind(py),
                (Write::Input(leaf), _) => &leaves[*leaf],
                (Write::State(_), None) => return Err(RtError::Internal("a state write without state".into())),
            };
            target.call_method1(pyo3::intern!(py, "copy_"), (value,))?;
        }
        Ok(())
    }

    fn extra_error(&self, name: &str, missing: bool) -> Error {
        let var = self.binder.var_keyword().map(|i| self.binder.params[i].name.as_str()).unwrap_or("kwargs");
        Error::VarKeywordEntry {
            name: name.to_owned(),
            missing,
            var: var.to_owned(),
            held: self.top.extra_names.clone(),
        }
    }

    /// A call: binds, checks, runs (timing each node into `profile` where it is `Some`),
    /// writes the state back and rebuilds the outputs.
    fn call<'py>(
        slf: &Bound<'py, Self>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
        profile: &mut Option<Vec<NodeTime>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (this, py) = (slf.get(), args.py());
        let leaves = this.flatten(args, kwargs)?;
        let checked = this.check(&leaves).map_err(RtError::from)?;
        // One call at a time reads and writes the state.
        let _guard = match this.writes.is_empty() {
            true => None,
            false => this.file.state.as_ref().map(|(_, lock)| lock.lock(py)),
        };
        let flat = Self::run_checked(slf, &leaves, checked, profile)?;
        Ok(this.outputs.unflatten(py, &mut flat.into_iter())?)
    }

    /// Checks a call's leaves; says whether any is a tensor subclass, and hands back the
    /// handles the checks made, for the C path to take.
    fn check(&self, leaves: &[Bound<'_, PyAny>]) -> Result<(bool, LeafHandles), Error> {
        let mut checker = Checker::new(&self.symbols, &self.leaf_paths);
        let mut subclass = false;
        let mut handles: LeafHandles = Vec::with_capacity(leaves.len());
        for (i, (leaf, check)) in leaves.iter().zip(&self.leaf_checks).enumerate() {
            let mut handle = None;
            subclass |= check.check(leaf, &self.file.types, i, &mut checker, &mut handle)? == Seen::Subclass;
            handles.push(handle);
        }
        Ok((subclass, handles))
    }

    /// Runs the graph on checked leaves: on the all-Python plan where the call passes a
    /// subclass or the C path failed recently (see `fallback`), else on the plan.
    fn run<'py>(
        &self,
        py: Python<'py>,
        leaves: &[Bound<'py, PyAny>],
        (subclass, mut handles): (bool, LeafHandles),
        profile: &mut Option<Vec<NodeTime>>,
    ) -> RtResult<Vec<Bound<'py, PyAny>>> {
        let Some(fallback) = &self.fallback else {
            return self.plan.run_timed(py, leaves, &mut handles, profile);
        };
        let on_python = fallback.wanted(subclass);
        let plan = if on_python { fallback.plan(py)? } else { &self.plan };
        let result = plan.run_timed(py, leaves, &mut handles, profile);
        let failed = match &result {
            Err(RtError::Op { .. }) => true,
            Err(_) => on_python,
            Ok(_) => false,
        };
        fallback.record(on_python, failed);
        result
    }
}

#[pymethods]
impl Method {
    #[pyo3(signature = (*args, **kwargs))]
    pub(crate) fn __call__<'py>(
        slf: &Bound<'py, Self>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::call(slf, args, kwargs, &mut None)
    }

    /// Runs one call (as `prog(*args, **kwargs)` does, state writes included) and returns
    /// where its time went: per node of the graph in the order they ran, `{"node": index or
    /// None, "op", "path": "c" | "python", "us"}`. Entries whose `node` is None are the
    /// conversions between the C and Python paths. A higher-order op's node includes its
    /// subgraphs' nodes. Nodes are timed one by one with the GIL held, so the total is a
    /// little above a plain call's.
    #[pyo3(signature = (*args, **kwargs))]
    pub(crate) fn profile<'py>(
        slf: &Bound<'py, Self>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = args.py();
        let mut times = Some(Vec::new());
        Self::call(slf, args, kwargs, &mut times)?;
        let out = PyList::empty(py);
        for t in times.unwrap_or_default() {
            let d = PyDict::new(py);
            d.set_item("node", t.node)?;
            d.set_item("op", t.op)?;
            d.set_item("path", t.path)?;
            d.set_item("us", t.ns as f64 / 1e3)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Runs the graph on already-flat leaves with no binding, no checks and no rebuilding:
    /// the floor that benchmarks measure the call path's overhead against.
    pub fn _run_flat<'py>(&self, leaves: Vec<Bound<'py, PyAny>>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let py = match leaves.first() {
            Some(l) => l.py(),
            None => return Err(pyo3::exceptions::PyValueError::new_err("no leaves")),
        };
        if leaves.len() != self.leaf_checks.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("expected {} leaves", self.leaf_checks.len())));
        }
        Ok(self.plan.run(py, &leaves)?)
    }

    /// One call on flat leaves, checked, run on the plan (never replayed) and written back:
    /// what the program's CUDA graphs capture. The caller holds the state lock where the
    /// method writes state.
    pub fn _run_leaves<'py>(
        slf: &Bound<'py, Self>,
        leaves: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let this = slf.get();
        if leaves.len() != this.leaf_checks.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("expected {} leaves", this.leaf_checks.len())));
        }
        let checked = this.check(&leaves).map_err(RtError::from)?;
        Ok(this.run_plain(slf.py(), &leaves, checked, &mut None)?)
    }

    /// Binds and flattens a call to its leaves, checked, without running the graph.
    #[pyo3(signature = (*args, **kwargs))]
    pub fn _flatten<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let leaves = self.flatten(args, kwargs)?;
        self.check(&leaves).map_err(RtError::from)?;
        Ok(leaves)
    }

    /// The original signature, for `inspect.signature(program)`.
    #[getter]
    pub(crate) fn __signature__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.signature_obj
            .get_or_try_init(py, || {
                let inspect = py.import("inspect")?;
                let parameter = inspect.getattr("Parameter")?;
                let params = self
                    .binder
                    .params
                    .iter()
                    .zip(&self.defaults)
                    .map(|(p, default)| {
                        let kind = parameter.getattr(match p.kind {
                            ParamKind::PositionalOnly => "POSITIONAL_ONLY",
                            ParamKind::PositionalOrKeyword => "POSITIONAL_OR_KEYWORD",
                            ParamKind::VarPositional => "VAR_POSITIONAL",
                            ParamKind::KeywordOnly => "KEYWORD_ONLY",
                            ParamKind::VarKeyword => "VAR_KEYWORD",
                        })?;
                        let kwargs = PyDict::new(py);
                        if let Some(d) = default {
                            kwargs.set_item("default", d.bind(py))?;
                        }
                        parameter.call((&p.name, kind), Some(&kwargs))
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                Ok(inspect.getattr("Signature")?.call1((params,))?.unbind())
            })
            .map(|s| s.clone_ref(py))
    }

    #[getter]
    pub(crate) fn __name__(&self) -> &str {
        &self.binder.name
    }

    /// How many graph nodes run on each path, and why each op that stayed on Python did:
    /// `{"stable_abi": n, "python": m, "on_python": [{"op", "nodes", "why"}, ...]}`, most
    /// nodes first. Nodes the stable C ABI covers run without Python; the rest through
    /// torch's Python op objects.
    #[getter]
    pub(crate) fn dispatch<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut groups: BTreeMap<(&str, &Why), usize> = BTreeMap::new();
        for (op, why) in &self.plan.on_python {
            *groups.entry((op.as_str(), why)).or_default() += 1;
        }
        let mut groups: Vec<_> = groups.into_iter().collect();
        groups.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        let on_python = PyList::empty(py);
        for ((op, why), n) in groups {
            let entry = PyDict::new(py);
            entry.set_item("op", op)?;
            entry.set_item("nodes", n)?;
            entry.set_item("why", why.to_string())?;
            on_python.append(entry)?;
        }
        let d = PyDict::new(py);
        d.set_item("stable_abi", self.plan.n_c)?;
        d.set_item("python", self.plan.on_python.len())?;
        d.set_item("on_python", on_python)?;
        if let Some(graphs) = &self.file.graphs {
            d.set_item("cuda_graphs", graphs.bind(py).call_method1("describe", (&self.name,))?)?;
        }
        Ok(d)
    }

    /// The method's name in its file (`prog.NAME`, `prog["NAME"]`).
    #[getter(name)]
    fn method_name(&self) -> &str {
        &self.name
    }

    /// Pickles by reference, as its program does: the file's path and hash, and this name.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, (String, crate::program::PickledArgs))> {
        let load = py.import("kwexport._rt")?.getattr("_load_method")?;
        Ok((load, (self.name.clone(), self.file.pickled_args(py))))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let sig = self.__signature__(py)?.bind(py).str()?.to_string();
        Ok(format!("<kwexport.Method {} = {}{sig} from {:?}>", self.name, self.binder.name, self.file.path))
    }
}
