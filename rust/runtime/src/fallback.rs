//! The program's all-Python plan, built on first need, for the calls the C path must not take:
//!
//! - calls with a tensor subclass (`__torch_dispatch__` wrappers such as DTensor, torchao's
//!   quantized tensors, torch's `TwoTensor`): torch's Python ops run their overrides as
//!   eager does, where the C path would hand the bare wrapper to kernels;
//! - calls right after an op failed on the C path. torch's dispatcher entry formats each
//!   error it catches with its C++ backtrace symbolized (about 5 ms here), where the Python
//!   ops raise in tens of microseconds. An input that makes every call fail would turn a
//!   server's CPU into error formatting, so after a C-path op error the next
//!   [`CALLS_AFTER_ERROR`] calls run on Python; the C path comes back once they succeed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};

use kwexport_core::graph::SlotGraph;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::errors::RtResult;
use crate::ops::ResolvedOp;
use crate::plan::{self, Dispatch, Plan};

/// Calls that run on Python after a C-path op error, each failure starting the count again.
pub const CALLS_AFTER_ERROR: u32 = 32;

/// What the all-Python plan is built from, kept from the load.
pub struct Parts {
    pub ops: Vec<ResolvedOp>,
    pub weights: BTreeMap<String, Py<PyAny>>,
    pub graph: SlotGraph,
    pub subgraphs: BTreeMap<String, SlotGraph>,
    pub leaf_is_tensor: Vec<bool>,
    pub on_cpu: bool,
    /// Whether the load marked weights as requiring grad (see `weights::mark_grad_sensitive`).
    pub grad_weights: bool,
}

/// The all-Python plan's parts, the plan once built, and when calls take it.
pub struct Fallback {
    parts: Parts,
    plan: PyOnceLock<Plan>,
    /// Calls left to run on Python before the C path is tried again.
    after_error: AtomicU32,
}

impl Fallback {
    pub fn new(parts: Parts) -> Self {
        Fallback { parts, plan: PyOnceLock::new(), after_error: AtomicU32::new(0) }
    }

    /// Whether a call runs on Python: it passes a subclass, or the C path failed recently.
    pub fn wanted(&self, subclass: bool) -> bool {
        subclass || self.after_error.load(Ordering::Relaxed) > 0
    }

    /// The all-Python plan, built on first use as the load built the other.
    pub fn plan(&self, py: Python<'_>) -> RtResult<&Plan> {
        self.plan.get_or_try_init(py, || {
            let (p, torch) = (&self.parts, py.import("torch")?);
            let cx = plan::Context {
                torch: &torch,
                ops: &p.ops,
                weights: &p.weights,
                subgraphs: &p.subgraphs,
                dispatch: Dispatch::Python,
                on_cpu: p.on_cpu,
                fast: false,
                bf16: false,
            };
            let mut plan = plan::with_grad_mode(&torch, false, || plan::build(&cx, &p.graph, &p.leaf_is_tensor))??;
            if p.grad_weights {
                plan.set_grad_off_when_unused(&torch)?;
            }
            Ok(plan)
        })
    }

    /// Records how a call went: an op error starts the count of Python calls again; a
    /// success on Python counts one off.
    pub fn record(&self, on_python: bool, op_failed: bool) {
        if op_failed {
            self.after_error.store(CALLS_AFTER_ERROR, Ordering::Relaxed);
        } else if on_python {
            let _ = self.after_error.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }
}
