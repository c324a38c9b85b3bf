//! Segments: consecutive nodes on one path. Following each slot through the nodes in order
//! tells which values a segment must convert before it runs, and which the outputs need.

use std::sync::atomic::AtomicU64;

use kwexport_core::graph::{visit_slots, SlotGraph};

use super::{Compiled, PyArg, Segment};

/// Groups compiled nodes into segments; also returns the slots to convert to Python for the
/// outputs.
pub(super) fn segment(graph: &SlotGraph, compiled: Vec<Compiled>) -> (Vec<Segment>, Vec<usize>) {
    let n = graph.n_slots;
    let (mut has_py, mut has_native) = (vec![false; n], vec![false; n]);
    for &(slot, _) in &graph.user_inputs {
        has_py[slot] = true;
    }
    let mut segments: Vec<Segment> = Vec::new();
    let mut reads = Vec::new();
    for step in compiled {
        match step {
            Compiled::Python(step) => {
                if !matches!(segments.last(), Some(Segment::Python { .. })) {
                    segments.push(Segment::Python { to_py: Vec::new(), steps: Vec::new() });
                }
                let Some(Segment::Python { to_py, steps }) = segments.last_mut() else { unreachable!() };
                reads.clear();
                step.args.iter().chain(step.kwargs.iter().map(|(_, a)| a)).for_each(|a| slots_of(a, &mut reads));
                for &s in &reads {
                    if !has_py[s] {
                        has_py[s] = true;
                        to_py.push(s);
                    }
                }
                for (_, s) in step.outputs.defined() {
                    (has_py[s], has_native[s]) = (true, false);
                }
                for &s in &step.free {
                    (has_py[s], has_native[s]) = (false, false);
                }
                steps.push(step);
            }
            Compiled::C(step) => {
                if !matches!(segments.last(), Some(Segment::C { .. })) {
                    segments.push(Segment::C {
                        to_native: Vec::new(),
                        steps: Vec::new(),
                        free_py: Vec::new(),
                        last_ns: AtomicU64::new(0),
                    });
                }
                let Some(Segment::C { to_native, steps, free_py, .. }) = segments.last_mut() else { unreachable!() };
                reads.clear();
                step.visit_reads(&mut |s| reads.push(s));
                for &s in &reads {
                    if !has_native[s] {
                        has_native[s] = true;
                        to_native.push(s);
                    }
                }
                for (_, s) in step.outputs.defined() {
                    (has_py[s], has_native[s]) = (false, true);
                }
                for &s in &step.free {
                    if has_py[s] {
                        free_py.push(s);
                    }
                    (has_py[s], has_native[s]) = (false, false);
                }
                steps.push(step);
            }
        }
    }
    reads.clear();
    graph.outputs.iter().for_each(|a| visit_slots(a, &mut |s| reads.push(s)));
    let mut outputs_to_py = Vec::new();
    for &s in &reads {
        if !has_py[s] {
            has_py[s] = true;
            outputs_to_py.push(s);
        }
    }
    (segments, outputs_to_py)
}

fn slots_of(a: &PyArg, out: &mut Vec<usize>) {
    match a {
        PyArg::Slot(s) => out.push(*s),
        PyArg::Const(_) => {}
        PyArg::List(items) => items.iter().for_each(|i| slots_of(i, out)),
    }
}
