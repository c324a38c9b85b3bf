//! Input checks on Python values: each leaf's type, dtype, device and specialized value,
//! with its shape handed to the core's [`Checker`]. Everything a check compares against is
//! made once at load.

use kwexport_core::checks::{Checker, DimCheck};
use kwexport_core::schema::LeafSpec;
use kwexport_core::tables::DType;
use kwexport_core::Error;
use pyo3::prelude::*;

use crate::constants::{constant_to_py, device};
use crate::device::Placement;
use crate::errors::{RtError, RtResult};
use crate::tree::describe;

/// A leaf's check with its Python objects resolved at load.
pub enum LeafCheck {
    /// A tensor of this dtype and device, of these dims.
    Tensor {
        /// `torch.<dtype>`.
        dtype: Py<PyAny>,
        /// Its name, for messages.
        dtype_name: &'static str,
        /// `torch.device(...)`.
        device: Py<PyAny>,
        /// Its text, for messages.
        device_name: String,
        /// The shape checks.
        dims: Vec<DimCheck>,
    },
    /// This exact value (torch.export specialized it).
    Constant {
        /// The value.
        value: Py<PyAny>,
        /// Its `repr`, for messages.
        repr: String,
    },
}

impl LeafCheck {
    /// The check of input leaf `index`, whose shape checks the core validated.
    pub fn new(
        py: Python<'_>,
        torch: &Bound<'_, PyModule>,
        spec: &LeafSpec,
        dims: Option<&Vec<DimCheck>>,
        index: usize,
        placement: &Placement,
    ) -> RtResult<Self> {
        let entry = format!("inputs.leaves[{index}]");
        Ok(match (spec, dims) {
            (LeafSpec::Tensor(t), Some(dims)) => {
                let dt = DType::parse(&t.dtype)
                    .ok_or_else(|| Error::UnsupportedDtype { entry: entry.clone(), dtype: t.dtype.clone() })?;
                let device = device(torch, placement.place(&t.device), &entry)?;
                LeafCheck::Tensor {
                    dtype: torch.getattr(dt.name)?.unbind(),
                    dtype_name: dt.name,
                    device_name: device.str()?.to_string(),
                    device: device.unbind(),
                    dims: dims.clone(),
                }
            }
            (LeafSpec::Constant(c), None) => {
                let value = constant_to_py(py, c)?;
                let repr = value.bind(py).repr()?.to_string();
                LeafCheck::Constant { value, repr }
            }
            _ => return Err(RtError::Internal(format!("{entry}: shape checks don't match the leaf's kind"))),
        })
    }

    /// Checks `obj`, leaf `leaf` of a call.
    pub fn check(
        &self,
        obj: &Bound<'_, PyAny>,
        tensor_type: &Bound<'_, PyAny>,
        leaf: usize,
        checker: &mut Checker<'_>,
    ) -> Result<(), Error> {
        let path = || checker.leaf_path(leaf).to_owned();
        let mismatch = |expected: String, got: String| Error::Mismatch { path: path(), expected, got };
        let unreadable = |e: PyErr| Error::Unreadable { path: path(), message: e.to_string() };
        match self {
            LeafCheck::Tensor { dtype, dtype_name, device, device_name, dims } => {
                if !obj.is_instance(tensor_type).unwrap_or(false) {
                    return Err(mismatch(format!("a tensor of dtype torch.{dtype_name}"), describe(obj)));
                }
                let got = obj.getattr(pyo3::intern!(obj.py(), "dtype")).map_err(unreadable)?;
                if !got.is(dtype.bind(obj.py())) {
                    return Err(mismatch(format!("dtype torch.{dtype_name}"), got.to_string()));
                }
                let got = obj.getattr(pyo3::intern!(obj.py(), "device")).map_err(unreadable)?;
                if !got.eq(device.bind(obj.py())).map_err(unreadable)? {
                    return Err(mismatch(format!("a tensor on {device_name}"), format!("one on {got}")));
                }
                let shape: Vec<i64> =
                    obj.getattr(pyo3::intern!(obj.py(), "shape")).and_then(|s| s.extract()).map_err(unreadable)?;
                checker.shape(dims, &shape, leaf)
            }
            LeafCheck::Constant { value, repr } => {
                let value = value.bind(obj.py());
                if obj.get_type().is(value.get_type()) && obj.eq(value).unwrap_or(false) {
                    Ok(())
                } else {
                    let got = obj.repr().map(|r| r.to_string()).unwrap_or_else(|_| describe(obj));
                    Err(mismatch(format!("{repr} (specialized at export)"), got))
                }
            }
        }
    }
}
