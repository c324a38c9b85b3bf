//! Biased linears whose GEMM is chosen on the device (`optimize="fast"`, at load, on CUDA
//! with CUDA graphs). A biased `linear` (or `addmm(bias, x, w)`, GPT-2's `Conv1D`) on CUDA runs
//! cuBLASLt with the bias as an epilogue, whose heuristic picks, for some batch-1 shapes, a
//! kernel twice as slow as the one plain cuBLAS picks for the bias-free product (BERT-base's
//! 128 × 768 projections in float32 on an H200: 30.7 µs against 15 + 4; `torch.compile` calls
//! the bias-free `mm` and adds the bias in a kernel of its own). Which one wins depends on the
//! shape, the dtype and the GPU, so the node becomes `kwexport::linear_measured`, whose
//! Python form (`kwexport._cuda_gemm`) times the candidates on the device the first time it
//! sees a shape outside a capture and runs the fastest from then on.
//!
//! Only with CUDA graphs: a candidate without the epilogue launches one more kernel, which a
//! replay launches for free but a call launched node by node pays on the host. The node
//! computes what the exported op computes (the same product and bias), so it runs anywhere;
//! only float rounding (the order of the sums, where the bias is added) differs.

use super::pass::{Ctx, Pass};
use super::{Level, Target};
use crate::schema::{Arg, Method, Node};

/// The op a biased `linear` becomes (the same arguments).
pub const LINEAR: &str = crate::tables::PASS_OPS[6];
/// The op a biased `addmm` becomes (the same arguments: bias, input, `[k, n]` weight).
pub const ADDMM: &str = crate::tables::PASS_OPS[7];

/// Points each biased `linear` and each `addmm` without `beta`/`alpha` of a method (its
/// subgraphs' too) at the measured ops; returns how many nodes changed.
pub fn apply(m: &mut Method) -> usize {
    // Three tensors, nothing else: a bias given, `beta` and `alpha` left at 1.
    let biased = |n: &Node| n.args.len() == 3 && n.kwargs.is_empty() && n.args.iter().all(|a| matches!(a, Arg::Ref(_)));
    // Each exported op some qualifying node runs, with the op it becomes (an entry added only then).
    let mut to = Vec::new();
    for (from, name) in [("aten::linear.default", LINEAR), ("aten::addmm.default", ADDMM)] {
        let Some(from) = m.ops.iter().position(|o| o.name == from) else { continue };
        let mut nodes = m.graph.nodes.iter().chain(m.subgraphs.values().flat_map(|g| g.nodes.iter()));
        if nodes.any(|n| n.op == from && biased(n)) {
            to.push((from, super::op_index(&mut m.ops, name)));
        }
    }
    let subgraph_nodes = m.subgraphs.values_mut().flat_map(|g| g.nodes.iter_mut());
    let mut changed = 0;
    for n in m.graph.nodes.iter_mut().chain(subgraph_nodes) {
        if let Some(&(_, op)) = to.iter().find(|(from, _)| *from == n.op).filter(|_| biased(n)) {
            n.op = op;
            changed += 1;
        }
    }
    changed
}

/// The pass (`fast`, on CUDA with CUDA graphs).
pub struct LinearMeasured;

impl Pass for LinearMeasured {
    fn name(&self) -> &'static str {
        "linear_measured"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.cuda_graphs
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, _, _| apply(m))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::schema::{Node, OpEntry, Outputs};

    fn refs(names: &[&str]) -> Vec<Arg> {
        names.iter().map(|n| Arg::Ref((*n).into())).collect()
    }

    pub(crate) fn method(ops: &[&str], nodes: Vec<(usize, Vec<Arg>)>) -> Method {
        let bytes = crate::artifact::tests::file(|_| {});
        let mut m = crate::parse(&bytes).unwrap().document.methods.remove("forward").unwrap();
        m.ops = ops.iter().map(|n| OpEntry { name: (*n).into(), schema: Some("s".into()) }).collect();
        m.graph.nodes = nodes
            .into_iter()
            .map(|(op, args)| Node { op, args, kwargs: Default::default(), outputs: Outputs::None(()) })
            .collect();
        m
    }

    #[test]
    fn biased_linears_and_addmms_become_the_measured_ops() {
        let ops = ["aten::linear.default", "aten::addmm.default", "aten::relu.default"];
        let mut m = method(
            &ops,
            vec![
                (0, refs(&["x", "w", "b"])),
                (1, refs(&["b", "x", "w"])),
                (2, refs(&["x"])),
                // Without a bias (cuBLAS's plain product already), or with a literal one.
                (0, refs(&["x", "w"])),
                (0, vec![Arg::Ref("x".into()), Arg::Ref("w".into()), Arg::None(())]),
            ],
        );
        assert_eq!(apply(&mut m), 2);
        let names: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(names, [LINEAR, ADDMM, ops[2], ops[0], ops[0]]);
        // Arguments unchanged: the measured ops take the exported ones.
        assert_eq!(m.graph.nodes[1].args, refs(&["b", "x", "w"]));
        assert_eq!(apply(&mut m), 0, "nothing is found twice");
    }

    #[test]
    fn an_addmm_with_beta_or_alpha_stays() {
        let mut m = method(&["aten::addmm.default"], vec![(0, refs(&["b", "x", "w"]))]);
        m.graph.nodes[0].kwargs.insert("beta".into(), Arg::Int(2));
        assert_eq!(apply(&mut m), 0);
        assert_eq!(m.ops.len(), 1, "no op entry is added for nothing");
    }

    #[test]
    fn runs_only_with_cuda_graphs() {
        assert!(LinearMeasured.runs_for(Target { cuda_graphs: true, ..Target::default() }));
        assert!(!LinearMeasured.runs_for(Target { onednn: true, gemm: true, in_place: true, cuda_graphs: false }));
    }
}
