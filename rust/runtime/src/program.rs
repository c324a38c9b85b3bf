//! `Program`: a loaded file, the top of the runtime. Loading parses and validates the file
//! (core), resolves each method's ops (ops), materializes the weights once (weights), and
//! builds each method's plan and input checks (method) before anything is returned. A
//! program holds its file's methods over one set of weights and one state.

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::Arc;

use kwexport_core::container;
use kwexport_core::passes::{self, Level};
use kwexport_core::schema::{Encoding, FormatVersion};
use kwexport_core::Error;
use memmap2::MmapOptions;
use pyo3::exceptions::{PyAttributeError, PyKeyError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::calllock::CallLock;
use crate::checks::TensorTypes;
use crate::device::Placement;
use crate::errors::{RtError, RtResult};
use crate::generate::{self, Generation, Sampling};
use crate::method::{self, Method};
use crate::ops::{self, AllowOps};
use crate::plan::Dispatch;
use crate::weights::{self, MappedData, State};

/// What `_load_verified` takes to unpickle a program: path, digest, allow_ops, dispatch,
/// device, mmap, optimize, precision, cuda_graphs.
pub type PickledArgs =
    (String, String, Vec<String>, &'static str, Option<String>, bool, &'static str, &'static str, Option<GraphOptions>);

/// `kwexport.CudaGraphs` as `kwexport.load` passes it: max_graphs, warmup, reuse_outputs.
pub type GraphOptions = (usize, usize, bool);

/// What a file's methods share: the mapped file, how it was loaded, and its state.
pub struct FileParts {
    pub path: String,
    /// The mapped file, kept for its content hash when the program is pickled.
    pub map: Arc<memmap2::MmapMut>,
    pub options: LoadOptions,
    pub placement: Placement,
    pub types: TensorTypes,
    digest: PyOnceLock<String>,
    /// The weights the methods write, if any, and the lock that serializes calls that
    /// write them.
    pub state: Option<(State, CallLock)>,
    /// The program's CUDA graphs (`kwexport._cuda_graphs.GraphCache`), where loaded with
    /// `cuda_graphs`.
    pub graphs: Option<Py<PyAny>>,
}

impl FileParts {
    /// The content hash of the file as loaded (computed on first use: only pickling needs it).
    pub fn digest(&self, py: Python<'_>) -> &str {
        self.digest.get_or_init(py, || py.detach(|| sha256_hex(&self.map)))
    }

    /// What `_load_verified` takes to load this file again, elsewhere.
    pub fn pickled_args(&self, py: Python<'_>) -> PickledArgs {
        let o = &self.options;
        (
            self.path.clone(),
            self.digest(py).to_owned(),
            o.allow_ops.clone(),
            o.dispatch.name(),
            o.device.clone(),
            o.mmap,
            o.optimize.name(),
            o.precision(),
            o.cuda_graphs,
        )
    }
}

#[pyclass(frozen, module = "kwexport", name = "Program")]
pub struct Program {
    file: Arc<FileParts>,
    /// The methods, by name.
    methods: Vec<(String, Py<Method>)>,
    /// The method `program(...)` calls: the only one, or `forward`.
    default: Option<usize>,
    extra_files: Py<PyDict>,
    format_version: FormatVersion,
    upgraded_from: FormatVersion,
    upgraders: Vec<&'static str>,
    producer: Py<PyDict>,
    /// What loading noticed and handled: compatible op-schema drift, op upgraders run.
    notes: Vec<String>,
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
    /// kwexport's GEMM and convolutions on weights packed in bfloat16 (`precision="bf16"`,
    /// which runs at `fast`).
    pub bf16: bool,
    /// Capture calls in CUDA graphs, and how (`None`: launch every node).
    pub cuda_graphs: Option<GraphOptions>,
}

impl LoadOptions {
    /// Parses `allow_ops`; the other options as given.
    pub fn new(
        allow_ops: Vec<String>,
        dispatch: Dispatch,
        device: Option<String>,
        mmap: bool,
        optimize: Level,
        bf16: bool,
    ) -> Result<Self, String> {
        let optimize = if bf16 { optimize.max(Level::Fast) } else { optimize };
        let allow = AllowOps::parse(&allow_ops)?;
        Ok(LoadOptions { allow, allow_ops, dispatch, device, mmap, optimize, bf16, cuda_graphs: None })
    }

    /// The precision `kwexport.load` was given: `"float32"` or `"bf16"`.
    pub fn precision(&self) -> &'static str {
        if self.bf16 {
            "bf16"
        } else {
            "float32"
        }
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

/// Whether convolutions may run on oneDNN's fused kernel (`passes::conv_pointwise`): torch
/// was built with it and exports the C shim kwexport calls it through.
fn onednn(py: Python<'_>, torch: &Bound<'_, PyModule>) -> PyResult<bool> {
    let shim = crate::abi::Abi::get(py).and_then(|abi| abi.shims.as_ref()).is_some_and(|s| s.conv_pointwise.is_some());
    Ok(shim && torch.getattr("backends")?.getattr("mkldnn")?.call_method0("is_available")?.extract()?)
}

/// Loads a file already mapped: a copy of a program maps nothing again, so it shares the
/// read-only weights' pages.
fn load_mapped(py: Python<'_>, path: &str, map: Arc<memmap2::MmapMut>, options: &LoadOptions) -> RtResult<Program> {
    // Parsing and checking touch no Python object: other threads run meanwhile.
    let mut parsed = py.detach(|| kwexport_core::parse(&map))?;
    let torch = py.import("torch")?;
    let placement = Placement::new(parsed.document.home_device(), options.device.as_deref());
    if options.bf16 && placement.target != "cpu" {
        // Rather than a program that says bf16 and computes float32.
        let why = format!("precision='bf16' runs kwexport's CPU kernels; this program runs on {}", placement.target);
        return Err(pyo3::exceptions::PyValueError::new_err(why).into());
    }
    if options.cuda_graphs.is_some() && !placement.target.starts_with("cuda") {
        let why = format!("cuda_graphs=True needs a CUDA device; this program runs on {}", placement.target);
        return Err(pyo3::exceptions::PyValueError::new_err(why).into());
    }
    // The level's passes (dead code at every level, the state written in place, and a
    // level's own), decided by the core; op upgraders may rewrite nodes after, so ops are
    // resolved before the graphs are checked.
    for m in parsed.document.methods.values_mut() {
        placement.adapt_ops(m);
    }
    // Only a `fast` load asks torch about oneDNN: an `exact` one makes no Python call for it.
    let fast = options.optimize.max(parsed.document.optimized) == passes::Level::Fast;
    let onednn = fast && placement.target == "cpu" && onednn(py, &torch)?;
    let cuda_graphs = fast && options.cuda_graphs.is_some();
    let target = passes::Target { in_place: true, onednn, gemm: onednn && crate::kernels::available(), cuda_graphs };
    // The document is dropped with the load if a pass fails: nothing half-optimized runs.
    let rewrites = crate::errors::apply_passes(&mut parsed.document, options.optimize, target)?;
    let (channels_last, mut in_place, folds) = (rewrites.channels_last, rewrites.in_place, rewrites.folds);
    let dequantized = rewrites.dequantized;
    let several = parsed.document.methods.len() > 1;
    let mut resolved = BTreeMap::new();
    let mut notes = Vec::new();
    for (name, m) in parsed.document.methods.iter_mut() {
        let (ops, method_notes) =
            ops::resolve_ops(py, &torch, m, &parsed.document.producer, &options.allow).map_err(in_method(name))?;
        notes.extend(method_notes.into_iter().map(|n| if several { format!("{name}: {n}") } else { n }));
        resolved.insert(name.clone(), ops);
    }
    let mut a = py.detach(|| parsed.validate(&map))?;
    if placement.moves() {
        for m in a.methods.values_mut() {
            placement.place_literals(&mut m.graph);
            m.subgraphs.values_mut().for_each(|g| placement.place_literals(g));
        }
    }
    let doc = &a.document;

    let data = Bound::new(py, MappedData::new(map.clone(), &a.layout))?;
    let mut weights = weights::materialize(py, &torch, data, &doc.weights, &a.weights)?;
    // Folded before anything reads them, on the file's device: the same values a file
    // written by `kwexport optimize` holds.
    weights::fold_batch_norms(py, &mut weights, &folds)?;
    weights::dequantize(py, &mut weights, &dequantized)?;
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
    let graphs = a.methods.values().flat_map(|m| std::iter::once(&m.graph).chain(m.subgraphs.values()));
    let grad_weights = weights::mark_grad_sensitive(py, &mut weights, &state, graphs)?;

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

    let graphs = match options.cuda_graphs {
        Some((max_graphs, warmup, reuse)) => {
            let cache = py.import("kwexport._cuda_graphs")?.getattr("GraphCache")?;
            Some(cache.call1((max_graphs, warmup, reuse, &placement.target))?.unbind())
        }
        None => None,
    };
    let mut options = options.clone();
    options.optimize = a.document.optimized; // the level applied: the file's own may be higher
    let file = Arc::new(FileParts {
        path: path.to_owned(),
        map,
        options,
        placement,
        types: TensorTypes::new(&torch)?,
        digest: PyOnceLock::new(),
        state: (!state.names.is_empty()).then(|| (state, CallLock::new())),
        graphs,
    });
    let checked = std::mem::take(&mut a.methods);
    let mut methods = Vec::with_capacity(checked.len());
    for (name, checked) in checked {
        let parts = method::Parts {
            name: &name,
            doc: &a.document.methods[&name],
            checked,
            ops: resolved.remove(&name).ok_or_else(|| RtError::Internal(format!("method {name} unresolved")))?,
            in_place: in_place.remove(&name).unwrap_or_default(),
        };
        let m = Method::build(py, &torch, parts, &weights, grad_weights, &file).map_err(in_method(&name))?;
        methods.push((name, Py::new(py, m)?));
    }
    let default = match methods.as_slice() {
        [_] => Some(0),
        _ => methods.iter().position(|(n, _)| n == kwexport_core::upgrade::DEFAULT_METHOD),
    };
    let doc = &a.document;
    Ok(Program {
        file,
        methods,
        default,
        extra_files: extra_files.unbind(),
        format_version: doc.format_version,
        producer: producer.unbind(),
        notes,
        upgraded_from: a.file_format_version,
        upgraders: a.upgraders,
    })
}

/// The iterator `Program.stream` returns: each `next` runs the steps to the next token.
#[pyclass(module = "kwexport", name = "TokenStream")]
pub struct TokenStream {
    generation: Generation,
}

#[pymethods]
impl TokenStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<i64>> {
        let step = self.generation.step().clone_ref(py);
        let _guard = step.get().file().state.as_ref().map(|(_, lock)| lock.lock(py));
        Ok(self.generation.next_token(py)?)
    }

    /// Every token so far: the prompt (or the decoder's start token), then the new ones.
    #[getter]
    fn tokens(&self) -> Vec<i64> {
        self.generation.tokens.clone()
    }
}

/// Puts a file error found in one method under that method's name (`methods.NAME.`).
fn in_method(name: &str) -> impl Fn(RtError) -> RtError + '_ {
    move |e| match e {
        RtError::Kwexport(source) => Error::InMethod { method: name.to_owned(), source }.into(),
        other => other,
    }
}

/// SHA-256 of a whole file's bytes, as hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

impl Program {
    /// The content hash of the file as loaded.
    pub fn digest(&self, py: Python<'_>) -> &str {
        self.file.digest(py)
    }

    /// A method by name, or `KeyError` naming the ones the file has.
    pub fn method<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, Method>> {
        match self.methods.iter().find(|(n, _)| n == name) {
            Some((_, m)) => Ok(m.bind(py).clone()),
            None => Err(PyKeyError::new_err(format!("{name:?}: the program has no such method; {}", self.held()))),
        }
    }

    /// The method `program(...)` runs, or a `TypeError` saying to pick one.
    fn default_method<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, Method>> {
        match self.default {
            Some(i) => Ok(self.methods[i].1.bind(py).clone()),
            None => Err(PyTypeError::new_err(format!(
                "this program has several methods and none is named 'forward': call one by name; {}",
                self.held()
            ))),
        }
    }

    /// A generation from `input_ids`: of a decoder-only program (its default method takes
    /// `input_ids` and `cache_position`), or an encoder-decoder one (methods `encode` and
    /// `decode`), whose encoder runs here.
    #[allow(clippy::too_many_arguments)]
    fn generation(
        &self,
        py: Python<'_>,
        input_ids: &Bound<'_, PyAny>,
        max_new_tokens: usize,
        sampling: Sampling,
        eos_token_id: Option<&Bound<'_, PyAny>>,
        decoder_start_token_id: i64,
    ) -> PyResult<Generation> {
        let prompt = generate::prompt_tokens(input_ids)?;
        let eos = match eos_token_id {
            None => Vec::new(),
            Some(e) if e.is_none() => Vec::new(),
            Some(e) => e.extract::<i64>().map(|t| vec![t]).or_else(|_| e.extract::<Vec<i64>>())?,
        };
        let stop = generate::Stop { max_new_tokens, eos };
        let cache_len = self.cache_len(py)?;
        let has = |n: &str| self.methods.iter().any(|(name, _)| name == n);
        if has("encode") && has("decode") {
            let hidden = self.method(py, "encode")?.call1((input_ids,))?;
            let decode = self.method(py, "decode")?.unbind();
            let fixed = [("encoder_hidden_states", hidden)];
            let start = vec![decoder_start_token_id];
            return Ok(Generation::new(py, decode, "decoder_input_ids", &fixed, start, cache_len, stop, sampling)?);
        }
        let step = self.default_method(py).map_err(|_| {
            PyTypeError::new_err(format!(
                "generate() runs a decoder-only program (one method, or `forward`, taking input_ids and \
                 cache_position) or an encoder-decoder one (methods `encode` and `decode`); {}",
                self.held()
            ))
        })?;
        Ok(Generation::new(py, step.unbind(), "input_ids", &[], prompt, cache_len, stop, sampling)?)
    }

    /// The static KV cache's length: the positions of the state named `key_cache*`
    /// (transformers' static cache layout `[batch, heads, positions, head_dim]`).
    fn cache_len(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        let Some((state, _)) = &self.file.state else { return Ok(None) };
        let mut len: Option<usize> = None;
        for (name, t) in state.names.iter().zip(&state.tensors) {
            if name.contains("key_cache") {
                let shape: Vec<usize> = t.bind(py).getattr("shape")?.extract()?;
                if let [.., positions, _] = shape.as_slice() {
                    len = Some(len.map_or(*positions, |l| l.min(*positions)));
                }
            }
        }
        Ok(len)
    }

    fn held(&self) -> String {
        let names: Vec<&str> = self.methods.iter().map(|(n, _)| n.as_str()).collect();
        format!("it holds {}", names.join(", "))
    }
}

#[pymethods]
impl Program {
    /// Calls the file's method: its only one, or `forward`.
    #[pyo3(signature = (*args, **kwargs))]
    fn __call__<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Method::__call__(&self.default_method(args.py())?, args, kwargs)
    }

    /// `Method.profile` of the method `program(...)` calls.
    #[pyo3(signature = (*args, **kwargs))]
    fn profile<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyList>> {
        Method::profile(&self.default_method(args.py())?, args, kwargs)
    }

    /// Generates tokens after `input_ids` (a `[1, n]` LongTensor), as transformers'
    /// `generate` does with a static cache: the prompt, then up to `max_new_tokens` tokens, as
    /// a `[1, n + new]` LongTensor (for an encoder-decoder program, the decoder's start token
    /// then the new ones). Greedy unless `do_sample`; sampling applies `temperature`, `top_k`
    /// and `top_p` in that order, from `seed`. Stops after a token of `eos_token_id` (an int
    /// or a list). The loop runs in Rust with the program's state lock held (per step where a
    /// transformers streamer is given; its `put` and `end` are called as tokens come).
    #[pyo3(signature = (input_ids, max_new_tokens = 20, *, do_sample = false, temperature = 1.0, top_k = 50,
                        top_p = 1.0, eos_token_id = None, seed = None, decoder_start_token_id = 0, streamer = None))]
    #[allow(clippy::too_many_arguments)]
    fn generate<'py>(
        &self,
        py: Python<'py>,
        input_ids: &Bound<'py, PyAny>,
        max_new_tokens: usize,
        do_sample: bool,
        temperature: f64,
        top_k: usize,
        top_p: f64,
        eos_token_id: Option<&Bound<'py, PyAny>>,
        seed: Option<u64>,
        decoder_start_token_id: i64,
        streamer: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let sampling = Sampling::new(do_sample, temperature, top_k, top_p, seed)?;
        let mut g = self.generation(py, input_ids, max_new_tokens, sampling, eos_token_id, decoder_start_token_id)?;
        let torch = py.import("torch")?;
        let long = PyDict::new(py);
        long.set_item("dtype", torch.getattr("long")?)?;
        let tensor = |tokens: Vec<i64>| torch.getattr("tensor")?.call((tokens,), Some(&long));
        // Without a streamer the whole generation holds the state lock; with one, each step
        // does, so that a streamer calling back into the program can't deadlock on it.
        let lock = self.file.state.as_ref().map(|(_, lock)| lock);
        let _whole = lock.filter(|_| streamer.is_none()).map(|l| l.lock(py));
        if let Some(s) = streamer {
            // As transformers does: the prompt as `[1, n]`, then each token as `[1]`.
            let prompt = torch.getattr("tensor")?.call((vec![g.tokens.clone()],), Some(&long))?;
            s.call_method1("put", (prompt,))?;
        }
        loop {
            let token = {
                let _step = lock.filter(|_| streamer.is_some()).map(|l| l.lock(py));
                g.next_token(py)?
            };
            let Some(token) = token else { break };
            if let Some(s) = streamer {
                s.call_method1("put", (tensor(vec![token])?,))?;
            }
        }
        if let Some(s) = streamer {
            s.call_method0("end")?;
        }
        torch.getattr("tensor")?.call((vec![std::mem::take(&mut g.tokens)],), Some(&long))
    }

    /// `generate`'s tokens one by one, as they come: an iterator of ints (the new tokens
    /// only). Each step takes the program's state lock; one generation at a time per program.
    #[pyo3(signature = (input_ids, max_new_tokens = 20, *, do_sample = false, temperature = 1.0, top_k = 50,
                        top_p = 1.0, eos_token_id = None, seed = None, decoder_start_token_id = 0))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        py: Python<'_>,
        input_ids: &Bound<'_, PyAny>,
        max_new_tokens: usize,
        do_sample: bool,
        temperature: f64,
        top_k: usize,
        top_p: f64,
        eos_token_id: Option<&Bound<'_, PyAny>>,
        seed: Option<u64>,
        decoder_start_token_id: i64,
    ) -> PyResult<TokenStream> {
        let sampling = Sampling::new(do_sample, temperature, top_k, top_p, seed)?;
        let g = self.generation(py, input_ids, max_new_tokens, sampling, eos_token_id, decoder_start_token_id)?;
        Ok(TokenStream { generation: g })
    }

    /// A method by name.
    fn __getitem__<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, Method>> {
        self.method(py, name)
    }

    /// A method by name, as an attribute (`program.decode`): only names that no attribute of
    /// `Program` has (`program["NAME"]` reaches any).
    fn __getattr__<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, Method>> {
        self.method(py, name).map_err(|_| {
            PyAttributeError::new_err(format!("'Program' object has no attribute or method '{name}'; {}", self.held()))
        })
    }

    fn __contains__(&self, name: &str) -> bool {
        self.methods.iter().any(|(n, _)| n == name)
    }

    /// The methods, by name, in name order (a read-only mapping).
    #[getter]
    fn methods<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let d = PyDict::new(py);
        for (name, m) in &self.methods {
            d.set_item(name, m.bind(py))?;
        }
        py.import("types")?.getattr("MappingProxyType")?.call1((d,))
    }

    /// The program's state: each weight it writes, by name, as a read-only mapping of the
    /// live tensors (a view of them: writing into one changes the state). Empty for
    /// programs without state.
    #[getter]
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let d = PyDict::new(py);
        if let Some((state, _)) = &self.file.state {
            for (name, t) in state.names.iter().zip(&state.tensors) {
                d.set_item(name, t.bind(py))?;
            }
        }
        py.import("types")?.getattr("MappingProxyType")?.call1((d,))
    }

    /// Restores the state to the file's values.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        if let Some((state, lock)) = &self.file.state {
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
        let copy = load_mapped(py, &self.file.path, self.file.map.clone(), &self.file.options)?;
        if let (Some((mine, lock)), Some((theirs, _))) = (&self.file.state, &copy.file.state) {
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
        Ok((load, self.file.pickled_args(py)))
    }

    /// `Method._run_flat` of the method `program(...)` calls.
    pub fn _run_flat<'py>(&self, leaves: Vec<Bound<'py, PyAny>>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let Some(py) = leaves.first().map(|l| l.py()) else {
            return Err(pyo3::exceptions::PyValueError::new_err("no leaves"));
        };
        self.default_method(py)?.get()._run_flat(leaves)
    }

    /// `Method._flatten` of the method `program(...)` calls.
    #[pyo3(signature = (*args, **kwargs))]
    pub fn _flatten<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        self.default_method(args.py())?.get()._flatten(args, kwargs)
    }

    /// The signature of the method `program(...)` calls, for `inspect.signature(program)`.
    #[getter]
    fn __signature__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.default_method(py)?.get().__signature__(py)
    }

    #[getter]
    fn __name__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.default_method(py)?.get().__name__().to_owned())
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

    /// `Method.dispatch` of the method `program(...)` calls.
    #[getter]
    fn dispatch<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.default_method(py)?.get().dispatch(py)
    }

    /// What loading noticed and handled, such as op-schema drift in a newer torch.
    #[getter]
    fn load_notes(&self) -> Vec<String> {
        self.notes.clone()
    }

    #[getter]
    fn path(&self) -> &str {
        &self.file.path
    }

    /// How far the program was optimized at load: `"exact"` or `"fast"`.
    #[getter]
    fn optimize(&self) -> &'static str {
        self.file.options.optimize.name()
    }

    /// The precision of the program's products and convolutions: `"float32"`, or `"bf16"`
    /// where loaded so.
    #[getter]
    fn precision(&self) -> &'static str {
        self.file.options.precision()
    }

    /// The device the program runs on: given at load, or where it was exported.
    #[getter]
    fn device<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        py.import("torch")?.getattr("device")?.call1((self.file.placement.target.as_str(),))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        if self.default.is_none() || self.methods.len() > 1 {
            let names: Vec<&str> = self.methods.iter().map(|(n, _)| n.as_str()).collect();
            return Ok(format!("<kwexport.Program with methods {} from {:?}>", names.join(", "), self.file.path));
        }
        let m = self.default_method(py)?;
        let sig = m.get().__signature__(py)?.bind(py).str()?.to_string();
        Ok(format!("<kwexport.Program {}{sig} from {:?}>", m.get().__name__(), self.file.path))
    }
}
