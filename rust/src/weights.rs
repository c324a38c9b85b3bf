//! Weights: the storage table, checked once at load, and tensors that share memory with
//! the mapped file.
//!
//! Storages are 64-aligned, in bounds and disjoint; every tensor fits inside its storage.
//! The file is mapped copy-on-write (`MAP_PRIVATE`): pages stay shared between processes
//! until written, and a write never reaches the file.

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::Arc;

use memmap2::MmapMut;
use pyo3::prelude::*;

use crate::artifact;
use crate::container::{self, Layout, ALIGN};
use crate::dtype::DType;
use crate::error::Result;
use crate::schema::{WeightTensor, Weights};

/// A weight tensor that passed validation.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub strides: Vec<i64>,
    pub storage: usize,
    pub storage_offset: i64,
}

/// Validates the weight table against the data section; returns each tensor checked.
pub fn validate(weights: &Weights, layout: &Layout) -> Result<BTreeMap<String, Checked>> {
    let mut spans = Vec::with_capacity(weights.storages.len());
    for (i, s) in weights.storages.iter().enumerate() {
        let what = format!("weights.storages[{i}]");
        if s.offset % ALIGN != 0 {
            return Err(artifact!("{what}: offset {} is not {ALIGN}-byte aligned", s.offset));
        }
        let range = container::data_range(layout, s.offset, s.nbytes, &what)?;
        spans.push((range.start, range.end, i));
    }
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let ((_, a_end, a), (b_start, _, b)) = (pair[0], pair[1]);
        if b_start < a_end {
            return Err(artifact!("weights.storages[{a}] and weights.storages[{b}] overlap"));
        }
    }
    weights.tensors.iter().map(|(name, t)| Ok((name.clone(), check_tensor(name, t, weights)?))).collect()
}

fn check_tensor(name: &str, t: &WeightTensor, weights: &Weights) -> Result<Checked> {
    let what = format!("weights.tensors[{name:?}]");
    let dtype = DType::parse(&t.dtype).ok_or_else(|| artifact!("{what}: unsupported dtype {:?}", t.dtype))?;
    let storage = weights.storages.get(t.storage).ok_or_else(|| {
        artifact!("{what}: storage {} does not exist ({} storages)", t.storage, weights.storages.len())
    })?;
    if t.shape.len() != t.strides.len() {
        return Err(artifact!("{what}: {} dims in shape but {} strides", t.shape.len(), t.strides.len()));
    }
    if storage.nbytes % dtype.itemsize != 0 {
        return Err(artifact!(
            "{what}: storage {} of {} bytes is not a whole number of {} elements",
            t.storage,
            storage.nbytes,
            dtype.name
        ));
    }
    if t.shape.iter().any(|&d| d < 0) || t.strides.iter().any(|&s| s < 0) || t.storage_offset < 0 {
        return Err(artifact!("{what}: negative size, stride or offset"));
    }
    // The furthest element, in elements: offset + sum((size - 1) * stride); none if empty.
    let overflow = || artifact!("{what}: shape {:?} and strides {:?} overflow", t.shape, t.strides);
    let extent = if t.shape.contains(&0) {
        0
    } else {
        let mut last = t.storage_offset as u64;
        for (&size, &stride) in t.shape.iter().zip(&t.strides) {
            let step = (size as u64 - 1).checked_mul(stride as u64).ok_or_else(overflow)?;
            last = last.checked_add(step).ok_or_else(overflow)?;
        }
        last.checked_add(1).ok_or_else(overflow)?
    };
    let needed = extent.checked_mul(dtype.itemsize).ok_or_else(overflow)?;
    if needed > storage.nbytes {
        return Err(artifact!("{what}: needs {needed} bytes of storage {} but it has {}", t.storage, storage.nbytes));
    }
    Ok(Checked {
        dtype,
        shape: t.shape.clone(),
        strides: t.strides.clone(),
        storage: t.storage,
        storage_offset: t.storage_offset,
    })
}

/// The mapped data section, exposed to torch through the buffer protocol.
#[pyclass(frozen, module = "kwexport._rt")]
pub struct MappedData {
    map: Arc<MmapMut>,
    start: usize,
    len: usize,
}

impl MappedData {
    pub fn new(map: Arc<MmapMut>, layout: &Layout) -> Self {
        MappedData { map, start: layout.data.start, len: layout.data.end - layout.data.start }
    }
}

#[pymethods]
impl MappedData {
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut pyo3::ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let me = slf.get();
        // The map is private and copy-on-write, so handing out a writable view never
        // touches the file; torch wants a writable buffer to avoid a warning.
        let ptr = me.map.as_ptr().add(me.start) as *mut std::ffi::c_void;
        if pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr, me.len as isize, 0, flags) != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
}

/// Builds one torch tensor per checked weight, all views of the mapped data section.
pub fn materialize<'py>(
    py: Python<'py>,
    torch: &Bound<'py, PyModule>,
    data: Bound<'py, MappedData>,
    weights: &Weights,
    checked: &BTreeMap<String, Checked>,
) -> PyResult<BTreeMap<String, Py<PyAny>>> {
    if checked.is_empty() {
        return Ok(BTreeMap::new());
    }
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("dtype", torch.getattr("uint8")?)?;
    let all = torch.getattr("frombuffer")?.call((data,), Some(&kwargs))?;
    let mut out = BTreeMap::new();
    for (name, t) in checked {
        let s = weights.storages[t.storage];
        let bytes = all.call_method1("narrow", (0, s.offset, s.nbytes))?;
        let typed = bytes.call_method1("view", (torch.getattr(t.dtype.name)?,))?;
        let base = (s.offset / t.dtype.itemsize) as i64;
        let tensor = typed.call_method1("as_strided", (t.shape.clone(), t.strides.clone(), base + t.storage_offset))?;
        out.insert(name.clone(), tensor.unbind());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Storage;

    fn layout(data_len: usize) -> Layout {
        Layout { header: 16..20, data: 64..64 + data_len }
    }

    fn weights(storages: Vec<(u64, u64)>, t: WeightTensor) -> Weights {
        Weights {
            storages: storages.into_iter().map(|(offset, nbytes)| Storage { offset, nbytes }).collect(),
            tensors: [("w".to_owned(), t)].into(),
        }
    }

    fn t(shape: Vec<i64>, strides: Vec<i64>, storage_offset: i64) -> WeightTensor {
        WeightTensor { dtype: "float32".into(), shape, strides, storage: 0, storage_offset }
    }

    #[test]
    fn accepts_views_within_storage() {
        let w = weights(vec![(0, 48)], t(vec![3, 2], vec![1, 3], 6));
        assert!(validate(&w, &layout(64)).is_ok());
        let w = weights(vec![(0, 0)], t(vec![0, 5], vec![5, 1], 0));
        assert!(validate(&w, &layout(0)).is_ok());
    }

    #[test]
    fn rejects_out_of_bounds_and_overlap() {
        let msg = |w: Weights, n| validate(&w, &layout(n)).unwrap_err().to_string();
        assert!(msg(weights(vec![(0, 48)], t(vec![3, 4], vec![4, 1], 1)), 64).contains("needs 52 bytes"));
        assert!(msg(weights(vec![(64, 48)], t(vec![1], vec![1], 0)), 64).contains("outside"));
        assert!(msg(weights(vec![(3, 4)], t(vec![1], vec![1], 0)), 64).contains("aligned"));
        assert!(msg(weights(vec![(0, 128), (64, 64)], t(vec![1], vec![1], 0)), 256).contains("overlap"));
        assert!(msg(weights(vec![(0, 8)], t(vec![i64::MAX, 2], vec![i64::MAX, 1], 0)), 64).contains("overflow"));
        assert!(msg(weights(vec![(0, 8)], t(vec![-1], vec![1], 0)), 64).contains("negative"));
        let mut bad = t(vec![1], vec![1], 0);
        bad.storage = 5;
        assert!(msg(weights(vec![(0, 8)], bad), 64).contains("does not exist"));
    }
}
