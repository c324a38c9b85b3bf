//! Where a program runs: the device given at load, or the one it was exported on. Placing a
//! program moves its weights there once (on the CPU they stay views of the mapped file),
//! points the graph's device literals (`arange(..., device=cpu)`, `to(cpu)`) of the exported
//! device's type at it, and makes the input checks expect it.

use std::collections::BTreeMap;

use kwexport_core::graph::{SlotArg, SlotGraph};
use kwexport_core::schema::Arg;
use pyo3::prelude::*;

/// The exported device and the one the program is placed on, as torch prints them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Where it was exported (its tensor inputs' device).
    pub home: String,
    /// Where it runs.
    pub target: String,
}

impl Placement {
    /// `target` (a normalized torch device string) or, without one, the home device.
    pub fn new(home: &str, target: Option<&str>) -> Placement {
        Placement { home: home.to_owned(), target: target.unwrap_or(home).to_owned() }
    }

    /// Whether the program moves.
    pub fn moves(&self) -> bool {
        self.home != self.target
    }

    /// Whether it moves to another kind of device, whose kernels may lay out their outputs
    /// differently (CUDA's attention returns other strides than the CPU's).
    pub fn changes_kind(&self) -> bool {
        device_type(&self.home) != device_type(&self.target)
    }

    /// On another kind of device, `view` nodes become `reshape`: that device's kernels may
    /// choose other strides than the exporting one's (see `passes::views_as_reshapes`).
    pub fn adapt_ops(&self, doc: &mut kwexport_core::schema::Method) {
        if self.changes_kind() {
            kwexport_core::passes::views_as_reshapes::apply(doc);
        }
    }

    /// The device a literal of the graph means once placed: the target for a device of the
    /// home device's type, else the literal's own.
    pub fn place<'a>(&'a self, literal: &'a str) -> &'a str {
        if device_type(literal) == device_type(&self.home) {
            &self.target
        } else {
            literal
        }
    }

    /// Rewrites the graph's device literals (see [`Placement::place`]).
    pub fn place_literals(&self, graph: &mut SlotGraph) {
        fn visit(p: &Placement, a: &mut SlotArg) {
            match a {
                SlotArg::Literal(Arg::Device(d)) => *d = p.place(d).to_owned(),
                SlotArg::List(items) => items.iter_mut().for_each(|i| visit(p, i)),
                _ => {}
            }
        }
        for node in &mut graph.nodes {
            node.args.iter_mut().chain(node.kwargs.iter_mut().map(|(_, a)| a)).for_each(|a| visit(self, a));
        }
    }

    /// Copies the weights to the target, once.
    pub fn place_weights(&self, py: Python<'_>, weights: &mut BTreeMap<String, Py<PyAny>>) -> PyResult<()> {
        for t in weights.values_mut() {
            *t = t.bind(py).call_method1("to", (self.target.as_str(),))?.unbind();
        }
        Ok(())
    }
}

/// `cuda` for `cuda:1`.
fn device_type(d: &str) -> &str {
    d.split(':').next().unwrap_or(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_of_the_home_type_follow_the_target() {
        let p = Placement::new("cpu", Some("cuda:1"));
        assert!(p.moves());
        assert_eq!(p.place("cpu"), "cuda:1");
        assert_eq!(p.place("meta"), "meta");
        let q = Placement::new("cuda:0", Some("cuda:1"));
        assert_eq!(q.place("cuda"), "cuda:1");
        assert_eq!(q.place("cpu"), "cpu");
        assert!(!Placement::new("cpu", None).moves());
    }
}
