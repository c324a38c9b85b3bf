//! The cost model of `dispatch="auto"`: a run of C-capable nodes goes to the C path only if
//! it saves more than converting values into and out of it costs.

use std::collections::HashSet;

use kwexport_core::graph::{visit_slots, SlotGraph};

use super::{CStep, Why};

// Rough costs in tenths of a microsecond (2-core x86 VM, small tensors): a node through the
// C ABI saves about 1 µs over torch's Python op object on torch 2.15 (`x + y * z` by keyword:
// 4.5 µs a call on the C path, 6.3 through Python; 0.5 µs on torch 2.13); a value crossing
// between the paths costs about 0.2 µs to a handle and 0.3 µs to a Python tensor; a change
// of path about 0.2 µs (a lone `mul` between two Python nodes: a tie, 11.6 µs against 11.4).
const SAVED_PER_NODE: usize = 10;
const TO_NATIVE: usize = 2;
const TO_PY: usize = 3;
const SWITCH: usize = 2;

/// Sends a run of C-capable nodes back to Python where converting values into and out of
/// it would cost more than it saves: a lone `mul` between two Python `add`s, say.
pub(super) fn keep_profitable(compiled: &mut [Result<CStep, Why>], graph: &SlotGraph) {
    // The last node that reads each slot; the outputs read "after" every node.
    let mut last_read = vec![None; graph.n_slots];
    for (i, node) in graph.nodes.iter().enumerate() {
        node.visit_reads(&mut |s| last_read[s] = Some(i));
    }
    graph.outputs.iter().for_each(|a| visit_slots(a, &mut |s| last_read[s] = Some(usize::MAX)));

    let mut start = 0;
    while start < compiled.len() {
        if compiled[start].is_err() {
            start += 1;
            continue;
        }
        let end = (start..compiled.len()).find(|&i| compiled[i].is_err()).unwrap_or(compiled.len());
        let mut defined = HashSet::new();
        let (mut to_native, mut to_py) = (HashSet::new(), 0);
        for node in &graph.nodes[start..end] {
            node.visit_reads(&mut |s| {
                if !defined.contains(&s) {
                    to_native.insert(s);
                }
            });
            defined.extend(node.outputs.defined().map(|(_, s)| s));
        }
        for &s in &defined {
            if last_read[s].is_some_and(|r| r >= end) {
                to_py += 1;
            }
        }
        let cost = 2 * SWITCH + TO_NATIVE * to_native.len() + TO_PY * to_py;
        if cost > SAVED_PER_NODE * (end - start) {
            compiled[start..end].iter_mut().for_each(|c| *c = Err(Why::NotWorthIt));
        }
        start = end;
    }
}
