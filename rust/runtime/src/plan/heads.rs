//! Inverted residual heads: where a 1×1 convolution on kwexport's GEMM expands the channels
//! and nothing but the depthwise convolution right after it reads the result (MobileNetV2's,
//! EfficientNet's blocks), the depthwise step moves into the 1×1's (`CStep::then`) and the two
//! run as one kernel over bands of rows (`kernels::expand_depthwise`), so that the expanded
//! image never leaves L2. On MobileNetV2's 112×112 head, apart, the 1×1 wrote 4.8 MB the
//! depthwise convolution read back from L3 or memory.
//!
//! In an int8 program the expansion is `kwexport::linear_int8` over the image's pixels
//! (`passes::linear_int8`), its result moved back to `[N, C, H, W]` by a `movedim` view: the
//! linear carries the view, which carries the depthwise convolution, and the three run as one
//! kernel (`kernels::int8::expand_depthwise`) where the linear's input scale is a literal.
//!
//! Nothing here is assumed at run time: the pair runs fused only where both tensors qualify
//! and the expanded image is large (`exec`); otherwise the 1×1 runs, then the steps it
//! carries, each as it would alone.

use kwexport_core::graph::{visit_slots, SlotGraph, SlotOutputs};

use super::{CStep, Int8Params, OwnKernel, OwnOp, Segment};
use crate::abi::encode::Enc;
use crate::views::ViewKind;

/// Moves each depthwise convolution that can run with the 1×1 convolution before it into
/// that step (`pairs`), or with an int8 linear and its view into the view, which moves into
/// the linear (`pairs_int8`).
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
            let n = kept.len();
            match kept.as_mut_slice() {
                [.., head] if pairs(head, &step, &readers) => head.then = Some(Box::new(step)),
                [.., head, view] if pairs_int8(head, view, &step, &readers) => {
                    let mut view = kept.pop().expect("matched above");
                    view.then = Some(Box::new(step));
                    kept[n - 2].then = Some(Box::new(view));
                }
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

/// Whether `dw` is a depthwise convolution on kwexport's kernel whose input is `view`, the
/// `movedim(y, -1, 1)` of `head`'s output `y`, where `head` is an int8 linear over pixels
/// (`kwexport::linear_int8` with a literal input scale) and nothing else reads `y` or the
/// view; none of the three returns to the caller, and the convolution adds no residual and
/// writes no part of a concatenation.
fn pairs_int8(head: &CStep, view: &CStep, dw: &CStep, readers: &[usize]) -> bool {
    let linear = match &head.own {
        Some(OwnOp::LinearInt8(l)) => l.conv.is_none() && matches!(l.params, Int8Params::Literal(..)),
        _ => false,
    };
    let alone = |s: &CStep| !s.to_caller && s.part.is_none() && s.then.is_none();
    let int = |s: &CStep, i: usize| match s.args.get(i) {
        Some((_, Enc::Bits(b))) => Some(*b as i64),
        _ => None,
    };
    let moves_last_to_1 = view.view == Some(ViewKind::Movedim)
        && matches!(int(view, 1), Some(-1 | 3))
        && matches!(int(view, 2), Some(1 | -3));
    let depthwise = match dw.shim.as_ref().and_then(|s| s.conv.as_deref()) {
        Some(conv) => {
            conv.residual.is_none()
                && matches!(conv.own.as_deref(), Some(o) if matches!(o.kernel, OwnKernel::Depthwise { .. }))
        }
        None => false,
    };
    let reads = |s: &CStep, slot: usize| matches!(s.args.first(), Some((_, Enc::Slot(x))) if *x == slot);
    let (SlotOutputs::One(Some(y)), SlotOutputs::One(Some(v))) = (&head.outputs, &view.outputs) else { return false };
    linear
        && moves_last_to_1
        && depthwise
        && [head, view, dw].into_iter().all(alone)
        && reads(view, *y)
        && reads(dw, *v)
        && readers[*y] == 1
        && readers[*v] == 1
        && matches!(dw.outputs, SlotOutputs::One(Some(_)))
}
