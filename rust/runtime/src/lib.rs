//! kwexport's runtime, the Python extension `kwexport._rt`, on top of `kwexport-core` (the
//! file format and its validation). Loading runs through four stages, each importing only
//! the ones before it:
//!
//! - `ops`: stage 1, the op allow-list, resolving ops in the running torch, schema drift,
//!   and what later stages need of each op's schema
//! - `plan`: stage 2, the graph compiled once per load: constants, the path of each node,
//!   the cost model, segments
//! - `exec`: stage 3, the run loop and the conversions between the paths
//! - `abi`: torch's stable C ABI, its types and encodings: the layer the stages build on,
//!   depending only on the core's tables and the pure-Rust leaves below
//!   (`tests/layering.rs` holds the order)
//! - `kernels` (kwexport's own float32 kernels) and `views` (view geometry): pure Rust,
//!   importing nothing of the runtime
//!
//! The call path around them: `tree` (compiled treespecs: flatten inputs, rebuild outputs),
//! `calllock` (the fork-safe lock around stateful calls), `checks` (input checks on Python
//! values), `constants` (the file's constants as Python objects), `weights` (zero-copy
//! tensors over the mapped file), `program` (the `Program` class: a file's methods over its
//! weights and state), `method` (one method: bind, check, run, write back), `generate` (the
//! decode loop) and `errors` (one error type, and the Python exception classes).

/// mimalloc: loading a program makes and drops tens of thousands of small objects (the
/// parsed schema, the plan), which glibc's allocator spends about a tenth of a load on.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub mod abi;
pub mod calllock;
pub mod checks;
pub mod constants;
pub mod device;
pub mod errors;
pub mod exec;
pub mod fallback;
pub mod generate;
pub mod kernels;
pub mod method;
pub mod operators;
pub mod ops;
pub mod plan;
pub mod program;
pub mod tree;
pub mod views;
pub mod weights;

use kwexport_core::tables;
use kwexport_core::{upgrade, Error};
use pyo3::exceptions::{PyImportError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{IntoPyErr, RtError, RtResult};

/// Loads a kwexport file and returns a callable `Program`. `allow_ops` names custom op
/// namespaces or ops (`"mylib::*"`) the file may call beyond torch's own. `dispatch` is
/// `"auto"` (torch's stable C ABI where it covers a node and pays off), `"abi"` (wherever it
/// covers a node) or `"python"` (torch's Python op objects throughout). `device` places the
/// program (a torch device string or `torch.device`); by default it runs where it was
/// exported.
#[pyfunction]
#[pyo3(signature = (path, *, allow_ops = Vec::new(), dispatch = "auto", device = None, mmap = true, optimize = "exact", precision = "float32", cuda_graphs = None))]
#[allow(clippy::too_many_arguments)]
fn load(
    py: Python<'_>,
    path: std::path::PathBuf,
    allow_ops: Vec<String>,
    dispatch: &str,
    device: Option<&Bound<'_, PyAny>>,
    mmap: bool,
    optimize: &str,
    precision: &str,
    cuda_graphs: Option<program::GraphOptions>,
) -> PyResult<program::Program> {
    let path = path.to_str().ok_or_else(|| PyValueError::new_err("path is not valid UTF-8"))?;
    let dispatch = plan::Dispatch::parse(dispatch).ok_or_else(|| {
        PyValueError::new_err(format!("dispatch must be 'auto', 'abi' or 'python', not '{dispatch}'"))
    })?;
    let device = device.map(|d| normalize_device(py, d)).transpose()?;
    let optimize = kwexport_core::passes::Level::parse(optimize)
        .ok_or_else(|| PyValueError::new_err(format!("optimize must be 'exact' or 'fast', not '{optimize}'")))?;
    let bf16 = match precision {
        "float32" => false,
        "bf16" => true,
        _ => return Err(PyValueError::new_err(format!("precision must be 'float32' or 'bf16', not '{precision}'"))),
    };
    let mut options =
        program::LoadOptions::new(allow_ops, dispatch, device, mmap, optimize, bf16).map_err(PyValueError::new_err)?;
    options.cuda_graphs = cuda_graphs;
    Ok(program::load(py, path, &options)?)
}

/// A device as torch prints it, with an index for CUDA (`cuda` is the current one), checked
/// to exist here.
fn normalize_device(py: Python<'_>, d: &Bound<'_, PyAny>) -> PyResult<String> {
    let torch = py.import("torch")?;
    let given = d.str()?.to_string();
    let bad = |why: String| PyValueError::new_err(format!("device {given:?}: {why}"));
    let device = torch.getattr("device")?.call1((d,)).map_err(|e| bad(e.value(py).to_string()))?;
    let kind: String = device.getattr("type")?.extract()?;
    if kind == "cuda" {
        let cuda = torch.getattr("cuda")?;
        if !cuda.call_method0("is_available")?.is_truthy()? {
            return Err(bad("CUDA is not available in this process".into()));
        }
        let count: i64 = cuda.call_method0("device_count")?.extract()?;
        let index: i64 = match device.getattr("index")?.extract::<Option<i64>>()? {
            Some(i) => i,
            None => cuda.call_method0("current_device")?.extract()?,
        };
        if index >= count {
            return Err(bad(format!("this process sees {count} CUDA device(s)")));
        }
        return Ok(format!("cuda:{index}"));
    }
    Ok(device.str()?.to_string())
}

/// Whether the running torch has the stable C ABI the C path needs (torch 2.13 and later);
/// without it every node runs through torch's Python op objects.
#[pyfunction]
fn stable_abi_available(py: Python<'_>) -> bool {
    abi::Abi::get(py).is_some()
}

/// Unpickles a `Program`: loads `path` and checks that its content hash is `digest`.
#[pyfunction]
#[pyo3(signature = (path, digest, allow_ops, dispatch, device = None, mmap = true, optimize = "exact", precision = "float32", cuda_graphs = None))]
#[allow(clippy::too_many_arguments)]
fn _load_verified(
    py: Python<'_>,
    path: std::path::PathBuf,
    digest: &str,
    allow_ops: Vec<String>,
    dispatch: &str,
    device: Option<&Bound<'_, PyAny>>,
    mmap: bool,
    optimize: &str,
    precision: &str,
    cuda_graphs: Option<program::GraphOptions>,
) -> PyResult<program::Program> {
    let prog = load(py, path.clone(), allow_ops, dispatch, device, mmap, optimize, precision, cuda_graphs)?;
    if prog.digest(py) != digest {
        let found = prog.digest(py).to_owned();
        let path = path.display().to_string();
        return Err(Error::FileChanged { path, found, expected: digest.to_owned() }.into_py_err());
    }
    Ok(prog)
}

/// `_load_verified`'s arguments as a pickled method carries them (`program::PickledArgs`).
type PickledFile<'py> = (
    std::path::PathBuf,
    String,
    Vec<String>,
    String,
    Option<Bound<'py, PyAny>>,
    bool,
    String,
    String,
    Option<program::GraphOptions>,
);

/// Unpickles a `Method`: loads its file as `_load_verified` does and returns the method.
#[pyfunction]
fn _load_method<'py>(py: Python<'py>, name: &str, file: PickledFile<'py>) -> PyResult<Bound<'py, method::Method>> {
    let (path, digest, allow_ops, dispatch, device, mmap, optimize, precision, cuda_graphs) = file;
    let prog = _load_verified(
        py,
        path,
        &digest,
        allow_ops,
        &dispatch,
        device.as_ref(),
        mmap,
        &optimize,
        &precision,
        cuda_graphs,
    )?;
    prog.method(py, name)
}

/// Validates a file without running anything and describes it, for the command line: a
/// dict with `description` (what `kwexport inspect` prints, as JSON), `header` (the header
/// as JSON, brought to the current format), `file_format_version`, `upgraders` and
/// `data_offset`.
#[pyfunction]
fn describe(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let bytes = std::fs::read(&path)?;
    let a = py.detach(|| kwexport_core::open(&bytes)).map_err(IntoPyErr::into_py_err)?;
    let internal = |e: serde_json::Error| RtError::Internal(format!("describe: {e}"));
    let out = pyo3::types::PyDict::new(py);
    out.set_item("description", serde_json::to_string(&a.describe()).map_err(internal)?)?;
    out.set_item("header", serde_json::to_string(&a.document).map_err(internal)?)?;
    out.set_item("file_format_version", (a.file_format_version.major, a.file_format_version.minor))?;
    out.set_item("upgraders", a.upgraders.clone())?;
    out.set_item("data_offset", a.layout.data.start)?;
    Ok(out)
}

/// Checks an extra-file name against the format's rule; raises `ArtifactError` if unsafe.
#[pyfunction]
fn check_extra_name(name: &str) -> PyResult<()> {
    if tables::is_safe_extra_name(name) {
        Ok(())
    } else {
        Err(Error::UnsafeExtraName { entry: format!("extra_files[{name:?}]") }.into_py_err())
    }
}

/// Rewrites a header (JSON, at the current format) at an optimization level, as loading at
/// that level would, but portable (nothing only a loader may decide): returns the new header,
/// the weights to store channels-last, and the batch-norm folds whose weights the writer
/// computes (`kwexport._passes`); weights stay plain tensors. For `kwexport optimize` and
/// `kwexport.save(..., optimize=...)`.
#[pyfunction]
fn optimize_header<'py>(
    py: Python<'py>,
    header: &str,
    level: &str,
) -> PyResult<(String, Vec<String>, Bound<'py, pyo3::types::PyList>)> {
    let level = kwexport_core::passes::Level::parse(level)
        .ok_or_else(|| PyValueError::new_err(format!("optimize must be 'exact' or 'fast', not '{level}'")))?;
    let mut doc: kwexport_core::schema::Document =
        serde_json::from_str(header).map_err(|e| Error::Schema { message: e.to_string() }.into_py_err())?;
    let rewrites = errors::apply_passes(&mut doc, level, kwexport_core::passes::Target::default())?;
    let json = serde_json::to_string(&doc).map_err(|e| RtError::Internal(format!("optimize: {e}")))?;
    Ok((json, rewrites.channels_last, weights::folds_to_py(py, &rewrites.folds)?))
}

/// Checks a method name against the format's rule; raises `ArtifactError` if it breaks it.
#[pyfunction]
fn check_method_name(name: &str) -> PyResult<()> {
    if tables::is_method_name(name) {
        Ok(())
    } else {
        Err(Error::MethodName(name.to_owned()).into_py_err())
    }
}

/// The 16-byte prefix and header of a file, padded to where its data section starts.
#[pyfunction]
fn container_head<'py>(py: Python<'py>, header: &[u8]) -> RtResult<Bound<'py, PyBytes>> {
    let mut out = Vec::with_capacity(header.len() + 2 * tables::ALIGN as usize);
    out.extend_from_slice(tables::MAGIC);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header);
    let end = kwexport_core::container::align_up(out.len() as u64)
        .ok_or_else(|| RtError::Internal("header length overflows".into()))?;
    out.resize(end as usize, 0);
    Ok(PyBytes::new(py, &out))
}

/// The binder alone, for property tests against Python's own binding: binds a call with
/// `n_args` positionals and these keyword names to a signature given as its JSON. Returns,
/// per parameter, `("positional", i)`, `("keyword", name)`, `("default",)`,
/// `("var_positional", start, stop)` or `("var_keyword", [names])`.
#[pyfunction]
fn _bind<'py>(
    py: Python<'py>,
    signature_json: &str,
    n_args: usize,
    keywords: Vec<String>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    use kwexport_core::binder::{Binder, Binding, Source};
    use pyo3::IntoPyObjectExt;
    let raw: kwexport_core::schema::Signature = serde_json::from_str(signature_json)
        .map_err(|e| Error::Schema { message: format!("signature: {e}") }.into_py_err())?;
    let binder = Binder::new(&raw).map_err(IntoPyErr::into_py_err)?;
    binder
        .bind(n_args, &keywords)
        .map_err(IntoPyErr::into_py_err)?
        .into_iter()
        .map(|b| match b {
            Binding::One(Source::Positional(i)) => ("positional", i).into_bound_py_any(py),
            Binding::One(Source::Keyword(k)) => ("keyword", keywords[k].clone()).into_bound_py_any(py),
            Binding::One(Source::Default) => ("default",).into_bound_py_any(py),
            Binding::VarPositional(r) => ("var_positional", r.start, r.end).into_bound_py_any(py),
            Binding::VarKeyword(ks) => {
                ("var_keyword", ks.into_iter().map(|k| keywords[k].clone()).collect::<Vec<_>>()).into_bound_py_any(py)
            }
        })
        .collect()
}

/// Which instruction set's kernels run `optimize="fast"` here: `{"isa": "avx512" | "avx2" |
/// "portable" | None, "forced": bool, "supported": [...], "int8": "quads" | "pairs" | None,
/// "int8_reduced": the same, "int8_tiles": bool}` (`isa` is None where kwexport's kernels are off and torch's
/// run: no vector family detected, or `KWEXPORT_ISA` names one this CPU lacks; `int8` is the
/// int8 GEMM's layout for any program, VNNI's byte quads or int16 pairs, and `int8_reduced`
/// its layout for activations of 128 levels, `kwexport.quantize(..., reduce_range=True)`:
/// byte quads on `vpmaddubsw` without VNNI; `int8_tiles` whether the AVX-512 family runs
/// quads on AMX's tiles).
#[pyfunction]
fn kernel_info(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    use kernels::isa;
    let d = pyo3::types::PyDict::new(py);
    d.set_item("isa", isa::kernels().map(|t| t.isa.name()))?;
    d.set_item("forced", !matches!(isa::choice(), isa::Choice::Detected(_)))?;
    d.set_item("supported", isa::supported().into_iter().map(isa::Isa::name).collect::<Vec<_>>())?;
    let name = |l: Option<kernels::int8::Layout>| {
        l.map(|l| match l {
            kernels::int8::Layout::Quads => "quads",
            kernels::int8::Layout::Pairs => "pairs",
        })
    };
    d.set_item("int8", name(kernels::int8::Layout::current()))?;
    d.set_item("int8_reduced", name(kernels::int8::Layout::choose(127, 128)))?;
    d.set_item("int8_tiles", isa::kernels().is_some_and(|t| t.isa == isa::Isa::Avx512) && isa::int8_tiles())?;
    Ok(d)
}

#[pymodule]
fn _rt(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // A broken upgrader chain is a build defect: refuse to import rather than misread files.
    upgrade::validate_chain(upgrade::UPGRADERS, upgrade::OLDEST, upgrade::CURRENT)
        .map_err(|e| PyImportError::new_err(format!("kwexport: invalid upgrader chain: {e}")))?;
    let c = errors::classes(py);
    m.add("KwexportError", c.base.bind(py))?;
    m.add("ArtifactError", c.artifact.bind(py))?;
    m.add("VersionError", c.version.bind(py))?;
    m.add("SignatureError", c.signature.bind(py))?;
    m.add("InputError", c.input.bind(py))?;
    m.add("FORMAT_VERSION", (upgrade::CURRENT.major, upgrade::CURRENT.minor))?;
    m.add("OLDEST_FORMAT_VERSION", (upgrade::OLDEST.major, upgrade::OLDEST.minor))?;
    let released: Vec<(u32, u32)> = upgrade::released().iter().map(|v| (v.major, v.minor)).collect();
    m.add("RELEASED_FORMAT_VERSIONS", released)?;
    // The format's tables, for the Python exporter: one source of truth.
    m.add("MAGIC", PyBytes::new(py, tables::MAGIC))?;
    m.add("ALIGN", tables::ALIGN)?;
    m.add("DTYPES", tables::DTYPES.iter().map(|d| (d.name, d.itemsize)).collect::<Vec<_>>())?;
    m.add("PY_OPERATORS", tables::PY_OPERATORS.to_vec())?;
    m.add("SYM_FUNCTIONS", tables::SYM_FUNCTIONS.to_vec())?;
    m.add("LAYOUTS", tables::LAYOUTS.to_vec())?;
    m.add("MEMORY_FORMATS", tables::MEMORY_FORMATS.to_vec())?;
    m.add("HIGHER_ORDER_OPS", kwexport_core::hops::HopKind::NAMES.to_vec())?;
    m.add("SHIM_SYMBOLS", abi::shims::SYMBOLS.to_vec())?;
    let post_ops = kwexport_core::passes::post_ops::POST_OPS.iter().map(|p| (p.attr, p.op)).collect::<Vec<_>>();
    m.add("POST_OPS", post_ops)?;
    m.add("FALLBACK_CALLS_AFTER_ERROR", fallback::CALLS_AFTER_ERROR)?;
    m.add_function(wrap_pyfunction!(stable_abi_available, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_info, m)?)?;
    m.add_class::<program::Program>()?;
    m.add_class::<method::Method>()?;
    m.add_class::<program::TokenStream>()?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(_load_method, m)?)?;
    m.add_function(wrap_pyfunction!(check_method_name, m)?)?;
    m.add_function(wrap_pyfunction!(optimize_header, m)?)?;
    m.add_function(wrap_pyfunction!(describe, m)?)?;
    m.add_function(wrap_pyfunction!(check_extra_name, m)?)?;
    m.add_function(wrap_pyfunction!(container_head, m)?)?;
    m.add_function(wrap_pyfunction!(_bind, m)?)?;
    m.add_function(wrap_pyfunction!(_load_verified, m)?)?;
    Ok(())
}
