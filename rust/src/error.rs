//! The error taxonomy. Rust code returns `Error`; the PyO3 layer maps each variant to
//! its Python class (see `lib.rs`), so every failure reaches the user typed and worded.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The file is malformed, corrupt, unsafe or unsupported. Names the field or entry.
    Artifact(String),
    /// The file's format version is one this runtime cannot read.
    Version(String),
    /// The call cannot bind to the signature (worded as CPython words it).
    Signature(String),
    /// The call binds, but its inputs don't match the export. Names the argument path.
    Input(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Artifact(m) | Error::Version(m) | Error::Signature(m) | Error::Input(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

/// `artifact!("graph.nodes[{}]: ...", i)` builds an `Error::Artifact`.
#[macro_export]
macro_rules! artifact {
    ($($t:tt)*) => { $crate::error::Error::Artifact(format!($($t)*)) };
}

/// `input!(...)` builds an `Error::Input`.
#[macro_export]
macro_rules! input_err {
    ($($t:tt)*) => { $crate::error::Error::Input(format!($($t)*)) };
}

// ---------------------------------------------------------------- Python classes

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// The exception classes, created once when `kwexport._rt` is imported.
pub struct Classes {
    pub base: Py<PyType>,
    pub artifact: Py<PyType>,
    pub version: Py<PyType>,
    pub signature: Py<PyType>,
    pub input: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

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
    let exc = py.get_type::<pyo3::exceptions::PyException>().into_any();
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

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        Python::attach(|py| {
            let c = classes(py);
            let (ty, msg) = match e {
                Error::Artifact(m) => (&c.artifact, m),
                Error::Version(m) => (&c.version, m),
                Error::Signature(m) => (&c.signature, m),
                Error::Input(m) => (&c.input, m),
            };
            PyErr::from_type(ty.bind(py).clone(), msg)
        })
    }
}
