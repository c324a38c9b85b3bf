//! Input checks on Python values: each leaf's type, dtype, device and specialized value,
//! with its shape handed to the core's [`Checker`], and where a tensor's elements live.
//! Everything a check compares against is made once at load.
//!
//! A plain tensor must be strided and its storage must hold its view: kernels trust both, and
//! a tensor whose storage was resized under it crashes eager. A tensor subclass is checked
//! by the sizes torch holds for it (not a `.shape` it may override) and makes the call run
//! through torch's Python ops, where its `__torch_dispatch__` and `__torch_function__` act as
//! in eager; the C path would hand its bare wrapper to kernels.

use kwexport_core::checks::{Checker, DimCheck};
use kwexport_core::schema::LeafSpec;
use kwexport_core::tables::DType;
use kwexport_core::Error;
use pyo3::prelude::*;

use crate::abi::{Abi, Storage};
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
        /// Bytes per element, for the storage check.
        itemsize: i64,
        /// The dtype's and the device's codes in torch's C ABI, where it has the queries:
        /// a plain tensor is then checked without asking Python for anything.
        codes: Option<(i32, (i32, i32))>,
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
                let device_name = device.str()?.to_string();
                let abi = Abi::get(py).filter(|a| a.can_query_storage());
                let codes = abi.and_then(|a| Some((a.dtype_code(dt.name)?, a.device_code(&device_name)?)));
                LeafCheck::Tensor {
                    dtype: torch.getattr(dt.name)?.unbind(),
                    dtype_name: dt.name,
                    device_name,
                    device: device.unbind(),
                    dims: dims.clone(),
                    itemsize: dt.itemsize as i64,
                    codes,
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

    /// Checks `obj`, leaf `leaf` of a call, and says what it was; a plain tensor's handle,
    /// where the checks made one, goes to `handle`.
    pub fn check(
        &self,
        obj: &Bound<'_, PyAny>,
        types: &TensorTypes,
        leaf: usize,
        checker: &mut Checker<'_>,
        handle: &mut Option<crate::abi::Tensor>,
    ) -> Result<Seen, Error> {
        let paths = checker.leaf_paths();
        let path = || paths[leaf].clone();
        let mismatch = |expected: String, got: String| Error::Mismatch { path: path(), expected, got };
        let unreadable = |e: PyErr| Error::Unreadable { path: path(), message: e.to_string() };
        let py = obj.py();
        match self {
            LeafCheck::Tensor { dtype, dtype_name, device, device_name, dims, itemsize, codes } => {
                let ty = obj.get_type();
                let plain = ty.is(types.tensor.bind(py)) || ty.is(types.parameter.bind(py));
                // A plain tensor through torch's C queries alone (a quarter of a small call's
                // time went to reading `.dtype`, `.device` and `.shape` from Python); anything
                // that doesn't match, or can't be read so, takes the Python checks below, which
                // say what is wrong.
                if let (true, Some(codes), Some(abi)) = (plain, codes, types.abi) {
                    if let Ok(h) = abi.handle_of(obj) {
                        if let Some((_, _, sizes)) = abi.tensor_meta(&h).filter(|(d, v, _)| (*d, *v) == *codes) {
                            checker.shape(dims, &sizes, leaf)?;
                            if abi.storage(&h, &sizes, *itemsize) == Some(Storage::Fits) {
                                *handle = Some(h);
                                return Ok(Seen::Tensor);
                            }
                        }
                    }
                }
                if !plain && !obj.is_instance(types.tensor.bind(py)).unwrap_or(false) {
                    return Err(mismatch(format!("a tensor of dtype torch.{dtype_name}"), describe(obj)));
                }
                let got = obj.getattr(pyo3::intern!(py, "dtype")).map_err(unreadable)?;
                if !got.is(dtype.bind(py)) {
                    return Err(mismatch(format!("dtype torch.{dtype_name}"), got.to_string()));
                }
                let got = obj.getattr(pyo3::intern!(py, "device")).map_err(unreadable)?;
                if !got.eq(device.bind(py)).map_err(unreadable)? {
                    return Err(mismatch(format!("a tensor on {device_name}"), format!("one on {got}")));
                }
                // Only asked where needed: a nested tensor's `.shape` raises.
                let nested =
                    || obj.getattr(pyo3::intern!(py, "is_nested")).and_then(|v| v.is_truthy()).unwrap_or(false);
                let not_nested = || mismatch("a strided tensor".into(), "a nested tensor".into());
                if plain {
                    let shape: Vec<i64> = match obj.getattr(pyo3::intern!(py, "shape")).and_then(|s| s.extract()) {
                        Ok(shape) => shape,
                        Err(_) if nested() => return Err(not_nested()),
                        Err(e) => return Err(unreadable(e)),
                    };
                    checker.shape(dims, &shape, leaf)?;
                    return match types.storage(obj, &shape, *itemsize, handle).map_err(unreadable)? {
                        Storage::Fits => Ok(Seen::Tensor),
                        Storage::NotStrided => {
                            let layout = layout_name(obj);
                            Err(mismatch("a strided tensor".into(), format!("a {layout} tensor")))
                        }
                        Storage::TooSmall { needs, has } => Err(mismatch(
                            format!("a tensor whose storage holds its view ({needs} bytes)"),
                            format!("a storage of {has} bytes"),
                        )),
                    };
                }
                if nested() {
                    return Err(not_nested());
                }
                // torch's own sizes, whatever the subclass's `.shape` says.
                let size =
                    types.size.bind(py).call1((obj,)).and_then(|s| s.extract::<Vec<i64>>()).map_err(unreadable)?;
                let shape = obj.getattr(pyo3::intern!(py, "shape")).and_then(|s| s.extract::<Vec<i64>>());
                if shape.as_ref().is_ok_and(|s| *s != size) || shape.is_err() {
                    let said = shape.map(|s| format!("{s:?}")).unwrap_or_else(|e| format!("an error ({e})"));
                    let name = ty.name().map(|n| n.to_string()).unwrap_or_default();
                    return Err(mismatch(
                        format!("a tensor whose .shape is its size {size:?}"),
                        format!("a {name} whose .shape is {said}"),
                    ));
                }
                checker.shape(dims, &size, leaf)?;
                Ok(Seen::Subclass)
            }
            LeafCheck::Constant { value, repr } => {
                let value = value.bind(py);
                if obj.get_type().is(value.get_type()) && obj.eq(value).unwrap_or(false) {
                    Ok(Seen::Value)
                } else {
                    let got = obj.repr().map(|r| r.to_string()).unwrap_or_else(|_| describe(obj));
                    Err(mismatch(format!("{repr} (specialized at export)"), got))
                }
            }
        }
    }
}

/// What a leaf of a call was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// A value torch.export specialized.
    Value,
    /// A `torch.Tensor` or `nn.Parameter`.
    Tensor,
    /// A tensor subclass: the call runs through torch's Python ops.
    Subclass,
}

/// The tensor classes and queries the checks use, resolved at load.
pub struct TensorTypes {
    tensor: Py<PyAny>,
    parameter: Py<PyAny>,
    /// `torch.Tensor.size`, unbound: a subclass's sizes as torch holds them.
    size: Py<PyAny>,
    abi: Option<&'static Abi>,
}

impl TensorTypes {
    pub fn new(torch: &Bound<'_, PyModule>) -> PyResult<Self> {
        let tensor = torch.getattr("Tensor")?;
        Ok(TensorTypes {
            size: tensor.getattr("size")?.unbind(),
            tensor: tensor.unbind(),
            parameter: torch.getattr("nn")?.getattr("Parameter")?.unbind(),
            abi: Abi::get(torch.py()).filter(|a| a.can_query_storage()),
        })
    }

    /// Where a plain tensor's elements live: through torch's C queries where it has them,
    /// else through Python.
    fn storage(
        &self,
        obj: &Bound<'_, PyAny>,
        shape: &[i64],
        itemsize: i64,
        handle: &mut Option<crate::abi::Tensor>,
    ) -> PyResult<Storage> {
        if let Some(abi) = self.abi {
            let h = abi.handle_of(obj)?;
            if let Some(s) = abi.storage(&h, shape, itemsize) {
                *handle = Some(h);
                return Ok(s);
            }
        }
        let py = obj.py();
        let layout = obj.getattr(pyo3::intern!(py, "layout"))?;
        if layout.str()?.to_str()? != "torch.strided" {
            return Ok(Storage::NotStrided);
        }
        let nbytes: i64 = obj.call_method0("untyped_storage")?.call_method0("nbytes")?.extract()?;
        let offset: i64 = obj.call_method0("storage_offset")?.extract()?;
        let strides: Vec<i64> = obj.call_method0("stride")?.extract()?;
        Ok(crate::abi::storage_fits(shape, &strides, offset, itemsize, nbytes))
    }
}

/// A tensor's layout as torch names it (`sparse_coo`), for messages.
fn layout_name(obj: &Bound<'_, PyAny>) -> String {
    obj.getattr(pyo3::intern!(obj.py(), "layout"))
        .and_then(|l| l.str().map(|s| s.to_string()))
        .map(|s| s.trim_start_matches("torch.").to_owned())
        .unwrap_or_else(|_| "non-strided".into())
}
