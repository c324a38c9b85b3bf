//! Stage 2, plan: the validated graph compiled once at load into what the run loop executes.
//! Every op, weight and literal is resolved; each node is checked against its op's schema and
//! given a path (torch's stable C ABI where it covers the node and pays off, torch's Python op
//! object otherwise); consecutive nodes of one path form a segment, and the values that must
//! cross between paths are worked out here.
//!
//! - `consts`    weights, wrapped numbers and literals as the objects nodes read
//! - `cstep`     nodes compiled for the C ABI
//! - `cost`      which C-capable runs are worth their crossings
//! - `segments`  grouping by path, and the crossings each segment needs

mod consts;
mod cost;
mod cstep;
mod segments;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::atomic::AtomicU64;

use kwexport_core::graph::{SlotGraph, SlotOutputs};
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::abi::encode::Enc;
use crate::abi::{self, Abi, Ty};
use crate::errors::RtResult;
use crate::ops::ResolvedOp;

/// Which dispatch paths a plan may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    /// The stable C ABI where it covers a node and saves more than the conversions around
    /// it cost; Python otherwise.
    Auto,
    /// The stable C ABI for every node it covers, whatever the cost.
    Abi,
    /// torch's Python op objects for every node.
    Python,
}

impl Dispatch {
    /// Parses `"auto"`, `"abi"` or `"python"`.
    pub fn parse(s: &str) -> Option<Dispatch> {
        match s {
            "auto" => Some(Dispatch::Auto),
            "abi" => Some(Dispatch::Abi),
            "python" => Some(Dispatch::Python),
            _ => None,
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            Dispatch::Auto => "auto",
            Dispatch::Abi => "abi",
            Dispatch::Python => "python",
        }
    }
}

/// An argument of a Python-path node.
pub enum PyArg {
    /// A value slot.
    Slot(usize),
    /// A weight, literal or wrapped number, made once at load.
    Const(Py<PyAny>),
    /// A list with at least one slot in it.
    List(Vec<PyArg>),
}

/// A node run through torch's Python op object.
pub struct PyStep {
    pub(crate) op: Py<PyAny>,
    pub(crate) args: Vec<PyArg>,
    pub(crate) kwargs: Vec<(Py<PyString>, PyArg)>,
    pub(crate) outputs: SlotOutputs,
    pub(crate) free: Vec<usize>,
}

/// A node run through torch's stable C ABI.
pub struct CStep {
    /// The op's name and overload, as the dispatcher takes them.
    pub(crate) name: (CString, CString),
    /// One encoded argument per schema argument, with its type.
    pub(crate) args: Vec<(Ty, Enc)>,
    pub(crate) returns: Vec<Ty>,
    pub(crate) outputs: SlotOutputs,
    pub(crate) free: Vec<usize>,
}

/// Consecutive nodes on one path, with the crossings they need first.
pub enum Segment {
    /// Nodes on the Python path.
    Python {
        /// Slots whose native values are read here: converted to Python first.
        to_py: Vec<usize>,
        /// The nodes.
        steps: Vec<PyStep>,
    },
    /// Nodes on the C path.
    C {
        /// Slots whose Python values are read here: converted to native first.
        to_native: Vec<usize>,
        /// The nodes.
        steps: Vec<CStep>,
        /// Python forms of the slots these steps free, dropped once the GIL is back.
        free_py: Vec<usize>,
        /// How long the segment took last time, in nanoseconds.
        last_ns: AtomicU64,
    },
}

/// A program's execution plan.
pub struct Plan {
    pub(crate) n_slots: usize,
    pub(crate) user_inputs: Vec<(usize, usize)>,
    pub(crate) segments: Vec<Segment>,
    /// Native slots the outputs read, converted after the last segment.
    pub(crate) outputs_to_py: Vec<usize>,
    pub(crate) outputs: Vec<PyArg>,
    pub(crate) abi: Option<&'static Abi>,
    /// Weights and wrapped numbers that C steps read, as handles.
    pub(crate) consts: Vec<abi::Tensor>,
    pub(crate) tensor_type: Py<PyAny>,
    /// Nodes on each path: `(stable ABI, Python)`.
    pub counts: (usize, usize),
}

/// A node compiled for one path, before segmenting.
enum Compiled {
    Python(PyStep),
    C(CStep),
}

/// Resolves weights and literals, checks each node against its op's schema, and chooses
/// each node's path.
pub fn build(
    py: Python<'_>,
    torch: &Bound<'_, PyModule>,
    graph: &SlotGraph,
    ops: &[ResolvedOp],
    weights: &BTreeMap<String, Py<PyAny>>,
    leaf_is_tensor: &[bool],
    dispatch: Dispatch,
) -> RtResult<Plan> {
    let abi = match dispatch {
        Dispatch::Auto | Dispatch::Abi => Abi::get(py),
        Dispatch::Python => None,
    };
    let mut consts = consts::ConstTable::new(py, torch, weights);
    let tensor_slot = tensor_slots(graph, ops, leaf_is_tensor);
    let is_tensor = |s: usize| tensor_slot[s];
    let mut c_steps = Vec::with_capacity(graph.nodes.len());
    for (i, node) in graph.nodes.iter().enumerate() {
        let op = &ops[node.op];
        if let Some(schema) = &op.schema {
            schema.check(node, || format!("graph.nodes[{i}] ({})", node.op_name))?;
        }
        c_steps.push(
            abi.zip(op.schema.as_ref()).and_then(|(abi, schema)| {
                CStep::compile(abi, schema, node, &schema.bind(node)?, &is_tensor, &mut consts)
            }),
        );
    }
    if dispatch == Dispatch::Auto {
        cost::keep_profitable(&mut c_steps, graph);
    }
    let mut compiled = Vec::with_capacity(graph.nodes.len());
    for (i, (node, c)) in graph.nodes.iter().zip(c_steps).enumerate() {
        compiled.push(match c {
            Some(s) => Compiled::C(s),
            None => Compiled::Python(consts.py_step(node, &ops[node.op], i)?),
        });
    }
    let outputs =
        graph.outputs.iter().map(|a| consts.py_arg(a, None, "graph.outputs")).collect::<RtResult<Vec<_>>>()?;
    let handles = match abi {
        Some(abi) => consts.tensors().iter().map(|t| abi.handle_of(t.bind(py))).collect::<PyResult<Vec<_>>>()?,
        None => Vec::new(),
    };
    let n_c = compiled.iter().filter(|e| matches!(e, Compiled::C(_))).count();
    let (segments, outputs_to_py) = segments::segment(graph, compiled);
    Ok(Plan {
        n_slots: graph.n_slots,
        user_inputs: graph.user_inputs.clone(),
        segments,
        outputs_to_py,
        outputs,
        abi,
        consts: handles,
        tensor_type: torch.getattr("Tensor")?.unbind(),
        counts: (n_c, graph.nodes.len() - n_c),
    })
}

/// Which slots always hold tensors: tensor user leaves, and node outputs whose schema return
/// is a tensor. (Python operators on sizes return numbers.)
fn tensor_slots(graph: &SlotGraph, ops: &[ResolvedOp], leaf_is_tensor: &[bool]) -> Vec<bool> {
    let mut tensor_slot = vec![false; graph.n_slots];
    for &(slot, leaf) in &graph.user_inputs {
        tensor_slot[slot] = leaf_is_tensor.get(leaf).copied().unwrap_or(false);
    }
    for node in &graph.nodes {
        let returns = ops[node.op].schema.as_ref().and_then(|s| s.c_returns.as_deref()).unwrap_or(&[]);
        for (i, s) in node.outputs.defined() {
            tensor_slot[s] = match returns {
                [Ty::List(inner)] => **inner == Ty::Tensor,
                _ => returns.get(i) == Some(&Ty::Tensor),
            };
        }
    }
    tensor_slot
}
