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
    drop_empty_masks(py, &mut rest, &weights)?;
    Ok(Some((rest, weights)))
}

/// Attention masks that mask nothing, folded from literals alone (a vision transformer's
/// all-true mask, built from `arange`): dropped, so that attention runs unmasked, on the
/// kernels a mask rules out (flash attention on CUDA). A boolean mask that is all true, or a
/// float one that is all zero, adds nothing to any score.
fn drop_empty_masks(py: Python<'_>, graph: &mut SlotGraph, weights: &BTreeMap<String, Py<PyAny>>) -> RtResult<()> {
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
        let empty = if t.getattr("dtype")?.str()?.to_str()? == "torch.bool" {
            t.call_method0("all")?.is_truthy()?
        } else {
            t.call_method0("is_floating_point")?.is_truthy()? && !t.call_method0("any")?.is_truthy()?
        };
        if empty {
            *mask = SlotArg::Literal(Arg::None(()));
        }
    }
    Ok(())
}
