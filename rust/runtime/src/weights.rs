//! Weights as torch tensors that share memory with the mapped file: no copy, ever.
//!
//! The file is mapped copy-on-write (`MAP_PRIVATE`): pages stay shared between processes
//! until written, and a write never reaches the file.

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::Arc;

use kwexport_core::container::Layout;
use kwexport_core::graph::OpName;
use kwexport_core::passes::batch_norm::Fold;
use kwexport_core::schema::Weights;
use kwexport_core::weights::CheckedWeight;
use memmap2::MmapMut;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::abi::Abi;
use crate::errors::{RtError, RtResult};

/// The mapped data section, exposed to torch through the buffer protocol.
#[pyclass(frozen, module = "kwexport._rt")]
pub struct MappedData {
    map: Arc<MmapMut>,
    start: usize,
    len: usize,
}

impl MappedData {
    /// The data section of `map`.
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

/// The weights the program writes: each in memory the program owns, copied from the file
/// once at load, with the file's values kept (as views of the map) for `reset()`.
pub struct State {
    /// The weights' names, in the order mutations name them.
    pub names: Vec<String>,
    /// The program's own copies, which the plan reads and each call writes back into.
    pub tensors: Vec<Py<PyAny>>,
    /// The file's values: views of the mapped file, never written.
    pub initial: Vec<Py<PyAny>>,
}

/// Splits the weights into state the program writes (cloned into owned memory; `weights`
/// then holds the clones) and weights only read (left as views of the map).
pub fn take_state(
    py: Python<'_>,
    weights: &mut BTreeMap<String, Py<PyAny>>,
    mutable: impl Iterator<Item = String>,
) -> PyResult<State> {
    let mut state = State { names: Vec::new(), tensors: Vec::new(), initial: Vec::new() };
    for name in mutable {
        let view = weights[&name].clone_ref(py);
        let owned = view.bind(py).call_method0("clone")?.unbind();
        weights.insert(name.clone(), owned.clone_ref(py));
        state.names.push(name);
        state.tensors.push(owned);
        state.initial.push(view);
    }
    Ok(state)
}

/// Builds one torch tensor per checked weight, all sharing the mapped data section's memory.
/// With torch's C ABI each is made by one C call (`_reinterpret_tensor` on a typed view of the
/// whole section) and all become Python tensors in one pass; otherwise through Python.
pub fn materialize<'py>(
    py: Python<'py>,
    torch: &Bound<'py, PyModule>,
    data: Bound<'py, MappedData>,
    weights: &Weights,
    checked: &BTreeMap<String, CheckedWeight>,
) -> PyResult<BTreeMap<String, Py<PyAny>>> {
    if checked.is_empty() {
        return Ok(BTreeMap::new());
    }
    let len = data.get().len;
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("dtype", torch.getattr("uint8")?)?;
    let all = torch.getattr("frombuffer")?.call((data,), Some(&kwargs))?;
    // The whole section as each dtype the weights use (offsets are aligned to every itemsize).
    let mut typed: BTreeMap<&str, Bound<'py, PyAny>> = BTreeMap::new();
    for t in checked.values() {
        if !typed.contains_key(t.dtype.name) {
            let whole = all.call_method1("narrow", (0, 0, len - len % t.dtype.itemsize as usize))?;
            typed.insert(t.dtype.name, whole.call_method1("view", (torch.getattr(t.dtype.name)?,))?);
        }
    }
    // The typed views start where the section does, so offsets from them are offsets in it.
    let offset = |t: &CheckedWeight| (weights.storages[t.storage].offset / t.dtype.itemsize) as i64 + t.storage_offset;
    let mut out = BTreeMap::new();
    if let Some(abi) = Abi::get(py).filter(|a| a.can_reinterpret()) {
        let bases = typed.iter().map(|(k, v)| Ok((*k, abi.handle_of(v)?))).collect::<PyResult<BTreeMap<_, _>>>()?;
        let mut handles = Vec::with_capacity(checked.len());
        for t in checked.values() {
            let view = abi.reinterpret(&bases[t.dtype.name], &t.shape, &t.strides, offset(t));
            handles.push(view.map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(format!("{e:?}")))?);
        }
        for (name, tensor) in checked.keys().zip(abi.tensors_of(py, handles)?.iter()) {
            out.insert(name.clone(), tensor.unbind());
        }
        return Ok(out);
    }
    for (name, t) in checked {
        let tensor = typed[t.dtype.name].call_method1("as_strided", (t.shape.clone(), t.strides.clone(), offset(t)))?;
        out.insert(name.clone(), tensor.unbind());
    }
    Ok(out)
}

/// The weight arguments, by position and name, whose `requires_grad` decides the kernel of
/// a node's op: `at::matmul` folds a batched input into one `mm` only when the weight
/// requires grad (or the input's leading dimensions are contiguous), and runs an expanded
/// `bmm` otherwise, several times slower. `linear` reaches it through `weight.t()`; its
/// bias chooses nothing.
fn grad_sensitive_args(op: &OpName) -> &'static [(usize, &'static str)] {
    match (op.namespace.as_str(), op.name.as_str(), op.overload.as_deref()) {
        ("aten", "linear", Some("default")) => &[(1, "weight")],
        ("aten", "matmul", Some("default")) => &[(0, "self"), (1, "other")],
        _ => &[],
    }
}

/// Marks the read-only weights whose flag decides a kernel (see `grad_sensitive_args`) as
/// requiring grad, as `nn.Parameter`s are in eager, so that torch picks eager's kernels (and
/// its bits). The run loop turns grad mode off for calls with no input that requires grad,
/// so nothing records. Returns whether any weight was marked.
pub fn mark_grad_sensitive<'a>(
    py: Python<'_>,
    weights: &mut BTreeMap<String, Py<PyAny>>,
    state: &State,
    graphs: impl IntoIterator<Item = &'a kwexport_core::graph::SlotGraph>,
) -> PyResult<bool> {
    use kwexport_core::graph::{SlotArg, ValueRef};
    let mut marked = false;
    for graph in graphs {
        for node in &graph.nodes {
            for &(position, name) in grad_sensitive_args(&node.op_name) {
                let arg =
                    node.args.get(position).or_else(|| node.kwargs.iter().find(|(k, _)| k == name).map(|(_, a)| a));
                // State is written in place, which a tensor that requires grad refuses.
                if let Some(SlotArg::Value(ValueRef::Weight(w))) = arg {
                    if let (Some(t), false) = (weights.get_mut(w), state.names.contains(w)) {
                        // A view reports its base's flag, so a view (of the map) is detached first.
                        if !t.bind(py).getattr(intern!(py, "_base"))?.is_none() {
                            *t = t.bind(py).call_method0(intern!(py, "detach"))?.unbind();
                        }
                        t.bind(py).call_method1(intern!(py, "requires_grad_"), (true,))?;
                        marked = true;
                    }
                }
            }
        }
    }
    Ok(marked)
}

/// The core's batch-norm folds as `kwexport._passes` reads them: one dict per fold.
pub fn folds_to_py<'py>(py: Python<'py>, folds: &[Fold]) -> PyResult<Bound<'py, PyList>> {
    let items = folds.iter().map(|f| {
        let d = PyDict::new(py);
        d.set_item("weight", &f.weight)?;
        d.set_item("bias", &f.bias)?;
        d.set_item("conv_bias", &f.conv_bias)?;
        d.set_item("gamma", &f.gamma)?;
        d.set_item("beta", &f.beta)?;
        d.set_item("mean", &f.mean)?;
        d.set_item("var", &f.var)?;
        d.set_item("eps", f.eps)?;
        Ok(d)
    });
    PyList::new(py, items.collect::<PyResult<Vec<_>>>()?)
}

/// Replaces the weights the folds rewrite with their folded values (`kwexport._passes`).
pub fn fold_batch_norms(py: Python<'_>, weights: &mut BTreeMap<String, Py<PyAny>>, folds: &[Fold]) -> RtResult<()> {
    if folds.is_empty() {
        return Ok(());
    }
    // Only the tensors the folds read.
    let given = PyDict::new(py);
    for f in folds {
        let names = [Some(&f.weight), Some(&f.bias), f.conv_bias.as_ref(), f.gamma.as_ref(), f.beta.as_ref()];
        for name in names.into_iter().flatten().chain([&f.mean, &f.var]) {
            let w = weights.get(name).ok_or_else(|| RtError::Internal(format!("fold: no weight {name}")))?;
            given.set_item(name, w)?;
        }
    }
    let new = py.import("kwexport._passes")?.call_method1("fold_batch_norms", (given, folds_to_py(py, folds)?))?;
    for (name, w) in new.cast::<PyDict>().map_err(PyErr::from)?.iter() {
        weights.insert(name.extract()?, w.unbind());
    }
    Ok(())
}

/// Replaces each int8 weight a `dequantize_weights` rewrite names by its float32 values
/// (`kwexport._passes.dequantize_weights`), before anything else reads it.
pub fn dequantize(
    py: Python<'_>,
    weights: &mut BTreeMap<String, Py<PyAny>>,
    dequantized: &[kwexport_core::passes::dequantize_weights::Dequant],
) -> RtResult<()> {
    let passes = py.import("kwexport._passes")?;
    for d in dequantized {
        let get =
            |name: &str| weights.get(name).ok_or_else(|| RtError::Internal(format!("dequantize: no weight {name}")));
        let (w, scale, zero_point) = (get(&d.weight)?, get(&d.scale)?, get(&d.zero_point)?);
        let new = passes.call_method1("dequantize_weight", (w, scale, zero_point, d.axis))?.unbind();
        weights.insert(d.weight.clone(), new);
    }
    Ok(())
}
