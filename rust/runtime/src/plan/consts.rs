//! The objects nodes read that are made once per load: weights, literals, and numbers
//! wrapped as torch wraps a number passed where an op takes a tensor.

use std::collections::{BTreeMap, HashMap};

use kwexport_core::graph::{SlotArg, SlotNode, ValueRef};
use kwexport_core::schema::Arg;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyString, PyTuple};

use super::{PyArg, PyOp, PyStep};
use crate::abi::encode::Consts;
use crate::abi::{self, Abi};
use crate::constants::literal_to_py;
use crate::errors::RtResult;
use crate::operators::Panels;
use crate::ops::{ResolvedOp, SchemaArg};

/// Constant objects for the plan, each made once per load.
pub(super) struct ConstTable<'a, 'py> {
    py: Python<'py>,
    torch: &'a Bound<'py, PyModule>,
    weights: &'a BTreeMap<String, Py<PyAny>>,
    abi: Option<&'static Abi>,
    /// Tensors C steps read, by index.
    tensors: Vec<Const>,
    weight_index: HashMap<String, usize>,
    /// Weights to pack for kwexport's GEMM, and their `n`.
    panels: HashMap<String, (std::sync::Arc<Panels>, i64)>,
    /// Pack them for the bfloat16 GEMM (`precision="bf16"`).
    bf16: bool,
    /// Wrapped numbers, one per distinct number literal.
    numbers: Vec<WrappedNumber>,
}

/// A tensor C steps read: a Python tensor (made a handle at the end), or one made in C.
enum Const {
    Py(Py<PyAny>),
    Native(abi::Tensor),
}

/// A number literal and its wrapped tensor (`None` if torch's wrapping couldn't be
/// reproduced), with its index in `tensors` once a C step uses it.
struct WrappedNumber {
    key: (u8, u64),
    tensor: Option<Py<PyAny>>,
    const_index: Option<usize>,
    /// `(dtype, index)` of the number cast to `dtype`, once a C step uses it.
    casts: Vec<(String, usize)>,
}

impl<'a, 'py> ConstTable<'a, 'py> {
    pub(super) fn new(
        py: Python<'py>,
        torch: &'a Bound<'py, PyModule>,
        weights: &'a BTreeMap<String, Py<PyAny>>,
        abi: Option<&'static Abi>,
        bf16: bool,
    ) -> Self {
        ConstTable {
            bf16,
            py,
            torch,
            weights,
            abi,
            tensors: Vec::new(),
            weight_index: HashMap::new(),
            panels: HashMap::new(),
            numbers: Vec::new(),
        }
    }

    /// Handles to the tensors C steps read, in the order their encodings name them.
    pub(super) fn into_handles(self, abi: &Abi) -> PyResult<Vec<abi::Tensor>> {
        let py = self.py;
        self.tensors
            .into_iter()
            .map(|t| match t {
                Const::Py(t) => abi.handle_of(t.bind(py)),
                Const::Native(t) => Ok(t),
            })
            .collect()
    }

    fn push(&mut self, t: Const) -> usize {
        self.tensors.push(t);
        self.tensors.len() - 1
    }

    fn wrapped(&mut self, lit: &Arg) -> Option<(usize, Py<PyAny>)> {
        let key = number_key(lit)?;
        let i = match self.numbers.iter().position(|n| n.key == key) {
            Some(i) => i,
            None => {
                let tensor = wrapped_number(self.py, self.torch, lit).ok().flatten();
                self.numbers.push(WrappedNumber { key, tensor, const_index: None, casts: Vec::new() });
                self.numbers.len() - 1
            }
        };
        self.numbers[i].tensor.as_ref().map(|t| (i, t.clone_ref(self.py)))
    }

    /// A node for the Python path; `index` names it for errors.
    pub(super) fn py_step(&mut self, node: &SlotNode, op: &ResolvedOp, index: usize) -> RtResult<PyStep> {
        // Only formatted where a literal needs it for an error: this runs for most nodes.
        let entry = || format!("graph.nodes[{index}] ({})", node.op_name);
        let schema = op.schema.as_ref();
        let args = node
            .args
            .iter()
            .enumerate()
            .map(|(position, a)| self.py_arg(a, schema.and_then(|s| s.arg(Some(position), None)), &entry))
            .collect::<RtResult<Vec<_>>>()?;
        let kwargs = node
            .kwargs
            .iter()
            .map(|(name, a)| {
                let value = self.py_arg(a, schema.and_then(|s| s.arg(None, Some(name))), &entry)?;
                Ok((PyString::intern(self.py, name).unbind(), value))
            })
            .collect::<RtResult<Vec<_>>>()?;
        Ok(PyStep {
            op: PyOp::Call(op.callable.clone_ref(self.py)),
            node: index,
            op_name: node.op_name.clone(),
            args,
            kwargs,
            outputs: node.outputs.clone(),
            free: node.free.clone(),
        })
    }

    /// For a factory op whose arguments are all literals (`arange(7)`), its result, made once
    /// here: an index into the C steps' tensors, which each call clones. `None` for other
    /// nodes, or where the op fails (the call then fails the same way on the Python path).
    pub(super) fn folded_factory(&mut self, node: &SlotNode, op: &ResolvedOp, index: usize) -> RtResult<Option<usize>> {
        let literal = |a: &SlotArg| match a {
            SlotArg::Literal(_) => true,
            SlotArg::List(items) => items.iter().all(|i| matches!(i, SlotArg::Literal(_))),
            SlotArg::Value(_) => false,
        };
        let name = node.op_name.to_string();
        if !PURE_FACTORIES.contains(&name.as_str())
            || !node.args.iter().chain(node.kwargs.iter().map(|(_, a)| a)).all(literal)
        {
            return Ok(None);
        }
        let step = self.py_step(node, op, index)?;
        let value = |a: &PyArg| match a {
            PyArg::Const(c) => Ok(c.bind(self.py).clone()),
            _ => Err(crate::errors::RtError::Internal("a literal that is not a constant".into())),
        };
        let args = step.args.iter().map(value).collect::<RtResult<Vec<_>>>()?;
        let kwargs = PyDict::new(self.py);
        for (k, a) in &step.kwargs {
            kwargs.set_item(k.bind(self.py), value(a)?)?;
        }
        let Ok(tensor) = op.callable.bind(self.py).call(PyTuple::new(self.py, args)?, Some(&kwargs)) else {
            return Ok(None);
        };
        if !tensor.is_instance(&self.torch.getattr("Tensor")?)? {
            return Ok(None);
        }
        Ok(Some(self.push(Const::Py(tensor.unbind()))))
    }

    /// An argument for the Python path, for the schema argument `param` where known; `entry`
    /// names it for errors.
    pub(super) fn py_arg(
        &mut self,
        a: &SlotArg,
        param: Option<&SchemaArg>,
        entry: &dyn Fn() -> String,
    ) -> RtResult<PyArg> {
        let py = self.py;
        Ok(match a {
            SlotArg::Value(ValueRef::Slot(s)) => PyArg::Slot(*s),
            SlotArg::Value(ValueRef::Weight(w)) => PyArg::Const(self.weights[w].clone_ref(py)),
            SlotArg::Literal(lit) => {
                // A number where the op takes a tensor: wrap it once here, as torch would on
                // every call.
                match param.is_some_and(SchemaArg::takes_tensor).then(|| self.wrapped(lit)).flatten() {
                    Some((_, wrapped)) => PyArg::Const(wrapped),
                    None => PyArg::Const(literal_to_py(py, self.torch, lit, &entry())?),
                }
            }
            SlotArg::List(items) => {
                let out = items.iter().map(|i| self.py_arg(i, None, entry)).collect::<RtResult<Vec<_>>>()?;
                // A list of constants is built once, here, rather than on every call.
                if out.iter().all(|a| matches!(a, PyArg::Const(_))) {
                    let consts = out.iter().map(|a| match a {
                        PyArg::Const(c) => c.bind(py).clone(),
                        _ => unreachable!("all constants"),
                    });
                    PyArg::Const(PyList::new(py, consts)?.into_any().unbind())
                } else {
                    PyArg::List(out)
                }
            }
        })
    }
}

/// Ops that make a new tensor from their arguments alone, the same every call: with only
/// literals, their result is made at load and cloned per call.
const PURE_FACTORIES: [&str; 6] = [
    "aten::arange.default",
    "aten::arange.start",
    "aten::arange.start_step",
    "aten::full.default",
    "aten::scalar_tensor.default",
    "aten::linspace.default",
];

/// A number literal's kind and bits: `1`, `1.0`, `-0.0` and `True` wrap differently.
fn number_key(lit: &Arg) -> Option<(u8, u64)> {
    match lit {
        Arg::Int(i) => Some((0, *i as u64)),
        Arg::Float(f) => Some((1, f.0.to_bits())),
        Arg::Bool(b) => Some((2, *b as u64)),
        _ => None,
    }
}

/// The largest weight (in elements: 32 MiB of float32, BERT-base's 768×3072 and a 2048×4096
/// fit) that `fast` copies transposed for kwexport's linear kernel, on the node's first call.
/// The copy is the process's own memory, where the file's weights are shared pages of the
/// mapped file: as ONNX Runtime's prepacked weights, up to the model's float32 size again.
const MAX_PACKED_ELEMENTS: i64 = 1 << 23;

/// The same for `precision="bf16"`, whose copy takes half the weight's memory and is what
/// makes its products fast (torch's bfloat16 products would need casts around each): any
/// weight up to 128 MiB of float32.
const MAX_BF16_PACKED_ELEMENTS: i64 = 1 << 25;

impl Consts for ConstTable<'_, '_> {
    fn weight(&mut self, name: &str) -> usize {
        if let Some(&i) = self.weight_index.get(name) {
            return i;
        }
        let i = self.push(Const::Py(self.weights[name].clone_ref(self.py)));
        self.weight_index.insert(name.to_owned(), i);
        i
    }

    fn weight_t(&mut self, name: &str) -> Option<usize> {
        let key = format!("{name}\u{0}t");
        if let Some(&i) = self.weight_index.get(&key) {
            return Some(i);
        }
        let abi = self.abi?;
        let w = abi.handle_of(self.weights.get(name)?.bind(self.py)).ok()?;
        let i = self.push(Const::Native(abi.transpose_2d(&w)?));
        self.weight_index.insert(key, i);
        Some(i)
    }

    fn f32_shape(&mut self, name: &str) -> Option<Vec<i64>> {
        let w = self.weights.get(name)?.bind(self.py);
        let is_f32 = w.getattr("dtype").ok()?.eq(self.torch.getattr("float32").ok()?).ok()?;
        is_f32.then(|| w.getattr("shape").ok()?.extract().ok())?
    }

    fn number_cast(&mut self, wrapped: usize, dtype: &str) -> Option<usize> {
        let n = self.numbers.iter().position(|n| n.const_index == Some(wrapped))?;
        if let Some((_, at)) = self.numbers[n].casts.iter().find(|(d, _)| d == dtype) {
            return Some(*at);
        }
        // What TensorIterator does to a wrapped number of another dtype than the tensor's.
        let Const::Py(number) = &self.tensors[wrapped] else { return None };
        let cast = number.bind(self.py).call_method1("to", (self.torch.getattr(dtype).ok()?,)).ok()?;
        let i = self.push(Const::Py(cast.unbind()));
        self.numbers[n].casts.push((dtype.to_owned(), i));
        Some(i)
    }

    fn number(&mut self, lit: &Arg) -> Option<usize> {
        let (i, t) = self.wrapped(lit)?;
        if let Some(at) = self.numbers[i].const_index {
            return Some(at);
        }
        let at = self.push(Const::Py(t));
        self.numbers[i].const_index = Some(at);
        Some(at)
    }
}

/// The constants that kwexport's own kernels take beside the encoded arguments' (packed
/// weights, taps), resolved by the plan.
pub(crate) trait KernelConsts: Consts {
    /// A float32 matrix weight to pack into kwexport's GEMM's panels on first use
    /// (`operators::Panels`), read as `[k, n]`: the weight transposed (`transpose`, a linear's
    /// `[n, k]` or a 1×1 convolution's `[n, k, 1, 1]`) or as it is (an `addmm`'s second
    /// matrix); and `n`. `None` for other weights, and those too large to copy.
    fn weight_panels(&mut self, name: &str, transpose: bool) -> Option<(std::sync::Arc<Panels>, i64)>;
    /// Whether the GEMM's weights are packed in bfloat16 (`precision="bf16"`).
    fn bf16(&self) -> bool;
    /// A convolution's float32 `[out, in, kh, kw]` weight as a new contiguous `[in * kh * kw,
    /// out]` tensor of taps (each tap's output channels contiguous: `kernels::depthwise_f32`,
    /// `kernels::direct_f32`), and the weight's shape; `None` for any other weight.
    fn conv_taps(&mut self, name: &str) -> Option<(usize, [i64; 4])>;
    /// An int8 `[n, k]` or `[n, k, kh, kw]` weight (of `groups` groups) and its zero points,
    /// to pack for the int8 GEMM on first use (`operators::Int8Panels`) for an input of
    /// `levels` levels past `qmin`, and its shape (`[n, k, 1, 1]` for a matrix); `None` for a
    /// weight of another dtype or rank.
    fn int8_panels(
        &mut self,
        weight: &str,
        zero_point: &str,
        groups: usize,
        levels: i64,
    ) -> Option<(crate::operators::Int8Panels, [i64; 4])>;
}

impl KernelConsts for ConstTable<'_, '_> {
    fn weight_panels(&mut self, name: &str, transpose: bool) -> Option<(std::sync::Arc<Panels>, i64)> {
        let key = format!("{name}\u{0}panels {transpose}");
        if let Some((panels, n)) = self.panels.get(&key) {
            return Some((panels.clone(), *n));
        }
        let w = self.weights.get(name)?.bind(self.py);
        let shape: Vec<i64> = w.getattr("shape").ok()?.extract().ok()?;
        // A 1×1 convolution's `[n, k, 1, 1]` weight is its `[n, k]` matrix.
        let n = match (shape.as_slice(), transpose) {
            ([n, _], true) | ([n, _, 1, 1], true) | ([_, n], false) => *n,
            _ => return None,
        };
        let is_f32 = w.getattr("dtype").ok()?.eq(self.torch.getattr("float32").ok()?).ok()?;
        let elements: i64 = shape.iter().product();
        // The copy costs the weight's memory again: not for the largest matrices (a language
        // model's vocabulary projection), where torch's kernel reads the mapped file.
        let most = if self.bf16 { MAX_BF16_PACKED_ELEMENTS } else { MAX_PACKED_ELEMENTS };
        if !is_f32 || elements > most || elements == 0 || self.abi.is_none() {
            return None;
        }
        let panels = std::sync::Arc::new(Panels::new(self.weight(name), transpose, self.bf16));
        self.panels.insert(key, (panels.clone(), n));
        Some((panels, n))
    }

    fn bf16(&self) -> bool {
        self.bf16
    }

    fn int8_panels(
        &mut self,
        weight: &str,
        zero_point: &str,
        groups: usize,
        levels: i64,
    ) -> Option<(crate::operators::Int8Panels, [i64; 4])> {
        let w = self.weights.get(weight)?.bind(self.py);
        let is_int8 = w.getattr("dtype").ok()?.eq(self.torch.getattr("int8").ok()?).ok()?;
        let shape = match w.getattr("shape").ok()?.extract::<Vec<i64>>().ok()?.as_slice() {
            [n, k] => [*n, *k, 1, 1],
            [n, k, kh, kw] => [*n, *k, *kh, *kw],
            _ => return None,
        };
        if !is_int8 || self.abi.is_none() || !self.weights.contains_key(zero_point) {
            return None;
        }
        let panels = crate::operators::Int8Panels::new(self.weight(weight), self.weight(zero_point), groups, levels);
        Some((panels, shape))
    }

    fn conv_taps(&mut self, name: &str) -> Option<(usize, [i64; 4])> {
        let w = self.weights.get(name)?.bind(self.py);
        let shape: [i64; 4] = w.getattr("shape").ok()?.extract::<Vec<i64>>().ok()?.try_into().ok()?;
        let is_f32 = w.getattr("dtype").ok()?.eq(self.torch.getattr("float32").ok()?).ok()?;
        if !is_f32 || shape.contains(&0) {
            return None;
        }
        let taps = w.call_method0("detach").ok()?.call_method1("flatten", (1,)).ok()?.call_method0("t").ok()?;
        let taps = taps.call_method0("contiguous").ok()?;
        let i = self.push(Const::Py(taps.unbind()));
        Some((i, shape))
    }
}

/// A number as torch passes it to a `Tensor` argument: a 0-dim "wrapped number" tensor,
/// which type promotion treats like the scalar it came from (`int32_tensor * 0.5` is
/// float32, not float64). torch has no public constructor for one, so it is taken from
/// autograd's record of a multiplication by the number, then checked to promote exactly as
/// the number does; `None` if anything differs, and the node keeps the plain number.
fn wrapped_number<'py>(py: Python<'py>, torch: &Bound<'py, PyModule>, lit: &Arg) -> PyResult<Option<Py<PyAny>>> {
    let value = match lit {
        Arg::Int(i) => i.into_pyobject(py)?.into_any(),
        Arg::Float(f) => f.0.into_pyobject(py)?.into_any(),
        Arg::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        _ => return Ok(None),
    };
    let taken = super::with_grad_mode(torch, true, || -> PyResult<Bound<'py, PyAny>> {
        let kw = PyDict::new(py);
        kw.set_item("requires_grad", true)?;
        let probe = torch.call_method("zeros", (PyTuple::empty(py),), Some(&kw))?;
        probe.call_method1("mul", (&value,))?.getattr("grad_fn")?.getattr("_saved_other")
    })?;
    let Ok(wrapped) = taken else { return Ok(None) };
    let promotes_alike = |dtype: &str, shape: Vec<usize>| -> PyResult<bool> {
        let kw = PyDict::new(py);
        kw.set_item("dtype", torch.getattr(dtype)?)?;
        let t = torch.call_method("zeros", (shape,), Some(&kw))?;
        let a = torch.call_method1("result_type", (&t, &wrapped))?;
        let b = torch.call_method1("result_type", (&t, &value))?;
        a.eq(b)
    };
    let same = wrapped.getattr("dim")?.call0()?.extract::<usize>()? == 0
        && wrapped.call_method0("item")?.eq(&value)?
        && wrapped.getattr("requires_grad")?.extract::<bool>().map(|r| !r)?
        && promotes_alike("int32", vec![])?
        && promotes_alike("bool", vec![2])?
        && promotes_alike("float16", vec![])?;
    Ok(same.then(|| wrapped.unbind()))
}
