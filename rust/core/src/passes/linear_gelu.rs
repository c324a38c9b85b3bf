//! A measured linear and the GELU after it as one node (`optimize="fast"`, at load, on CUDA
//! with CUDA graphs, after [`linear_measured`](super::linear_measured)). A transformer's MLP
//! is `gelu(linear(x, w, b))`: on CUDA the product (with its bias) and the activation are two
//! kernels. The pair becomes `kwexport::linear_measured.gelu` (`.addmm_gelu` for GPT-2's
//! `Conv1D`), whose Python form (`kwexport._cuda_gemm`) times, the first time it sees a shape,
//! the measured GEMMs with the GELU after each, the bias-free product with the bias and the
//! GELU in one Triton kernel, and, for GELU's tanh form, cuBLASLt's GELU epilogue (one kernel
//! in all), and runs the fastest.

use super::linear_measured::{ADDMM, LINEAR};
use super::pass::{Ctx, Pass};
use super::readers::{may_write, one, sole_reader, Readers};
use super::{Level, Target};
use crate::schema::{Arg, Method, Node, Outputs};

/// The op a measured linear and the GELU of its result become (its arguments, then GELU's
/// `approximate`).
pub const LINEAR_GELU: &str = crate::tables::PASS_OPS[13];
/// The op a measured `addmm` and the GELU of its result become.
pub const ADDMM_GELU: &str = crate::tables::PASS_OPS[14];

/// Fuses each measured linear or `addmm` whose result a GELU alone reads, directly or through
/// a reshape that alone reads it (GPT-2's `Conv1D` views its rows back as tokens), into one
/// node at the GELU's place: the product and its activation, and the reshape (GELU is
/// elementwise, so it commutes with it) bound to the GELU's name. Nothing between them may
/// write, since the input is now read at the GELU's place. Returns how many.
fn gelus(m: &mut Method, readers: &Readers) -> usize {
    let nodes = &m.graph.nodes;
    let op_of = |i: usize| m.ops.get(nodes[i].op).map(|o| o.name.as_str());
    let mut chains = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let fused = match op_of(i) {
            Some(LINEAR) => LINEAR_GELU,
            Some(ADDMM) => ADDMM_GELU,
            _ => continue,
        };
        let (Some(product), Some(mut j)) = (one(n), sole_reader(readers, n)) else { continue };
        let view = matches!(op_of(j), Some("aten::reshape.default" | "aten::view.default")).then_some(j);
        if let Some(v) = view {
            match (nodes[v].args.first(), sole_reader(readers, &nodes[v])) {
                (Some(Arg::Ref(r)), Some(k)) if r == product => j = k,
                _ => continue,
            }
        }
        let gelu = &nodes[j];
        let approximate = match (gelu.args.get(1), gelu.kwargs.get("approximate")) {
            (None, None) => "none",
            (Some(Arg::Str(a)), None) | (None, Some(Arg::Str(a))) if a == "none" || a == "tanh" => a.as_str(),
            _ => continue,
        };
        let plain = gelu.args.len() <= 2 && gelu.kwargs.keys().all(|k| k == "approximate");
        let quiet = (i + 1..j).all(|k| m.ops.get(nodes[k].op).is_some_and(|op| !may_write(op)));
        let (Some(out), true, true, Some("aten::gelu.default")) = (one(gelu), plain, quiet, op_of(j)) else { continue };
        let mut args = n.args.clone();
        args.push(Arg::Str(approximate.into()));
        let new = match view {
            None => vec![(fused.to_owned(), args, out.to_owned())],
            Some(v) => {
                let reshape = (op_of(v).unwrap_or_default().to_owned(), nodes[v].args.clone(), out.to_owned());
                vec![(fused.to_owned(), args, product.to_owned()), reshape]
            }
        };
        chains.push(([Some(i), view, Some(j)].into_iter().flatten().collect::<Vec<_>>(), new));
    }
    let made = chains.len();
    let chains = chains
        .into_iter()
        .map(|(chain, new)| {
            let new = new.into_iter().map(|(op, args, out)| Node {
                op: super::op_index(&mut m.ops, &op),
                args,
                kwargs: Default::default(),
                outputs: Outputs::One(out),
            });
            (chain, new.collect())
        })
        .collect();
    super::replace_chains(&mut m.graph.nodes, chains);
    made
}

/// The pass (`fast`, on CUDA with CUDA graphs).
pub struct LinearGelu;

impl Pass for LinearGelu {
    fn name(&self) -> &'static str {
        "linear_gelu"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.cuda_graphs
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, readers, _| gelus(m, readers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::linear_measured::{self, tests::method};

    fn refs(names: &[&str]) -> Vec<Arg> {
        names.iter().map(|n| Arg::Ref((*n).into())).collect()
    }

    /// `method` over [`GELU_OPS`], each node binding the name given (`None`: nothing), the
    /// last name bound returned.
    fn bound(nodes: Vec<(usize, Vec<Arg>, Option<&str>)>) -> Method {
        let mut m = method(&GELU_OPS, nodes.iter().map(|(op, args, _)| (*op, args.clone())).collect());
        for (n, (_, _, out)) in m.graph.nodes.iter_mut().zip(&nodes) {
            n.outputs = out.map_or(Outputs::None(()), |o| Outputs::One(o.into()));
        }
        // The in-place add writes its first argument.
        m.ops[4].schema = Some("aten::add_.Tensor(Tensor(a!) self, Tensor other) -> Tensor(a!)".into());
        m.graph.outputs =
            nodes.iter().filter_map(|(_, _, out)| out.map(|o| Arg::Ref(o.into()))).next_back().into_iter().collect();
        m
    }

    fn fuse(m: &mut Method) -> usize {
        let r = crate::passes::readers::readers(&m.graph);
        linear_measured::apply(m) + gelus(m, &r)
    }

    const GELU_OPS: [&str; 5] = [
        "aten::linear.default",
        "aten::addmm.default",
        "aten::gelu.default",
        "aten::reshape.default",
        "aten::add_.Tensor",
    ];

    #[test]
    fn a_gelu_that_alone_reads_the_product_joins_it() {
        let tanh = Arg::Str("tanh".into());
        let mut m = bound(vec![
            (0, refs(&["x", "w", "b"]), Some("y")),
            (2, vec![refs(&["y"])[0].clone(), tanh.clone()], Some("g")),
        ]);
        assert_eq!(fuse(&mut m), 2);
        let names: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(names, [LINEAR_GELU]);
        assert_eq!(m.graph.nodes[0].args, [refs(&["x", "w", "b"]), vec![tanh]].concat());
        assert_eq!(m.graph.nodes[0].outputs, Outputs::One("g".into()));
        // GPT-2's Conv1D: addmm, a reshape back to tokens, then the GELU (exact: no argument).
        let shape = Arg::List(vec![Arg::Int(2), Arg::Int(-1)]);
        let mut m = bound(vec![
            (1, refs(&["b", "x", "w"]), Some("y")),
            (3, vec![Arg::Ref("y".into()), shape.clone()], Some("r")),
            (2, refs(&["r"]), Some("g")),
        ]);
        assert_eq!(fuse(&mut m), 2);
        let names: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(names, [ADDMM_GELU, "aten::reshape.default"]);
        assert_eq!(m.graph.nodes[0].args, [refs(&["b", "x", "w"]), vec![Arg::Str("none".into())]].concat());
        assert_eq!(m.graph.nodes[0].outputs, Outputs::One("y".into()));
        assert_eq!(m.graph.nodes[1].args, [Arg::Ref("y".into()), shape]);
        assert_eq!(m.graph.nodes[1].outputs, Outputs::One("g".into()));
        assert_eq!(fuse(&mut m), 0, "nothing is found twice");
    }

    #[test]
    fn a_gelu_stays_apart_where_the_product_is_read_again_or_something_writes_between() {
        let cases = [
            // The product read again.
            vec![(0, refs(&["x", "w", "b"]), Some("y")), (2, refs(&["y"]), Some("g")), (4, refs(&["y", "x"]), None)],
            // A write between the product and the GELU.
            vec![(0, refs(&["x", "w", "b"]), Some("y")), (4, refs(&["x", "x"]), None), (2, refs(&["y"]), Some("g"))],
            // Another approximation than torch's two.
            vec![
                (0, refs(&["x", "w", "b"]), Some("y")),
                (2, vec![Arg::Ref("y".into()), Arg::Str("erf".into())], Some("g")),
            ],
        ];
        for nodes in cases {
            let mut m = bound(nodes);
            assert_eq!(fuse(&mut m), 1, "the linear is measured");
            assert!(m.graph.nodes.iter().any(|n| m.ops[n.op].name == "aten::gelu.default"));
        }
    }

    #[test]
    fn runs_only_with_cuda_graphs() {
        assert!(LinearGelu.runs_for(Target { cuda_graphs: true, ..Target::default() }));
        assert!(!LinearGelu.runs_for(Target { onednn: true, gemm: true, in_place: true, cuda_graphs: false }));
    }
}
