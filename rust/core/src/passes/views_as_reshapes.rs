//! `view` nodes as `reshape`. A graph views tensors whose strides the tracing run's kernels
//! chose; on another device, or with weights in another memory format, the same view can be
//! impossible. `reshape` is that view wherever it is possible, and a copy where it isn't,
//! which for the functional graphs torch.export makes gives the same values.

use crate::schema::Method;

/// Points a method's `view` nodes (subgraphs' too) at the op table's `reshape` entry, or renames the
/// `view` entry where there is none (dropping its recorded schema: it was view's). Returns
/// whether anything changed.
pub fn apply(doc: &mut Method) -> bool {
    let find = |name: &str| doc.ops.iter().position(|o| o.name == name);
    let Some(view) = find("aten::view.default") else { return false };
    let Some(reshape) = find("aten::reshape.default") else {
        doc.ops[view].name = "aten::reshape.default".to_owned();
        doc.ops[view].schema = None;
        return true;
    };
    let graphs = std::iter::once(&mut doc.graph.nodes).chain(doc.subgraphs.values_mut().map(|g| &mut g.nodes));
    for nodes in graphs {
        nodes.iter_mut().filter(|n| n.op == view).for_each(|n| n.op = reshape);
    }
    true
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
        assert!(apply(&mut d));
        assert_eq!(d.graph.nodes.iter().map(|n| n.op).collect::<Vec<_>>(), [1, 2, 1, 1]);
        let mut d = doc(&["aten::view.default"], &[0]);
        assert!(apply(&mut d));
        assert_eq!((d.ops[0].name.as_str(), d.ops[0].schema.as_deref()), ("aten::reshape.default", None));
        assert!(!apply(&mut doc(&["aten::relu.default"], &[0])));
    }
}
