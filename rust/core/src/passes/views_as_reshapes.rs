//! `view` nodes as `reshape`. A graph views tensors whose strides the tracing run's kernels
//! chose; on another device, or with weights in another memory format, the same view can be
//! impossible. `reshape` is that view wherever it is possible, and a copy where it isn't,
//! which for the functional graphs torch.export makes gives the same values.

use super::pass::{Ctx, Pass};
use super::Level;
use crate::schema::Method;

/// Points a method's `view` nodes (subgraphs' too) at the op table's `reshape` entry, or renames the
/// `view` entry where there is none (dropping its recorded schema: it was view's). Returns
/// how many nodes (or the one entry) changed.
pub fn apply(doc: &mut Method) -> usize {
    let find = |name: &str| doc.ops.iter().position(|o| o.name == name);
    let Some(view) = find("aten::view.default") else { return 0 };
    let Some(reshape) = find("aten::reshape.default") else {
        doc.ops[view].name = "aten::reshape.default".to_owned();
        doc.ops[view].schema = None;
        return 1;
    };
    let graphs = std::iter::once(&mut doc.graph.nodes).chain(doc.subgraphs.values_mut().map(|g| &mut g.nodes));
    let mut changed = 0;
    for n in graphs.flatten().filter(|n| n.op == view) {
        n.op = reshape;
        changed += 1;
    }
    changed
}

/// The pass (`fast`).
pub struct ViewsAsReshapes;

impl Pass for ViewsAsReshapes {
    fn name(&self) -> &'static str {
        "views_as_reshapes"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, _, _| apply(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{Node, OpEntry, Outputs};

    fn doc(ops: &[&str], node_ops: &[usize]) -> Method {
        let bytes = crate::artifact::tests::file(|_| {});
        let mut d = crate::parse(&bytes).unwrap().document.methods.remove("forward").unwrap();
        d.ops = ops.iter().map(|n| OpEntry { name: (*n).into(), schema: Some("s".into()) }).collect();
        d.graph.nodes = node_ops
            .iter()
            .map(|&op| Node { op, args: vec![], kwargs: Default::default(), outputs: Outputs::None(()) })
            .collect();
        d
    }

    #[test]
    fn views_point_at_reshape_or_become_it() {
        let mut d = doc(&["aten::view.default", "aten::reshape.default", "aten::relu.default"], &[0, 2, 0, 1]);
        assert_eq!(apply(&mut d), 2);
        assert_eq!(d.graph.nodes.iter().map(|n| n.op).collect::<Vec<_>>(), [1, 2, 1, 1]);
        // Done: the `view` entry stays in the table, read by nothing, and nothing changes.
        assert_eq!(apply(&mut d), 0);
        let mut d = doc(&["aten::view.default"], &[0]);
        assert_eq!(apply(&mut d), 1);
        assert_eq!((d.ops[0].name.as_str(), d.ops[0].schema.as_deref()), ("aten::reshape.default", None));
        assert_eq!(apply(&mut d), 0);
        assert_eq!(apply(&mut doc(&["aten::relu.default"], &[0])), 0);
    }
}
