//! Errors on the load and call paths, and kwexport's Python exception classes.
//!
//! One type, [`RtError`], carries whatever can go wrong: a kwexport error (a bad file, a
//! call that doesn't bind, inputs that don't match), a Python exception raised by torch or by
//! a value the caller passed, an op that failed on the C path, or a broken invariant of
//! kwexport itself. `?` works across all of them; each reaches Python as its own class.

use kwexport_core::{Error, ErrorKind};
use pyo3::exceptions::{PyException, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// Anything that can fail while loading or calling a program.
#[derive(Debug)]
pub enum RtError {
    /// The file, the call's binding or its values: a kwexport exception class. Boxed so
    /// that the call path's `Result`s stay small; errors are the rare case.
    Kwexport(Box<Error>),
    /// A Python exception, passed through as raised.
    Python(PyErr),
    /// An op that failed on the C path: `RuntimeError("<op>: <torch's message>")`.
    Op {
        /// `aten::index_select` (with `.overload` unless it is `default`).
        op: String,
        /// torch's message, without its backtrace.
        message: String,
    },
    /// kwexport broke one of its own invariants: a bug, never the file's fault.
    Internal(String),
}

/// `Result` on the load and call paths.
pub type RtResult<T> = Result<T, RtError>;

impl From<Error> for RtError {
    fn from(e: Error) -> Self {
        RtError::Kwexport(Box::new(e))
    }
}

impl From<PyErr> for RtError {
    fn from(e: PyErr) -> Self {
        RtError::Python(e)
    }
}

impl From<std::convert::Infallible> for RtError {
    fn from(e: std::convert::Infallible) -> Self {
        match e {}
    }
}

impl From<pyo3::CastIntoError<'_>> for RtError {
    fn from(e: pyo3::CastIntoError<'_>) -> Self {
        RtError::Python(e.into())
    }
}

impl From<std::io::Error> for RtError {
    fn from(e: std::io::Error) -> Self {
        RtError::Python(e.into())
    }
}

impl From<RtError> for PyErr {
    fn from(e: RtError) -> PyErr {
        match e {
            RtError::Kwexport(e) => e.into_py_err(),
            RtError::Python(e) => e,
            RtError::Op { op, message } => PyRuntimeError::new_err(format!("{op}: {message}")),
            RtError::Internal(what) => {
                PyRuntimeError::new_err(format!("kwexport internal error, please report: {what}"))
            }
        }
    }
}

/// The core's graph passes at `level` for `target`, a panic in one of them (a kwexport bug)
/// an internal error naming it rather than an exception no `except Exception` catches: a
/// pass found readers that no longer matched its graph on every quantized ResNet once.
pub fn apply_passes(
    doc: &mut kwexport_core::schema::Document,
    level: kwexport_core::passes::Level,
    target: kwexport_core::passes::Target,
) -> RtResult<kwexport_core::passes::Rewrites> {
    let skip = skipped_passes()?;
    let applied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        kwexport_core::passes::apply_except(doc, level, target, &skip)
    }));
    applied.map_err(|panic| {
        let what = (panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        RtError::Internal(format!("a graph pass failed: {what}"))
    })
}

/// The passes `KWEXPORT_SKIP_PASSES` names (comma-separated), read at every load so that a
/// benchmark can load one file with and without a pass; a name no pass has is an error, not
/// a measurement of nothing.
fn skipped_passes() -> RtResult<Vec<String>> {
    let Ok(names) = std::env::var("KWEXPORT_SKIP_PASSES") else { return Ok(Vec::new()) };
    // `fast` runs every level's passes.
    let known: Vec<&str> =
        kwexport_core::passes::registered(kwexport_core::passes::Level::Fast).iter().map(|p| p.name()).collect();
    let names: Vec<String> = names.split(',').map(str::trim).filter(|n| !n.is_empty()).map(str::to_owned).collect();
    match names.iter().find(|n| !known.contains(&n.as_str())) {
        Some(n) => Err(PyValueError::new_err(format!(
            "KWEXPORT_SKIP_PASSES: no pass is named {n:?} (passes: {})",
            known.join(", ")
        ))
        .into()),
        None => Ok(names),
    }
}

/// Turning a core error into its Python exception.
pub trait IntoPyErr {
    /// The exception of the error's class, with its message.
    fn into_py_err(self) -> PyErr;
}

impl IntoPyErr for Error {
    fn into_py_err(self) -> PyErr {
        Python::attach(|py| {
            let c = classes(py);
            let ty = match self.kind() {
                ErrorKind::Artifact => &c.artifact,
                ErrorKind::Version => &c.version,
                ErrorKind::Signature => &c.signature,
                ErrorKind::Input => &c.input,
            };
            PyErr::from_type(ty.bind(py).clone(), self.to_string())
        })
    }
}

/// The exception classes, created once when `kwexport._rt` is imported.
pub struct Classes {
    /// `KwexportError(Exception)`.
    pub base: Py<PyType>,
    /// `ArtifactError(KwexportError, ValueError)`.
    pub artifact: Py<PyType>,
    /// `VersionError(ArtifactError)`.
    pub version: Py<PyType>,
    /// `SignatureError(KwexportError, TypeError)`.
    pub signature: Py<PyType>,
    /// `InputError(KwexportError, ValueError)`.
    pub input: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

/// kwexport's exception classes.
pub fn classes(py: Python<'_>) -> &Classes {
    CLASSES.get_or_init(py, || make_classes(py).expect("creating kwexport's exception classes"))
}

/// Python's `type(name, bases, ns)`: PyO3's `create_exception!` allows only one base, and
/// `ArtifactError` is both a `KwexportError` and a `ValueError`.
fn make_classes(py: Python<'_>) -> PyResult<Classes> {
    let make = |name: &str, bases: Vec<Bound<'_, PyAny>>, doc: &str| -> PyResult<Py<PyType>> {
        let ns = PyDict::new(py);
        ns.set_item("__module__", "kwexport")?;
        ns.set_item("__doc__", doc)?;
        let ty = py.get_type::<PyType>().call1((name, PyTuple::new(py, bases)?, ns))?;
        Ok(ty.cast_into::<PyType>()?.unbind())
    };
    let exc = py.get_type::<PyException>().into_any();
    let base = make("KwexportError", vec![exc], "Base class of every error kwexport raises.")?;
    let value_error = py.get_type::<PyValueError>().into_any();
    let type_error = py.get_type::<PyTypeError>().into_any();
    let artifact = make(
        "ArtifactError",
        vec![base.bind(py).clone().into_any(), value_error.clone()],
        "A file that is malformed, corrupt, unsafe or unsupported.",
    )?;
    let version = make(
        "VersionError",
        vec![artifact.bind(py).clone().into_any()],
        "A file whose format version this runtime cannot read.",
    )?;
    let signature = make(
        "SignatureError",
        vec![base.bind(py).clone().into_any(), type_error],
        "A call that cannot bind to the saved signature.",
    )?;
    let input = make(
        "InputError",
        vec![base.bind(py).clone().into_any(), value_error],
        "Inputs that bind but don't match what was exported.",
    )?;
    Ok(Classes { base, artifact, version, signature, input })
}
