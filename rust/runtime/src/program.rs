//! `Program`: a loaded artifact, the top of the runtime. Loading parses and validates the
//! file (core), resolves its ops (ops), builds the plan (plan) and compiles the input specs
//! and checks, before anything is returned; calling binds (core's binder), flattens (tree),
//! checks (checks), runs (exec) and rebuilds the outputs (tree).

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::Arc;

use kwexport_core::binder::{Binder, Binding, Source};
use kwexport_core::checks::{Checker, Symbol};
use kwexport_core::container;
use kwexport_core::passes::{self, Level};
use kwexport_core::schema::{Encoding, FormatVersion, Key, LeafSpec, MutationTarget, ParamKind, TreeSpec};
use kwexport_core::treespec::PathElem;
use kwexport_core::Error;
use memmap2::MmapOptions;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

use crate::calllock::CallLock;
use crate::checks::{LeafCheck, Seen, TensorTypes};
use crate::constants::constant_to_py;
use crate::device::Placement;
use crate::errors::{RtError, RtResult};
use crate::exec::{LeafHandles, NodeTime};
use crate::fallback::{self, Fallback};
use crate::ops::{self, AllowOps};
use crate::plan::{self, Dispatch, Plan, Why};
use crate::tree::CompiledSpec;
use crate::weights::{self, MappedData, State};

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

/// What `_load_verified` takes to unpickle a program: path, digest, allow_ops, dispatch,
/// device.
type PickledArgs = (String, String, Vec<String>, &'static str, Option<String>, bool, &'static str);

#[pyclass(frozen, module = "kwexport", name = "Program")]
pub struct Program {
    path: String,
    binder: Binder,
    defaults: Vec<Option<Py<PyAny>>>,
    top: TopLevel,
    leaf_checks: Vec<LeafCheck>,
    leaf_paths: Vec<String>,
    symbols: Vec<Symbol>,
    plan: Plan,
    outputs: CompiledSpec,
    types: TensorTypes,
    /// The all-Python plan for calls the C path must not take; `None` where `plan` has no
    /// C steps.
    fallback: Option<Fallback>,
    extra_files: Py<PyDict>,
    format_version: FormatVersion,
    upgraded_from: FormatVersion,
    upgraders: Vec<&'static str>,
    producer: Py<PyDict>,
    /// What loading noticed and handled: compatible op-schema drift, op upgraders run.
    notes: Vec<String>,
    /// The mapped file, kept for its content hash when the program is pickled.
    map: Arc<memmap2::MmapMut>,
    options: LoadOptions,
    placement: Placement,
    digest: PyOnceLock<String>,
    signature_obj: PyOnceLock<Py<PyAny>>,
    /// What each output after the user outputs writes back.
    writes: Vec<Write>,
    /// The weights the program writes, if any, and the lock that serializes its calls.
    state: Option<(State, CallLock)>,
}

/// Where a mutation's new value goes after a call.
enum Write {
    /// `state.tensors[i]`.
    State(usize),
    /// The caller's tensor at user leaf `i`.
    Input(usize),
}

/// How to load a file: what `kwexport.load` takes besides the path.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The `allow_ops` patterns, as given (a pickled program carries them).
    pub allow_ops: Vec<String>,
    /// The same, parsed.
    pub allow: AllowOps,
    /// Which dispatch paths the plan may use.
    pub dispatch: Dispatch,
    /// A normalized torch device string to place the program on; `None` for where it was
    /// exported.
    pub device: Option<String>,
    /// Whether the file is mapped (weights are views of it) or read into memory.
    pub mmap: bool,
    /// How far the graph is optimized.
    pub optimize: Level,
}

impl LoadOptions {
    /// Parses `allow_ops`; the other options as given.
    pub fn new(
        allow_ops: Vec<String>,
        dispatch: Dispatch,
        device: Option<String>,
        mmap: bool,
        optimize: Level,
    ) -> Result<Self, String> {
        Ok(LoadOptions { allow: AllowOps::parse(&allow_ops)?, allow_ops, dispatch, device, mmap, optimize })
    }
}

/// Loads and validates a file. Nothing is returned unless everything checks out.
pub fn load(py: Python<'_>, path: &str, options: &LoadOptions) -> RtResult<Program> {
    let file = File::open(path)?;
    if file.metadata()?.len() == 0 {
        return Err(Error::EmptyFile.into()); // nothing to map
    }
    let map = if options.mmap {
        // SAFETY: a private, copy-on-write map. A file truncated under it faults on the next
        // read of a lost page, and pages not yet read see in-place writes, as with any mapped
        // file (the README says so); kwexport writes files by rename, never in place.
        unsafe { MmapOptions::new().map_copy(&file)? }
    } else {
        // Read into anonymous memory: nothing done to the file later reaches the program.
        let len = usize::try_from(file.metadata()?.len()).map_err(|_| Error::EmptyFile)?;
        let mut memory = MmapOptions::new().len(len).map_anon()?;
        std::io::Read::read_exact(&mut &file, &mut memory[..])?;
        memory
    };
    load_mapped(py, path, Arc::new(map), options)
}

/// Loads a file already mapped: a copy of a program maps nothing again, so it shares the
/// read-only weights' pages.
fn load_mapped(py: Python<'_>, path: &str, map: Arc<memmap2::MmapMut>, options: &LoadOptions) -> RtResult<Program> {
    let dispatch = options.dispatch;
    // Parsing and checking touch no Python object: other threads run meanwhile.
    let mut parsed = py.detach(|| kwexport_core::parse(&map))?;
    let torch = py.import("torch")?;
    // Op upgraders may rewrite nodes, so ops are resolved before the graph is checked.
    let placement = Placement::new(parsed.document.home_device(), options.device.as_deref());
    placement.adapt_ops(&mut parsed.document);
    let channels_last = match options.optimize {
        Level::Exact => Vec::new(),
        Level::Fast => {
            passes::views_as_reshapes::apply(&mut parsed.document);
            passes::channels_last::conv_weights(&parsed.document)
        }
    };
    let (ops, notes) = ops::resolve_ops(py, &torch, &mut parsed.document, &options.allow)?;
    let mut a = py.detach(|| parsed.validate(&map))?;
    if placement.moves() {
        placement.place_literals(&mut a.graph);
        a.subgraphs.values_mut().for_each(|g| placement.place_literals(g));
    }
    let doc = &a.document;

    let data = Bound::new(py, MappedData::new(map.clone(), &a.layout))?;
    let mut weights = weights::materialize(py, &torch, data, &doc.weights, &a.weights)?;
    if placement.moves() {
        placement.place_weights(py, &mut weights)?;
    }
    if !channels_last.is_empty() {
        let kwargs = PyDict::new(py);
        kwargs.set_item("memory_format", torch.getattr("channels_last")?)?;
        for name in &channels_last {
            if let Some(w) = weights.get_mut(name) {
                *w = w.bind(py).call_method("contiguous", (), Some(&kwargs))?.unbind();
            }
        }
    }
    let mutable = doc.weights.tensors.iter().filter(|(_, t)| t.mutable).map(|(n, _)| n.clone());
    let state = weights::take_state(py, &mut weights, mutable)?;
    let writes = doc
        .graph
        .mutations
        .iter()
        .map(|m| match &m.target {
            MutationTarget::Weight(name) => state
                .names
                .iter()
                .position(|n| n == name)
                .map(Write::State)
                .ok_or_else(|| RtError::Internal(format!("mutation of {name:?}, which is not state"))),
            MutationTarget::User(leaf) => Ok(Write::Input(*leaf)),
        })
        .collect::<RtResult<Vec<_>>>()?;
    let leaf_is_tensor: Vec<bool> = doc.inputs.leaves.iter().map(|l| matches!(l, LeafSpec::Tensor(_))).collect();
    let grad_weights =
        weights::mark_grad_sensitive(py, &mut weights, &state, std::iter::once(&a.graph).chain(a.subgraphs.values()))?;
    let on_cpu = placement.target == "cpu";
    let cx = plan::Context { torch: &torch, ops: &ops, weights: &weights, subgraphs: &a.subgraphs, dispatch, on_cpu };
    // Constants made while planning (weights' transposes, cast numbers) are plain tensors:
    // made with grad mode on, a transpose of a weight that requires grad records a view
    // node, which costs more than the view.
    let mut plan = plan::with_grad_mode(&torch, false, || plan::build(&cx, &a.graph, &leaf_is_tensor))??;
    if grad_weights {
        plan.set_grad_off_when_unused(&torch)?;
    }

    let plan_has_c_steps = plan.n_c > 0;
    let leaf_checks = doc
        .inputs
        .leaves
        .iter()
        .zip(&a.leaf_dims)
        .enumerate()
        .map(|(i, (leaf, dims))| LeafCheck::new(py, &torch, leaf, dims.as_ref(), i, &placement))
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
    let compile_all = |specs: &[TreeSpec]| specs.iter().map(|s| CompiledSpec::new(py, s)).collect::<PyResult<Vec<_>>>();
    let mut keywords = Vec::with_capacity(kwargs.len());
    let mut extra_names = Vec::new();
    for e in kwargs {
        let Key::Str(name) = &e.key else {
            return Err(RtError::Internal("a non-string keyword entry passed validation".into()));
        };
        let target = match a.binder.params.iter().position(|p| &p.name == name && p.kind == ParamKind::KeywordOnly) {
            Some(i) => KwTarget::Param(i),
            None => {
                extra_names.push(name.clone());
                KwTarget::Extra(name.clone())
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

    let extra_files = PyDict::new(py);
    for (name, f) in &doc.extra_files {
        let bytes = &map[container::data_range(&a.layout, f.offset, f.nbytes, name)?];
        match f.encoding {
            Encoding::Bytes => extra_files.set_item(name, PyBytes::new(py, bytes))?,
            Encoding::Utf8 => extra_files.set_item(
                name,
                std::str::from_utf8(bytes).map_err(|_| RtError::Internal(format!("{name}: validated as UTF-8")))?,
            )?,
        }
    }
    let producer = PyDict::new(py);
    producer.set_item("kwexport", &doc.producer.kwexport)?;
    producer.set_item("torch", &doc.producer.torch)?;
    producer.set_item("python", &doc.producer.python)?;

    Ok(Program {
        path: path.to_owned(),
        defaults,
        top,
        leaf_checks,
        plan,
        outputs: CompiledSpec::new(py, &doc.outputs)?,
        types: TensorTypes::new(&torch)?,
        extra_files: extra_files.unbind(),
        format_version: doc.format_version,
        producer: producer.unbind(),
        notes,
        map,
        options: options.clone(),
        placement,
        digest: PyOnceLock::new(),
        signature_obj: PyOnceLock::new(),
        upgraded_from: a.file_format_version,
        upgraders: a.upgraders,
        leaf_paths: a.leaf_paths,
        symbols: a.symbols,
        binder: a.binder,
        state: (!state.names.is_empty()).then(|| (state, CallLock::new())),
        writes,
        fallback: (plan_has_c_steps).then(|| {
            let (graph, subgraphs) = (a.graph, a.subgraphs);
            Fallback::new(fallback::Parts { ops, weights, graph, subgraphs, leaf_is_tensor, on_cpu, grad_weights })
        }),
    })
}

/// SHA-256 of a whole file's bytes, as hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

impl Program {
    /// The content hash of the file as loaded (computed on first use: only pickling needs it).
    pub fn digest(&self, py: Python<'_>) -> &str {
        self.digest.get_or_init(py, || py.detach(|| sha256_hex(&self.map)))
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
            let target = match (write, &self.state) {
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
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
        profile: &mut Option<Vec<NodeTime>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = args.py();
        let leaves = self.flatten(args, kwargs)?;
        let checked = self.check(&leaves).map_err(RtError::from)?;
        if self.writes.is_empty() {
            let flat = self.run(py, &leaves, checked, profile)?;
            return Ok(self.outputs.unflatten(py, &mut flat.into_iter())?);
        }
        // One call at a time reads and writes the state.
        let _guard = self.state.as_ref().map(|(_, lock)| lock.lock(py));
        let mut flat = self.run(py, &leaves, checked, profile)?;
        let new_values = flat.split_off(flat.len() - self.writes.len());
        self.write_back(py, &leaves, new_values)?;
        Ok(self.outputs.unflatten(py, &mut flat.into_iter())?)
    }

    /// Checks a call's leaves; says whether any is a tensor subclass, and hands back the
    /// handles the checks made, for the C path to take.
    fn check(&self, leaves: &[Bound<'_, PyAny>]) -> Result<(bool, LeafHandles), Error> {
        let mut checker = Checker::new(&self.symbols, &self.leaf_paths);
        let mut subclass = false;
        let mut handles: LeafHandles = Vec::with_capacity(leaves.len());
        for (i, (leaf, check)) in leaves.iter().zip(&self.leaf_checks).enumerate() {
            let mut handle = None;
            subclass |= check.check(leaf, &self.types, i, &mut checker, &mut handle)? == Seen::Subclass;
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
impl Program {
    #[pyo3(signature = (*args, **kwargs))]
    fn __call__<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.call(args, kwargs, &mut None)
    }

    /// Runs one call (as `prog(*args, **kwargs)` does, state writes included) and returns
    /// where its time went: per node of the graph in the order they ran, `{"node": index or
    /// None, "op", "path": "c" | "python", "us"}`. Entries whose `node` is None are the
    /// conversions between the C and Python paths. A higher-order op's node includes its
    /// subgraphs' nodes. Nodes are timed one by one with the GIL held, so the total is a
    /// little above a plain call's.
    #[pyo3(signature = (*args, **kwargs))]
    fn profile<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = args.py();
        let mut times = Some(Vec::new());
        self.call(args, kwargs, &mut times)?;
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

    /// The program's state: each weight it writes, by name, as a read-only mapping of the
    /// live tensors (a view of them: writing into one changes the state). Empty for
    /// programs without state.
    #[getter]
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let d = PyDict::new(py);
        if let Some((state, _)) = &self.state {
            for (name, t) in state.names.iter().zip(&state.tensors) {
                d.set_item(name, t.bind(py))?;
            }
        }
        py.import("types")?.getattr("MappingProxyType")?.call1((d,))
    }

    /// Restores the state to the file's values.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        if let Some((state, lock)) = &self.state {
            let _guard = lock.lock(py);
            for (t, initial) in state.tensors.iter().zip(&state.initial) {
                t.bind(py).call_method1("copy_", (initial.bind(py),))?;
            }
        }
        Ok(())
    }

    /// An independent program over the same mapped file: the read-only weights are shared,
    /// the state is its own, starting as a copy of this one's.
    fn __copy__(&self, py: Python<'_>) -> PyResult<Program> {
        let copy = load_mapped(py, &self.path, self.map.clone(), &self.options)?;
        if let (Some((mine, lock)), Some((theirs, _))) = (&self.state, &copy.state) {
            let _guard = lock.lock(py);
            for (dst, src) in theirs.tensors.iter().zip(&mine.tensors) {
                dst.bind(py).call_method1("copy_", (src.bind(py),))?;
            }
        }
        Ok(copy)
    }

    /// Pickles by reference: the path and the file's content hash, never the weights. The
    /// receiving process maps the same file and checks the hash.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, PickledArgs)> {
        let load = py.import("kwexport._rt")?.getattr("_load_verified")?;
        let o = &self.options;
        let args = (
            self.path.clone(),
            self.digest(py).to_owned(),
            o.allow_ops.clone(),
            o.dispatch.name(),
            o.device.clone(),
            o.mmap,
            o.optimize.name(),
        );
        Ok((load, args))
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
    fn __signature__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
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
    fn __name__(&self) -> &str {
        &self.binder.name
    }

    /// The extra files saved with the program: `str` where a `str` was saved, else `bytes`.
    #[getter]
    fn extra_files(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        Ok(self.extra_files.bind(py).copy()?.unbind())
    }

    /// `(major, minor)` of the format this program is held in (always the current one).
    #[getter]
    fn format_version(&self) -> (u32, u32) {
        (self.format_version.major, self.format_version.minor)
    }

    /// `(major, minor)` of the file as it was on disk, before upgraders ran.
    #[getter]
    fn file_format_version(&self) -> (u32, u32) {
        (self.upgraded_from.major, self.upgraded_from.minor)
    }

    /// The names of the upgraders that brought the file to the current format.
    #[getter]
    fn upgraders_applied(&self) -> Vec<&'static str> {
        self.upgraders.clone()
    }

    /// Which kwexport, torch and Python wrote the file.
    #[getter]
    fn producer(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        Ok(self.producer.bind(py).copy()?.unbind())
    }

    /// How many graph nodes run on each path, and why each op that stayed on Python did:
    /// `{"stable_abi": n, "python": m, "on_python": [{"op", "nodes", "why"}, ...]}`, most
    /// nodes first. Nodes the stable C ABI covers run without Python; the rest through
    /// torch's Python op objects.
    #[getter]
    fn dispatch<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
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
        Ok(d)
    }

    /// What loading noticed and handled, such as op-schema drift in a newer torch.
    #[getter]
    fn load_notes(&self) -> Vec<String> {
        self.notes.clone()
    }

    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// How far the program was optimized at load: `"exact"` or `"fast"`.
    #[getter]
    fn optimize(&self) -> &'static str {
        self.options.optimize.name()
    }

    /// The device the program runs on: given at load, or where it was exported.
    #[getter]
    fn device<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        py.import("torch")?.getattr("device")?.call1((self.placement.target.as_str(),))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let sig = self.__signature__(py)?.bind(py).str()?.to_string();
        Ok(format!("<kwexport.Program {}{sig} from {:?}>", self.binder.name, self.path))
    }
}
