//! `Program`: a loaded artifact. Loading parses and validates everything before anything
//! is returned; calling binds, flattens, checks, runs and rebuilds.

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::Arc;

use memmap2::MmapOptions;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple};

use crate::artifact;
use crate::checks::{self, Checker, LeafCheck, Symbol};
use crate::container;
use crate::error::{Error, Result};
use crate::graph;
use crate::plan::{self, Plan};
use crate::schema::{Document, Encoding, FormatVersion, Key, LeafSpec, ParamKind, TreeSpec};
use crate::signature::{Bound as Binding, Signature, Source};
use crate::treespec::{self, Compiled, PathElem};
use crate::upgrade;
use crate::weights::{self, MappedData};

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
    positional: Vec<Compiled>,
    /// One spec per `*args` item seen at export.
    var_positional: Vec<Compiled>,
    keywords: Vec<(KwTarget, Compiled)>,
    /// The `**kwargs` names seen at export, for messages.
    extra_names: Vec<String>,
}

#[pyclass(frozen, module = "kwexport", name = "Program")]
pub struct Program {
    path: String,
    sig: Signature,
    defaults: Vec<Option<Py<PyAny>>>,
    top: TopLevel,
    leaf_checks: Vec<LeafCheck>,
    leaf_paths: Vec<String>,
    symbols: Vec<Symbol>,
    plan: Plan,
    outputs: Compiled,
    tensor_type: Py<PyAny>,
    extra_files: Py<PyDict>,
    format_version: FormatVersion,
    upgraded_from: FormatVersion,
    upgraders: Vec<&'static str>,
    producer: Py<PyDict>,
    /// What loading noticed and handled: compatible op-schema drift, op upgraders run.
    notes: Vec<String>,
    /// The mapped file, kept for its content hash when the program is pickled.
    map: Arc<memmap2::MmapMut>,
    allow_ops: Vec<String>,
    dispatch: plan::Dispatch,
    digest: PyOnceLock<String>,
    signature_obj: PyOnceLock<Py<PyAny>>,
}

/// Everything that can be checked without Python: the document's cross-field rules.
struct Validated {
    doc: Document,
    sig: Signature,
    symbols: Vec<Symbol>,
    graph: graph::GraphPlan,
    weights: BTreeMap<String, weights::Checked>,
    leaf_paths: Vec<String>,
    upgraded_from: FormatVersion,
    upgraders: Vec<&'static str>,
}

/// Parses a whole file's bytes: container, header JSON, upgraders, typed document.
pub fn parse_file(bytes: &[u8]) -> Result<(container::Layout, Document, Vec<&'static str>, FormatVersion)> {
    let layout = container::parse_layout(bytes)?;
    let header = &bytes[layout.header.clone()];
    crate::schema::check_unique_keys(header).map_err(|e| artifact!("header: invalid JSON: {e}"))?;
    let header: serde_json::Value =
        serde_json::from_slice(header).map_err(|e| artifact!("header: invalid JSON: {e}"))?;
    let up = upgrade::upgrade(header)?;
    let doc: Document = serde_json::from_value(up.document).map_err(|e| artifact!("header: {e}"))?;
    Ok((layout, doc, up.applied, up.from))
}

/// Parses and validates a whole file's bytes without Python: fuzzable and testable.
pub fn validate_file(bytes: &[u8]) -> Result<()> {
    describe_file(bytes).map(|_| ())
}

/// What `kwexport inspect` and `kwexport upgrade` need: the validated document at the
/// current version, where it came from, every input leaf's path, and the data section.
pub struct Description {
    pub document: Document,
    pub file_format_version: FormatVersion,
    pub upgraders: Vec<&'static str>,
    pub leaf_paths: Vec<String>,
    pub data: std::ops::Range<usize>,
}

pub fn describe_file(bytes: &[u8]) -> Result<Description> {
    let (layout, doc, upgraders, from) = parse_file(bytes)?;
    let v = check_document(doc, &layout, bytes, upgraders, from)?;
    Ok(Description {
        document: v.doc,
        file_format_version: v.upgraded_from,
        upgraders: v.upgraders,
        leaf_paths: v.leaf_paths,
        data: layout.data,
    })
}

/// Every cross-field rule of a parsed document.
fn check_document(
    doc: Document,
    layout: &container::Layout,
    bytes: &[u8],
    upgraders: Vec<&'static str>,
    upgraded_from: FormatVersion,
) -> Result<Validated> {
    let layout = layout.clone();
    let sig = Signature::new(&doc.signature)?;
    let n_leaves = treespec::validate(&doc.inputs.spec, "inputs.spec")?;
    if n_leaves != doc.inputs.leaves.len() {
        return Err(artifact!(
            "inputs: the spec has {n_leaves} leaves but inputs.leaves describes {}",
            doc.inputs.leaves.len()
        ));
    }
    let n_out = treespec::validate(&doc.outputs, "outputs")?;
    if n_out != doc.graph.outputs.len() {
        return Err(artifact!(
            "outputs: the spec has {n_out} leaves but the graph returns {}",
            doc.graph.outputs.len()
        ));
    }
    let leaf_paths = top_level_paths(&doc.inputs.spec, &sig)?;
    let symbols = checks::symbols(&doc.symbols)?;
    for (i, leaf) in doc.inputs.leaves.iter().enumerate() {
        if let crate::schema::LeafSpec::Tensor(t) = leaf {
            checks::dims(&t.shape, &symbols, &format!("inputs.leaves[{i}]"))?;
        }
    }
    let weights = weights::validate(&doc.weights, &layout)?;
    let ops = graph::op_names(&doc.ops)?;
    let graph = graph::plan(&doc.graph, &ops, n_leaves, |w| weights.contains_key(w))?;
    let mut extra_spans = Vec::new();
    for (name, f) in &doc.extra_files {
        let what = format!("extra_files[{name:?}]");
        check_extra_name(name, &what)?;
        let range = container::data_range(&layout, f.offset, f.nbytes, &what)?;
        if f.encoding == Encoding::Utf8 && std::str::from_utf8(&bytes[range.clone()]).is_err() {
            return Err(artifact!("{what}: declared UTF-8 but is not"));
        }
        extra_spans.push(range);
    }
    Ok(Validated { doc, sig, symbols, graph, weights, leaf_paths, upgraded_from, upgraders })
}

fn check_extra_name(name: &str, what: &str) -> Result<()> {
    let bad = name.is_empty()
        || name.len() > 255
        || name.starts_with('/')
        || name.contains('\\')
        || name.contains('\0')
        || name.split('/').any(|part| part.is_empty() || part == "." || part == "..");
    if bad {
        return Err(artifact!("{what}: unsafe extra-file name"));
    }
    Ok(())
}

/// Checks the root `(args, kwargs)` against the signature and names every leaf's path.
fn top_level_paths(spec: &TreeSpec, sig: &Signature) -> Result<Vec<String>> {
    let (args, kwargs) = split_root(spec)?;
    let mut paths = Vec::new();
    let n_pos = sig.n_positional();
    if args.len() < n_pos {
        return Err(artifact!("inputs.spec: {} positional entries for {n_pos} positional parameters", args.len()));
    }
    if args.len() > n_pos && sig.var_positional().is_none() {
        return Err(artifact!("inputs.spec: extra positional entries but the signature has no *args"));
    }
    for (i, child) in args.iter().enumerate() {
        let root = if i < n_pos {
            sig.params[i].name.clone()
        } else {
            format!("{}[{}]", sig.params[sig.var_positional().expect("checked")].name, i - n_pos)
        };
        leaf_paths(child, &root, &mut Vec::new(), &mut paths);
    }
    for p in sig.params.iter().filter(|p| p.kind == ParamKind::KeywordOnly) {
        if !kwargs.iter().any(|e| e.key == Key::Str(p.name.clone())) {
            return Err(artifact!("inputs.spec: keyword-only parameter {:?} has no entry", p.name));
        }
    }
    for e in kwargs {
        let Key::Str(name) = &e.key else {
            return Err(artifact!("inputs.spec: keyword entry {} is not a string", e.key));
        };
        let is_kw_only = sig.params.iter().any(|p| &p.name == name && p.kind == ParamKind::KeywordOnly);
        if !is_kw_only && sig.var_keyword().is_none() {
            return Err(artifact!("inputs.spec: keyword entry {name:?} matches no keyword-only parameter"));
        }
        leaf_paths(&e.value, name, &mut Vec::new(), &mut paths);
    }
    Ok(paths)
}

fn split_root(spec: &TreeSpec) -> Result<(&[TreeSpec], &[crate::schema::DictEntry])> {
    if let TreeSpec::Tuple { children } = spec {
        if let [TreeSpec::Tuple { children: args }, TreeSpec::Dict { entries }] = children.as_slice() {
            return Ok((args, entries));
        }
    }
    Err(artifact!(
        "inputs.spec: the root must be a tuple of (a tuple of positional arguments, a dict of keyword arguments)"
    ))
}

fn leaf_paths(spec: &TreeSpec, root: &str, path: &mut Vec<String>, out: &mut Vec<String>) {
    let mut walk = |step: String, child: &TreeSpec, path: &mut Vec<String>| {
        path.push(step);
        leaf_paths(child, root, path, out);
        path.pop();
    };
    match spec {
        TreeSpec::Leaf => out.push(format!("{root}{}", path.concat())),
        TreeSpec::None => {}
        TreeSpec::Tuple { children } | TreeSpec::List { children } => {
            children.iter().enumerate().for_each(|(i, c)| walk(format!("[{i}]"), c, path))
        }
        TreeSpec::Dict { entries } | TreeSpec::OrderedDict { entries } => {
            entries.iter().for_each(|e| walk(format!("[{}]", e.key), &e.value, path))
        }
        TreeSpec::NamedTuple { fields, children, .. } => {
            fields.iter().zip(children).for_each(|(f, c)| walk(format!(".{f}"), c, path))
        }
    }
}

/// Loads and validates a file. Nothing is returned unless everything checks out.
pub fn load(
    py: Python<'_>,
    path: &str,
    allow: &plan::AllowOps,
    allow_ops: Vec<String>,
    dispatch: plan::Dispatch,
) -> PyResult<Program> {
    let file = File::open(path)?;
    let len = file.metadata()?.len();
    if len == 0 {
        return Err(artifact!("file: truncated: 0 bytes").into());
    }
    // SAFETY: a private, copy-on-write map. Another process truncating the file under us
    // would fault, as with any mapped file; kwexport writes files by rename, never in place.
    let map = Arc::new(unsafe { MmapOptions::new().map_copy(&file)? });
    // Parsing and checking touch no Python object: other threads run meanwhile.
    let (layout, mut doc, upgraders, from) = py.detach(|| parse_file(&map))?;
    let torch = py.import("torch")?;
    // Op upgraders may rewrite nodes, so ops are resolved before the graph is checked.
    let (ops, notes) = plan::resolve_ops(py, &torch, &mut doc, allow)??;
    let v = py.detach(|| check_document(doc, &layout, &map, upgraders, from))?;

    let data = Bound::new(py, MappedData::new(map.clone(), &layout))?;
    let weights = weights::materialize(py, &torch, data, &v.doc.weights, &v.weights)?;
    let leaf_is_tensor: Vec<bool> = v.doc.inputs.leaves.iter().map(|l| matches!(l, LeafSpec::Tensor(_))).collect();
    let plan = plan::build(py, &torch, &v.graph, &ops, &weights, &leaf_is_tensor, dispatch)??;

    let mut leaf_checks = Vec::with_capacity(v.doc.inputs.leaves.len());
    for (i, leaf) in v.doc.inputs.leaves.iter().enumerate() {
        leaf_checks.push(LeafCheck::new(py, &torch, leaf, &v.symbols, &format!("inputs.leaves[{i}]"))??);
    }
    let defaults = v
        .sig
        .params
        .iter()
        .map(|p| p.default.as_ref().map(|d| plan::constant_to_py(py, d)).transpose())
        .collect::<PyResult<Vec<_>>>()?;

    let (args, kwargs) = split_root(&v.doc.inputs.spec)?;
    let n_pos = v.sig.n_positional();
    let compile_all = |specs: &[TreeSpec]| specs.iter().map(|s| Compiled::new(py, s)).collect::<PyResult<Vec<_>>>();
    let mut keywords = Vec::with_capacity(kwargs.len());
    let mut extra_names = Vec::new();
    for e in kwargs {
        let Key::Str(name) = &e.key else { unreachable!("checked in top_level_paths") };
        let target = match v.sig.params.iter().position(|p| &p.name == name && p.kind == ParamKind::KeywordOnly) {
            Some(i) => KwTarget::Param(i),
            None => {
                extra_names.push(name.clone());
                KwTarget::Extra(name.clone())
            }
        };
        keywords.push((target, Compiled::new(py, &e.value)?));
    }
    let top = TopLevel {
        positional: compile_all(&args[..n_pos])?,
        var_positional: compile_all(&args[n_pos..])?,
        keywords,
        extra_names,
    };

    let extra_files = PyDict::new(py);
    for (name, f) in &v.doc.extra_files {
        let range = container::data_range(&layout, f.offset, f.nbytes, name)?;
        let bytes = &map[range];
        match f.encoding {
            Encoding::Bytes => extra_files.set_item(name, PyBytes::new(py, bytes))?,
            Encoding::Utf8 => extra_files.set_item(name, std::str::from_utf8(bytes).expect("validated"))?,
        }
    }
    let producer = PyDict::new(py);
    producer.set_item("kwexport", &v.doc.producer.kwexport)?;
    producer.set_item("torch", &v.doc.producer.torch)?;
    producer.set_item("python", &v.doc.producer.python)?;

    Ok(Program {
        path: path.to_owned(),
        defaults,
        top,
        leaf_checks,
        leaf_paths: v.leaf_paths,
        symbols: v.symbols,
        plan,
        outputs: Compiled::new(py, &v.doc.outputs)?,
        tensor_type: torch.getattr("Tensor")?.unbind(),
        extra_files: extra_files.unbind(),
        format_version: v.doc.format_version,
        upgraded_from: v.upgraded_from,
        upgraders: v.upgraders,
        producer: producer.unbind(),
        notes,
        map,
        allow_ops,
        dispatch,
        digest: PyOnceLock::new(),
        sig: v.sig,
        signature_obj: PyOnceLock::new(),
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
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut kw: Vec<(Bound<'py, PyString>, Bound<'py, PyAny>)> = Vec::new();
        if let Some(kwargs) = kwargs {
            for (k, v) in kwargs.iter() {
                kw.push((k.cast_into::<PyString>()?, v));
            }
        }
        let names = kw.iter().map(|(k, _)| k.to_str()).collect::<PyResult<Vec<_>>>()?;
        let binding = self.sig.bind(args.len(), &names)?;

        let fetch = |i: usize, src: Source| -> Bound<'py, PyAny> {
            match src {
                Source::Positional(p) => args.get_item(p).expect("bound in range"),
                Source::Keyword(k) => kw[k].1.clone(),
                Source::Default => {
                    self.defaults[i].as_ref().expect("bound only with a default").bind(args.py()).clone()
                }
            }
        };
        let mut leaves = Vec::with_capacity(self.leaf_checks.len());
        let mut path = Vec::new();
        let mut var_kw: &[usize] = &[];
        let mut values: Vec<Option<Bound<'py, PyAny>>> = vec![None; self.sig.params.len()];
        for (i, b) in binding.iter().enumerate() {
            match b {
                Binding::One(src) => values[i] = Some(fetch(i, *src)),
                Binding::VarPositional(range) => {
                    let name = &self.sig.params[i].name;
                    if range.len() != self.top.var_positional.len() {
                        return Err(Error::Input(format!(
                            "*{name}: expected {} extra positional argument(s), as exported, got {}",
                            self.top.var_positional.len(),
                            range.len()
                        ))
                        .into());
                    }
                }
                Binding::VarKeyword(ks) => var_kw = ks,
            }
        }
        for (i, spec) in self.top.positional.iter().enumerate() {
            let v = values[i].as_ref().expect("every positional parameter is bound");
            spec.flatten(v, &self.sig.params[i].name, &mut path, &mut leaves)?;
        }
        if let Some(vp) = self.sig.var_positional() {
            let name = &self.sig.params[vp].name;
            for (j, spec) in self.top.var_positional.iter().enumerate() {
                let item = args.get_item(self.sig.n_positional() + j)?;
                path.push(PathElem::Index(j));
                spec.flatten(&item, name, &mut path, &mut leaves)?;
                path.pop();
            }
        }
        if var_kw.len() != self.top.extra_names.len() {
            let unexpected: Vec<&str> =
                var_kw.iter().map(|&k| names[k]).filter(|n| !self.top.extra_names.iter().any(|e| e == n)).collect();
            if let Some(n) = unexpected.first() {
                return Err(self.extra_error(n, "unexpected keyword argument").into());
            }
        }
        for (target, spec) in &self.top.keywords {
            match target {
                KwTarget::Param(i) => {
                    let v = values[*i].as_ref().expect("every keyword-only parameter is bound");
                    spec.flatten(v, &self.sig.params[*i].name, &mut path, &mut leaves)?;
                }
                KwTarget::Extra(name) => {
                    let v = var_kw
                        .iter()
                        .find(|&&k| names[k] == name)
                        .map(|&k| &kw[k].1)
                        .ok_or_else(|| self.extra_error(name, "missing keyword argument"))?;
                    spec.flatten(v, name, &mut path, &mut leaves)?;
                }
            }
        }
        Ok(leaves)
    }

    fn extra_error(&self, name: &str, what: &str) -> Error {
        let var = self.sig.var_keyword().map(|i| self.sig.params[i].name.as_str()).unwrap_or("kwargs");
        let held: Vec<String> = self.top.extra_names.iter().map(|n| format!("'{n}'")).collect();
        let held = if held.is_empty() { "nothing".to_owned() } else { held.join(", ") };
        Error::Input(format!("{name}: {what}: at export **{var} held {held}"))
    }

    fn check(&self, leaves: &[Bound<'_, PyAny>], tensor_type: &Bound<'_, PyAny>) -> Result<()> {
        let mut checker = Checker::new(&self.symbols, &self.leaf_paths);
        for (i, (leaf, check)) in leaves.iter().zip(&self.leaf_checks).enumerate() {
            check.check(leaf, tensor_type, i, &mut checker)?;
        }
        Ok(())
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
        let py = args.py();
        let leaves = self.flatten(args, kwargs)?;
        self.check(&leaves, self.tensor_type.bind(py))?;
        let flat = self.plan.run(py, &leaves)?;
        self.outputs.unflatten(py, &mut flat.into_iter())
    }

    /// Pickles by reference: the path and the file's content hash, never the weights. The
    /// receiving process maps the same file and checks the hash.
    fn __reduce__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, (String, String, Vec<String>, &'static str))> {
        let load = py.import("kwexport._rt")?.getattr("_load_verified")?;
        Ok((load, (self.path.clone(), self.digest(py).to_owned(), self.allow_ops.clone(), self.dispatch.name())))
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
        self.plan.run(py, &leaves)
    }

    /// Binds and flattens a call to its leaves, checked, without running the graph.
    #[pyo3(signature = (*args, **kwargs))]
    pub fn _flatten<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let leaves = self.flatten(args, kwargs)?;
        self.check(&leaves, self.tensor_type.bind(args.py()))?;
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
                    .sig
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
        &self.sig.name
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

    /// How many graph nodes run on each path: `{"stable_abi": n, "python": m}`. Nodes the
    /// stable C ABI covers run without Python; the rest through torch's Python op objects.
    #[getter]
    fn dispatch<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("stable_abi", self.plan.counts.0)?;
        d.set_item("python", self.plan.counts.1)?;
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

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let sig = self.__signature__(py)?.bind(py).str()?.to_string();
        Ok(format!("<kwexport.Program {}{sig} from {:?}>", self.sig.name, self.path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_file_names_must_be_plain() {
        for bad in ["", "/etc/passwd", "../x", "a/../../b", "a//b", "a\\b", "a\0b", "./a"] {
            assert!(check_extra_name(bad, "x").is_err(), "{bad:?} accepted");
        }
        for good in ["notes.txt", "meta/config.json", "..hidden"] {
            assert!(check_extra_name(good, "x").is_ok(), "{good:?} refused");
        }
    }
}
