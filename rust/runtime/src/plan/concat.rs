//! Concatenations made in place: where every input of a `cat` along channels is the output
//! of a convolution on kwexport's kernels that nothing but convolutions before the `cat`
//! reads, each convolution writes its output straight into its channels of the result,
//! and the `cat` returns that without copying (OpenVINO's in-place concat). GhostNet's
//! modules concatenate a 1×1 convolution's output with a depthwise one's of it; SqueezeNet's
//! a 1×1's and a 3×3's of one input.
//!
//! Nothing here is assumed at run time: the first of the convolutions to run makes the
//! result (`exec`, in the `cat`'s slot), each writes its part where its kernel can
//! (`operators::concat`), and the `cat` copies whatever isn't in its place (a convolution that
//! ran on oneDNN), or runs as usual where the result doesn't fit the inputs.

use kwexport_core::graph::{visit_slots, SlotGraph, SlotOutputs};

use super::{Compiled, OwnKernel, OwnOp};
use crate::abi::encode::Enc;

/// Where a convolution's output goes in a concatenation made in place: channels `offset`
/// on of the `cat`'s result (slot `slot`, `total` channels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartOf {
    pub slot: usize,
    pub offset: usize,
    pub total: usize,
}

/// Marks the convolutions of each concatenation that can be made in place with their part.
pub(super) fn in_place(graph: &SlotGraph, compiled: &mut [Compiled]) {
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); graph.n_slots];
    for (i, node) in graph.nodes.iter().enumerate() {
        let args = node.args.iter().chain(node.kwargs.iter().map(|(_, a)| a));
        args.for_each(|a| visit_slots(a, &mut |s| readers[s].push(i)));
    }
    let mut producer = vec![None; graph.n_slots];
    for (i, c) in compiled.iter().enumerate() {
        if let Compiled::C(step) = c {
            for (_, s) in step.outputs.defined() {
                producer[s] = Some(i);
            }
        }
    }
    for cat in 0..compiled.len() {
        let Some(parts) = parts_of(compiled, cat, &readers, &producer) else { continue };
        for (p, part) in parts {
            if let Compiled::C(step) = &mut compiled[p] {
                step.part = Some(part);
            }
        }
    }
}

/// The convolutions (node indices) whose outputs node `cat` concatenates in place, each
/// with its part; `None` where it isn't such a concatenation.
fn parts_of(
    compiled: &[Compiled],
    cat: usize,
    readers: &[Vec<usize>],
    producer: &[Option<usize>],
) -> Option<Vec<(usize, PartOf)>> {
    let Compiled::C(step) = &compiled[cat] else { return None };
    let (Some(OwnOp::Cat { dim: 1 }), SlotOutputs::One(Some(slot)), false) = (&step.own, &step.outputs, step.to_caller)
    else {
        return None;
    };
    let Some((_, Enc::List(items))) = step.args.first() else { return None };
    let mut parts = Vec::with_capacity(items.len());
    let mut offset = 0;
    for item in items {
        let Enc::Slot(s) = item else { return None };
        let p = producer[*s]?;
        let channels = writes_parts(&compiled[p])?;
        // Read by this `cat` once (no other of its inputs is the same value, so none is the
        // same convolution's) and otherwise only as convolutions' inputs, before it.
        let read_by_cat = readers[*s].iter().filter(|&&r| r == cat).count() == 1;
        let others = readers[*s].iter().filter(|&&r| r != cat).all(|&r| r < cat && reads_as_input(&compiled[r], *s));
        if !read_by_cat || !others {
            return None;
        }
        parts.push((p, PartOf { slot: *slot, offset, total: 0 }));
        offset += channels;
    }
    if parts.len() < 2 {
        return None;
    }
    parts.iter_mut().for_each(|(_, part)| part.total = offset);
    Some(parts)
}

/// The output channels of a node that can write its output into a part of a
/// concatenation: a convolution with kwexport's 1×1, depthwise or indirect kernel, without
/// a residual add, whose one output goes to no caller.
fn writes_parts(c: &Compiled) -> Option<usize> {
    let Compiled::C(step) = c else { return None };
    let conv = step.shim.as_ref()?.conv.as_deref()?;
    let own = conv.own.as_deref()?;
    let kernel =
        matches!(own.kernel, OwnKernel::Gemm { .. } | OwnKernel::Depthwise { .. } | OwnKernel::Indirect { .. });
    let one = matches!(step.outputs, SlotOutputs::One(Some(_)));
    (kernel && one && conv.residual.is_none() && !step.to_caller).then(|| usize::try_from(conv.shape[0]).ok())?
}

/// Whether a node is a convolution that reads slot `s` as its input only (not as a
/// residual): kwexport's kernels and oneDNN's read a part of a concatenation there.
fn reads_as_input(c: &Compiled, s: usize) -> bool {
    let Compiled::C(step) = c else { return false };
    let is_conv = step.shim.as_ref().is_some_and(|shim| shim.conv.is_some());
    let slot = |e: &Enc| matches!(e, Enc::Slot(x) if *x == s);
    is_conv && step.args.first().is_some_and(|(_, e)| slot(e)) && !step.args[1..].iter().any(|(_, e)| slot(e))
}
