//! Higher-order ops' nodes: a plan per subgraph they may run, built with the same dispatch
//! mode as the plan around them (so a subgraph's nodes run on the C path too), and what the
//! region needs of torch (grad mode, autocast).

use kwexport_core::graph::{SlotArg, SlotNode, ValueRef};
use kwexport_core::hops::{HopCall, HopKind};
use kwexport_core::schema::Arg;
use kwexport_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::consts::ConstTable;
use super::{build, Context, HopStep, PyOp, PyStep};
use crate::constants::literal_to_py;
use crate::errors::{RtError, RtResult};

impl HopStep {
    /// The step for node `index`, a `kind` node; `tensor_slot` says which of the enclosing
    /// plan's slots hold tensors, so the subgraphs know which of their inputs are tensors.
    pub(super) fn build(
        cx: &Context<'_, '_>,
        kind: HopKind,
        node: &SlotNode,
        tensor_slot: &[bool],
        index: usize,
    ) -> RtResult<HopStep> {
        let py = cx.torch.py();
        let entry = format!("graph.nodes[{index}] ({})", node.op_name);
        let call = HopCall::new(kind, node).map_err(|problem| Error::Hop { at: entry.clone(), problem })?;
        let is_tensor = |a: &SlotArg| match a {
            SlotArg::Value(ValueRef::Slot(s)) => tensor_slot[*s],
            SlotArg::Value(ValueRef::Weight(_)) => true,
            _ => false,
        };
        let flags = |g: usize| call.groups[g].iter().map(is_tensor).collect::<Vec<_>>();
        // Which of the subgraphs' inputs are tensors: a row of a tensor is one.
        let rows = |g: usize| vec![true; call.groups[g].len()];
        let operand_is_tensor: Vec<bool> = match kind {
            HopKind::Cond | HopKind::SetGradEnabled | HopKind::Autocast | HopKind::WhileLoop => {
                call.operands().map(is_tensor).collect()
            }
            HopKind::Map => [rows(0), flags(1)].concat(),
            HopKind::Scan => [flags(0), rows(1), flags(2)].concat(),
            HopKind::AssociativeScan => [rows(0), rows(0), flags(1)].concat(),
        };
        let bodies = call
            .bodies
            .iter()
            .map(|name| {
                let graph = cx.subgraphs.get(*name).ok_or_else(|| RtError::Internal(format!("{entry}: {name}")))?;
                build(cx, graph, &operand_is_tensor)
            })
            .collect::<RtResult<Vec<_>>>()?;
        let literal = |i: usize| match &call.params[i] {
            SlotArg::Literal(lit) => literal_to_py(py, cx.torch, lit, &entry),
            _ => Err(RtError::Internal(format!("{entry}: parameter {i} is not a literal"))),
        };
        let enabled = matches!(call.params.first(), Some(SlotArg::Literal(Arg::Bool(true))));
        let autocast = match kind {
            HopKind::Autocast => {
                let kwargs = PyDict::new(py);
                kwargs.set_item("device_type", literal(0)?)?;
                kwargs.set_item("dtype", literal(1)?)?;
                kwargs.set_item("enabled", literal(2)?)?;
                kwargs.set_item("cache_enabled", literal(3)?)?;
                Some((cx.torch.getattr("autocast")?.unbind(), kwargs.unbind()))
            }
            _ => None,
        };
        Ok(HopStep {
            kind,
            groups: call.groups.iter().map(|g| g.len()).collect(),
            stack: cx.torch.getattr("stack")?.unbind(),
            bodies,
            grad_mode: (
                cx.torch.getattr("_C")?.getattr("_set_grad_enabled")?.unbind(),
                cx.torch.getattr("is_grad_enabled")?.unbind(),
            ),
            enabled,
            autocast,
        })
    }
}

impl ConstTable<'_, '_> {
    /// A higher-order node for the Python path: its operands (after `cond`'s predicate) as
    /// the step's arguments.
    pub(super) fn hop_step(&mut self, node: &SlotNode, hop: HopStep, index: usize) -> RtResult<PyStep> {
        let entry = format!("graph.nodes[{index}] ({})", node.op_name);
        let call = HopCall::new(hop.kind, node).map_err(|problem| Error::Hop { at: entry.clone(), problem })?;
        let pred = match hop.kind {
            HopKind::Cond => Some(self.py_arg(&call.params[0], None, &|| entry.clone())?),
            _ => None,
        };
        let operands =
            call.operands().map(|a| self.py_arg(a, None, &|| entry.clone())).collect::<RtResult<Vec<_>>>()?;
        Ok(PyStep {
            op: PyOp::Hop(Box::new(hop)),
            node: index,
            op_name: node.op_name.clone(),
            args: pred.into_iter().chain(operands).collect(),
            kwargs: Vec::new(),
            outputs: node.outputs.clone(),
            free: node.free.clone(),
        })
    }
}
