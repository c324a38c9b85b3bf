//! Constant folding at load (`fast`): the core splits a graph (`passes::constant_fold`);
//! here the half that reads only constants runs once, as a plan of its own, and its values
//! become weights of the half that runs on every call.

use std::collections::BTreeMap;

use kwexport_core::graph::{SlotArg, SlotGraph, ValueRef};
use kwexport_core::passes::constant_fold;
use kwexport_core::schema::{Arg, OpEntry};
use pyo3::prelude::*;

use super::{build, Context};
use crate::errors::RtResult;

/// A graph with its constants folded, and the weights it reads: the file's, and the folded
/// values.
pub type Folded = (SlotGraph, BTreeMap<String, Py<PyAny>>);

/// The graph a call runs and the weights it reads; `None` where nothing folds, or where the
/// folded nodes fail or return something other than tensors (a call then meets the same
/// nodes as it would have). Run with grad mode off: the values are constants, never part of
/// what a call differentiates.
pub fn constants(
    cx: &Context<'_, '_>,
    graph: &SlotGraph,
    ops: &[OpEntry],
    is_state: impl Fn(&str) -> bool,
) -> RtResult<Option<Folded>> {
    let py = cx.torch.py();
    let name = |slot: usize| format!("<constant {slot}>");
    if cx.weights.keys().any(|w| w.starts_with("<constant ")) {
        return Ok(None);
    }
    let Some(split) = constant_fold::split(graph, ops, cx.subgraphs, is_state, name) else {
        return Ok(None);
    };
    let Ok(plan) = build(cx, &split.once, &[]) else { return Ok(None) };
    let Ok(values) = plan.run(py, &[]) else { return Ok(None) };
    let tensor = cx.torch.getattr("Tensor")?;
    if !values.iter().all(|v| v.is_instance(&tensor).unwrap_or(false)) {
        return Ok(None);
    }
    let mut weights: BTreeMap<String, Py<PyAny>> =
        cx.weights.iter().map(|(k, v)| (k.clone(), v.clone_ref(py))).collect();
    weights.extend(split.names.into_iter().zip(values.into_iter().map(Bound::unbind)));
    let mut rest = split.rest;
    masks_as_flags(py, &mut rest, &weights)?;
    Ok(Some((rest, weights)))
}

/// Attention masks folded from literals alone that say no more than a flag: one that masks
/// nothing (a vision transformer's all-true mask, built from `arange`) is dropped, so that
/// attention runs unmasked, on the kernels a mask rules out (flash attention on CUDA); a
/// causal one over as many queries as keys (a decoder's, built from `arange` and compared
/// or filled with the dtype's least value) becomes `is_causal`, whose kernels skip the keys
/// each query can't see (half the work). A boolean mask that is all true, or a float one
/// that is all zero, adds nothing to any score; one that keeps exactly the keys `j <= i`
/// (true, or 0 where a float mask adds at most `-1e30`, after which `exp` is exactly 0 in
/// float32 beside the unmasked diagonal) is `is_causal`'s.
fn masks_as_flags(py: Python<'_>, graph: &mut SlotGraph, weights: &BTreeMap<String, Py<PyAny>>) -> RtResult<()> {
    for node in &mut graph.nodes {
        let op = &node.op_name;
        if op.namespace != "aten" || op.name != "scaled_dot_product_attention" {
            continue;
        }
        let mask = match node.kwargs.iter_mut().find(|(k, _)| k == "attn_mask") {
            Some((_, arg)) => Some(arg),
            None => node.args.get_mut(3),
        };
        let Some(mask) = mask else { continue };
        let SlotArg::Value(ValueRef::Weight(name)) = &*mask else { continue };
        if !name.starts_with("<constant ") {
            continue;
        }
        let Some(t) = weights.get(name).map(|t| t.bind(py)) else { continue };
        let kept = match t.getattr("dtype")?.str()?.to_str()? {
            "torch.bool" => t.clone(),
            "torch.float32" | "torch.float16" | "torch.bfloat16" | "torch.float64" => {
                // Kept where 0, masked where at most -1e30; anything else is neither flag.
                let (zero, masked) = (t.call_method1("eq", (0.0,))?, t.call_method1("le", (-1e30,))?);
                if !zero.call_method1("logical_or", (&masked,))?.call_method0("all")?.is_truthy()? {
                    continue;
                }
                zero
            }
            _ => continue,
        };
        if kept.call_method0("all")?.is_truthy()? {
            *mask = SlotArg::Literal(Arg::None(()));
            continue;
        }
        let shape: Vec<i64> = kept.getattr("shape")?.extract()?;
        let [.., l, s] = shape[..] else { continue };
        let causal = causal_keys(py, l, s, &kept.getattr("device")?)?;
        if l == s && l > 1 && kept.call_method1("eq", (causal,))?.call_method0("all")?.is_truthy()? {
            *mask = SlotArg::Literal(Arg::None(()));
            set_causal(node);
        }
    }
    Ok(())
}

/// torch's `ones(l, s, dtype=bool, device=device).tril()`: the keys `j <= i` each query `i`
/// sees, on the mask's device (a CUDA program's folded mask is on the GPU).
fn causal_keys<'py>(py: Python<'py>, l: i64, s: i64, device: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let torch = py.import("torch")?;
    let kw = pyo3::types::PyDict::new(py);
    kw.set_item("dtype", torch.getattr("bool")?)?;
    kw.set_item("device", device)?;
    torch.call_method("ones", (l, s), Some(&kw))?.call_method0("tril")
}

/// Sets an attention node's `is_causal` (its sixth argument, or the keyword).
fn set_causal(node: &mut kwexport_core::graph::SlotNode) {
    let flag = SlotArg::Literal(Arg::Bool(true));
    if let Some((_, arg)) = node.kwargs.iter_mut().find(|(k, _)| k == "is_causal") {
        *arg = flag;
    } else if node.args.len() > 5 {
        node.args[5] = flag;
    } else {
        // Keywords stay in the file's sorted order.
        let at = node.kwargs.partition_point(|(k, _)| k.as_str() < "is_causal");
        node.kwargs.insert(at, ("is_causal".to_string(), flag));
    }
}
