//! kwexport's runtime: loads a kwexport file, validates it, and calls it like the original
//! Python function. The file layout mirrors the architecture:
//!
//! - `container`  the file's sections (magic, header length, header, data)
//! - `schema`     the header's JSON types
//! - `upgrade`    format versions and the upgraders between them
//! - `treespec`   nested-structure specs: validation, flattening, rebuilding
//! - `signature`  binding a call to the saved signature, as CPython does
//! - `checks`     per-leaf input checks: dtype, device, shape, symbols, constants
//! - `graph`      graph validation into value slots, with last-use frees
//! - `opschema`   op-schema drift between torch versions, and op upgraders
//! - `weights`    the storage table and zero-copy tensors over the mapped file
//! - `plan`       the execution plan: ops resolved once, run as a flat loop
//! - `abi`        torch's stable C ABI, resolved at run time from the loaded libtorch
//! - `dispatch`   nodes compiled for that ABI and run without Python
//! - `program`    the `Program` Python class: load and call
//! - `error`      the error taxonomy and its Python exception classes

pub mod abi;
pub mod checks;
pub mod container;
pub mod dispatch;
pub mod dtype;
pub mod error;
pub mod graph;
pub mod opschema;
pub mod plan;
pub mod program;
pub mod schema;
pub mod signature;
pub mod treespec;
pub mod upgrade;
pub mod weights;

use pyo3::prelude::*;

/// Loads a kwexport file and returns a callable `Program`. `allow_ops` names custom op
/// namespaces or ops (`"mylib::*"`) the file may call beyond torch's own. `dispatch` is
/// `"auto"` (torch's stable C ABI where it covers a node and pays off), `"abi"` (wherever it
/// covers a node) or `"python"` (torch's Python op objects throughout).
#[pyfunction]
#[pyo3(signature = (path, *, allow_ops = Vec::new(), dispatch = "auto"))]
fn load(
    py: Python<'_>,
    path: std::path::PathBuf,
    allow_ops: Vec<String>,
    dispatch: &str,
) -> PyResult<program::Program> {
    let path = path.to_str().ok_or_else(|| pyo3::exceptions::PyValueError::new_err("path is not valid UTF-8"))?;
    let allow = plan::AllowOps::parse(&allow_ops).map_err(pyo3::exceptions::PyValueError::new_err)?;
    let dispatch = plan::Dispatch::parse(dispatch).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!("dispatch must be 'auto', 'abi' or 'python', not '{dispatch}'"))
    })?;
    program::load(py, path, &allow, allow_ops, dispatch)
}

/// Unpickles a `Program`: loads `path` and checks that its content hash is `digest`.
#[pyfunction]
fn _load_verified(
    py: Python<'_>,
    path: std::path::PathBuf,
    digest: &str,
    allow_ops: Vec<String>,
    dispatch: &str,
) -> PyResult<program::Program> {
    let prog = load(py, path.clone(), allow_ops, dispatch)?;
    if prog.digest(py) != digest {
        return Err(error::Error::Artifact(format!(
            "file: {} changed since the program was pickled (sha256 {}, expected {digest})",
            path.display(),
            prog.digest(py)
        ))
        .into());
    }
    Ok(prog)
}

/// Validates a file without running anything and describes it, for the command line:
/// a dict with the header (as JSON, brought to the current format), the file's own format
/// version, the upgraders that ran, each input leaf's path and the data section's offset.
#[pyfunction]
fn describe(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let bytes = std::fs::read(&path)?;
    let d = py.detach(|| program::describe_file(&bytes))?;
    let out = pyo3::types::PyDict::new(py);
    let header = serde_json::to_string(&d.document).map_err(|e| error::Error::Artifact(format!("header: {e}")))?;
    out.set_item("header", header)?;
    out.set_item("file_format_version", (d.file_format_version.major, d.file_format_version.minor))?;
    out.set_item("upgraders", d.upgraders)?;
    out.set_item("leaf_paths", d.leaf_paths)?;
    out.set_item("data_offset", d.data.start)?;
    Ok(out)
}

/// The binder alone, for property tests against `inspect.Signature.bind`: binds a call
/// with `n_args` positionals and these keyword names to a signature given as its JSON.
/// Returns, per parameter, `("positional", i)`, `("keyword", name)`, `("default",)`,
/// `("var_positional", start, stop)` or `("var_keyword", [names])`.
#[pyfunction]
fn _bind<'py>(
    py: Python<'py>,
    signature_json: &str,
    n_args: usize,
    keywords: Vec<String>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    use pyo3::IntoPyObjectExt;
    use signature::{Bound as B, Source};
    let raw: schema::Signature =
        serde_json::from_str(signature_json).map_err(|e| error::Error::Artifact(format!("signature: {e}")))?;
    let sig = signature::Signature::new(&raw)?;
    sig.bind(n_args, &keywords)?
        .into_iter()
        .map(|b| match b {
            B::One(Source::Positional(i)) => ("positional", i).into_bound_py_any(py),
            B::One(Source::Keyword(k)) => ("keyword", keywords[k].clone()).into_bound_py_any(py),
            B::One(Source::Default) => ("default",).into_bound_py_any(py),
            B::VarPositional(r) => ("var_positional", r.start, r.end).into_bound_py_any(py),
            B::VarKeyword(ks) => {
                ("var_keyword", ks.into_iter().map(|k| keywords[k].clone()).collect::<Vec<_>>()).into_bound_py_any(py)
            }
        })
        .collect()
}

#[pymodule]
fn _rt(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // A broken upgrader chain is a build defect: refuse to import rather than misread files.
    upgrade::validate_chain(upgrade::UPGRADERS, upgrade::OLDEST, upgrade::CURRENT)
        .map_err(|e| pyo3::exceptions::PyImportError::new_err(format!("kwexport: invalid upgrader chain: {e}")))?;
    let c = error::classes(py);
    m.add("KwexportError", c.base.bind(py))?;
    m.add("ArtifactError", c.artifact.bind(py))?;
    m.add("VersionError", c.version.bind(py))?;
    m.add("SignatureError", c.signature.bind(py))?;
    m.add("InputError", c.input.bind(py))?;
    m.add("FORMAT_VERSION", (upgrade::CURRENT.major, upgrade::CURRENT.minor))?;
    m.add("OLDEST_FORMAT_VERSION", (upgrade::OLDEST.major, upgrade::OLDEST.minor))?;
    let released: Vec<(u32, u32)> = upgrade::released().iter().map(|v| (v.major, v.minor)).collect();
    m.add("RELEASED_FORMAT_VERSIONS", released)?;
    m.add_class::<program::Program>()?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(describe, m)?)?;
    m.add_function(wrap_pyfunction!(_bind, m)?)?;
    m.add_function(wrap_pyfunction!(_load_verified, m)?)?;
    Ok(())
}
