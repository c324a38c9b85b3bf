//! Inverted residual heads: where a 1×1 convolution on kwexport's GEMM expands the channels
//! and nothing but the depthwise convolution right after it reads the result (MobileNetV2's,
//! EfficientNet's blocks), the depthwise step moves into the 1×1's (`CStep::then`) and the two
//! run as one kernel over bands of rows (`kernels::expand_depthwise`), so that the expanded
//! image never leaves L2. On MobileNetV2's 112×112 head, apart, the 1×1 wrote 4.8 MB the
//! depthwise convolution read back from L3 or memory.
//!
//! Nothing here is assumed at run time: the pair runs fused only where both tensors qualify
//! and the expanded image is large (`exec`); otherwise the 1×1 runs, then the depthwise
//! step, each as it would alone.

use kwexport_core::graph::{visit_slots, SlotGraph, SlotOutputs};

use super::{CStep, OwnKernel, Segment};
use crate::abi::encode::Enc;

/// Moves each depthwise convolution that can run with the 1×1 convolution before it into
/// that step.
pub(super) fn fuse(graph: &SlotGraph, segments: &mut [Segment]) {
    let mut readers = vec![0usize; graph.n_slots];
    for node in &graph.nodes {
        let args = node.args.iter().chain(node.kwargs.iter().map(|(_, a)| a));
        args.for_each(|a| visit_slots(a, &mut |s| readers[s] += 1));
    }
    graph.outputs.iter().for_each(|a| visit_slots(a, &mut |s| readers[s] += 1));
    for segment in segments {
        let Segment::C { steps, .. } = segment else { continue };
        let mut kept: Vec<CStep> = Vec::with_capacity(steps.len());
        for step in std::mem::take(steps) {
            match kept.last_mut() {
                Some(head) if pairs(head, &step, &readers) => head.then = Some(Box::new(step)),
                _ => kept.push(step),
            }
        }
        *steps = kept;
    }
}

/// Whether `dw` is a depthwise convolution on kwexport's kernel whose input is the output of
/// `head`, a float32 1×1 convolution on kwexport's GEMM, and nothing else reads that output;
/// neither adds a residual, writes a part of a concatenation or returns to the caller.
fn pairs(head: &CStep, dw: &CStep, readers: &[usize]) -> bool {
    fn own(s: &CStep) -> Option<&OwnKernel> {
        let conv = s.shim.as_ref()?.conv.as_deref()?;
        let alone = conv.residual.is_none() && s.part.is_none() && !s.to_caller && s.then.is_none();
        alone.then_some(())?;
        Some(&conv.own.as_deref()?.kernel)
    }
    let expands = matches!(own(head), Some(OwnKernel::Gemm { panels, .. }) if !panels.bf16);
    let depthwise = matches!(own(dw), Some(OwnKernel::Depthwise { .. }));
    let SlotOutputs::One(Some(mid)) = head.outputs else { return false };
    let reads_mid = matches!(dw.args.first(), Some((_, Enc::Slot(s))) if *s == mid);
    expands && depthwise && reads_mid && readers[mid] == 1 && matches!(dw.outputs, SlotOutputs::One(Some(_)))
}
