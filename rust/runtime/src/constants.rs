//! The file's constants and literals as the Python objects they stand for: parameter
//! defaults and specialized inputs (call path), node literals (plan). Names of dtypes,
//! layouts and memory formats are checked against the core's tables before `torch` is asked.

use kwexport_core::schema::{Arg, Constant};
use kwexport_core::tables::{DType, LAYOUTS, MEMORY_FORMATS};
use kwexport_core::Error;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use crate::errors::{RtError, RtResult};

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

/// A node literal (anything but a reference or a list) as a Python object; `entry` names
/// the node for errors.
pub fn literal_to_py(py: Python<'_>, torch: &Bound<'_, PyModule>, lit: &Arg, entry: &str) -> RtResult<Py<PyAny>> {
    let named = |allowed: &[&str], name: &str, kind: &'static str| -> RtResult<Py<PyAny>> {
        if allowed.contains(&name) {
            Ok(torch.getattr(name)?.unbind())
        } else {
            Err(Error::UnknownEnum { entry: entry.to_owned(), kind, name: name.to_owned() }.into())
        }
    };
    Ok(match lit {
        Arg::None(()) => py.None(),
        Arg::Bool(b) => b.into_pyobject(py)?.to_owned().into_any().unbind(),
        Arg::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        Arg::Float(f) => f.0.into_pyobject(py)?.into_any().unbind(),
        Arg::Str(s) => PyString::new(py, s).into_any().unbind(),
        Arg::Dtype(d) => match DType::parse(d) {
            Some(dt) => torch.getattr(dt.name)?.unbind(),
            None => return Err(Error::UnsupportedDtype { entry: entry.to_owned(), dtype: d.clone() }.into()),
        },
        Arg::Device(d) => device(torch, d, entry)?.unbind(),
        Arg::Layout(l) => return named(LAYOUTS, l, "layout"),
        Arg::MemoryFormat(m) => return named(MEMORY_FORMATS, m, "memory format"),
        Arg::Ref(_) | Arg::List(_) | Arg::Subgraph(_) => {
            return Err(RtError::Internal(format!("{entry}: a reference, list or subgraph reached literal_to_py")))
        }
    })
}

/// `torch.device(text)`, or an `InvalidDevice` error naming `entry`.
pub fn device<'py>(torch: &Bound<'py, PyModule>, text: &str, entry: &str) -> RtResult<Bound<'py, PyAny>> {
    torch
        .getattr("device")?
        .call1((text,))
        .map_err(|_| Error::InvalidDevice { entry: entry.to_owned(), device: text.to_owned() }.into())
}
