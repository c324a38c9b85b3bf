//! A convolution's bias, the residual added to it and the ReLU after as one node
//! (`optimize="fast"`, at load, on CUDA with CUDA graphs; after `batch_norm`, which gives a
//! ResNet's convolutions their bias). torch runs a biased convolution on CUDA as cuDNN's
//! product, then the bias added in a kernel of its own; a ResNet then adds the residual and
//! applies the ReLU, a kernel each:
//!
//! ```text
//! y = conv2d(x, w, b, ...); s = add_(y, r); z = relu_(s)      # or conv2d → relu_
//! ```
//!
//! At batch 1 on a GPU those small elementwise kernels cost as much as the convolutions. The
//! chain becomes `z = kwexport::conv_epilogue(x, w, b, stride, padding, dilation, groups, r,
//! relu)`, whose Python form (`kwexport._cuda_fused`) runs the bias-free convolution and one
//! Triton kernel for the bias, the residual and the ReLU.
//!
//! The node goes where the chain's last one was, so nothing between the convolution and it
//! may write (its input is now read there); each value of the chain is read only by the next
//! node; an in-place add writes the convolution's output, never the residual.

use super::pass::{Ctx, Pass};
use super::readers::{may_write, one, sole_reader, Readers};
use super::{Level, Target};
use crate::schema::{Arg, Method, Node, Outputs};

/// The op the chain becomes.
pub const CONV_EPILOGUE: &str = crate::tables::PASS_OPS[15];

/// conv2d's arguments after the weight and the bias, with their defaults.
fn conv_args(n: &Node) -> Option<[Arg; 4]> {
    if !n.kwargs.is_empty() || n.args.len() > 7 {
        return None;
    }
    let pair = |v: i64| Arg::List(vec![Arg::Int(v), Arg::Int(v)]);
    let at = |k: usize, default: Arg| n.args.get(k).cloned().unwrap_or(default);
    Some([at(3, pair(1)), at(4, pair(0)), at(5, pair(1)), at(6, Arg::Int(1))])
}

/// Fuses each chain of the method's top-level graph; returns how many.
fn rewrite(m: &mut Method, readers: &Readers) -> usize {
    let nodes = &m.graph.nodes;
    let op_of = |i: usize| m.ops.get(nodes[i].op).map(|o| o.name.as_str());
    let is_relu = |i: usize| matches!(op_of(i), Some("aten::relu.default" | "aten::relu_.default"));
    let mut chains = Vec::new();
    for (i, conv) in nodes.iter().enumerate() {
        if op_of(i) != Some("aten::conv2d.default") {
            continue;
        }
        let (Some(Arg::Ref(_)), Some(Arg::Ref(_)), Some(Arg::Ref(_)), Some(y), Some(rest)) =
            (conv.args.first(), conv.args.get(1), conv.args.get(2), one(conv), conv_args(conv))
        else {
            continue;
        };
        let Some(next) = sole_reader(readers, conv) else { continue };
        let mut chain = vec![i, next];
        let residual = match (op_of(next), nodes[next].args.as_slice()) {
            (Some("aten::add_.Tensor"), [Arg::Ref(a), r @ Arg::Ref(_)]) if a == y => Some(r.clone()),
            (Some("aten::add.Tensor"), [Arg::Ref(a), r @ Arg::Ref(_)]) if a == y => Some(r.clone()),
            (Some("aten::add.Tensor"), [r @ Arg::Ref(_), Arg::Ref(b)]) if b == y => Some(r.clone()),
            _ if is_relu(next) && nodes[next].args.len() == 1 => None,
            _ => continue,
        };
        if !nodes[next].kwargs.is_empty() || residual.as_ref() == Some(&Arg::Ref(y.to_owned())) {
            continue;
        }
        if residual.is_some() {
            let relu = sole_reader(readers, &nodes[next]).filter(|&k| is_relu(k) && nodes[k].args.len() == 1);
            chain.extend(relu);
        }
        let relu = is_relu(*chain.last().unwrap_or(&i));
        let last = *chain.last().unwrap_or(&i);
        let quiet = (i + 1..last)
            .filter(|k| !chain.contains(k))
            .all(|k| m.ops.get(nodes[k].op).is_some_and(|op| !may_write(op)));
        let (true, Some(out)) = (quiet, one(&nodes[last])) else { continue };
        let mut args = conv.args[..3].to_vec();
        args.extend(rest);
        args.extend([residual.unwrap_or(Arg::None(())), Arg::Bool(relu)]);
        chains.push((chain, args, out.to_owned()));
    }
    if chains.is_empty() {
        return 0;
    }
    let (op, made) = (super::op_index(&mut m.ops, CONV_EPILOGUE), chains.len());
    let chains = chains.into_iter().map(|(chain, args, out)| {
        (chain, vec![Node { op, args, kwargs: Default::default(), outputs: Outputs::One(out) }])
    });
    super::replace_chains(&mut m.graph.nodes, chains.collect());
    made
}

/// The pass (`fast`, on CUDA with CUDA graphs).
pub struct ConvEpilogue;

impl Pass for ConvEpilogue {
    fn name(&self) -> &'static str {
        "conv_epilogue"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.cuda_graphs
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, readers, _| rewrite(m, readers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::readers::readers;
    use serde_json::json;

    const OPS: [&str; 5] =
        ["aten::conv2d.default", "aten::add_.Tensor", "aten::relu_.default", "aten::add.Tensor", "aten::neg.default"];

    /// A method over [`OPS`] (the in-place ones marked as writing) with `nodes`, returning the
    /// last node's value.
    fn method(nodes: serde_json::Value) -> Method {
        let schema =
            |name: &str| if name.contains("_.") { "f(Tensor(a!) self, Tensor other) -> Tensor(a!)" } else { "s" };
        let ops: Vec<_> = OPS.iter().map(|n| json!({"name": n, "schema": schema(n)})).collect();
        let last = nodes.as_array().unwrap().last().unwrap()["outputs"]["one"].clone();
        serde_json::from_value(json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": ops,
            "graph": {
                "inputs": [{"name": "x", "source": {"user": 0}}, {"name": "r", "source": {"user": 1}},
                           {"name": "w", "source": {"weight": "c.weight"}}, {"name": "b", "source": {"weight": "c.bias"}}],
                "nodes": nodes,
                "outputs": [{"ref": last}]}
        }))
        .unwrap()
    }

    fn conv(out: &str) -> serde_json::Value {
        let pair = |v: i64| json!({"list": [{"int": v}, {"int": v}]});
        json!({"op": 0, "args": [{"ref": "x"}, {"ref": "w"}, {"ref": "b"}, pair(2), pair(1)], "outputs": {"one": out}})
    }

    fn node(op: usize, args: &[&str], out: &str) -> serde_json::Value {
        let args: Vec<_> = args.iter().map(|a| json!({"ref": a})).collect();
        json!({"op": op, "args": args, "outputs": {"one": out}})
    }

    fn run(m: &mut Method) -> usize {
        let r = readers(&m.graph);
        rewrite(m, &r)
    }

    fn args(m: &Method) -> Vec<Arg> {
        m.graph.nodes.iter().find(|n| m.ops[n.op].name == CONV_EPILOGUE).unwrap().args.clone()
    }

    #[test]
    fn a_residual_block_and_a_relu_become_one_node() {
        let mut m = method(json!([conv("y"), node(4, &["x"], "n"), node(1, &["y", "r"], "s"), node(2, &["s"], "z")]));
        assert_eq!(run(&mut m), 1);
        let names: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(names, ["aten::neg.default", CONV_EPILOGUE]);
        let pair = |v: i64| Arg::List(vec![Arg::Int(v), Arg::Int(v)]);
        let refs = |s: &str| Arg::Ref(s.into());
        // Dilation and groups written out; the residual; the ReLU.
        let want =
            [refs("x"), refs("w"), refs("b"), pair(2), pair(1), pair(1), Arg::Int(1), refs("r"), Arg::Bool(true)];
        assert_eq!(args(&m), want);
        assert_eq!(m.graph.nodes[1].outputs, Outputs::One("z".into()));
        assert_eq!(run(&mut m), 0, "nothing is found twice");
        // A ReLU alone, and an add (either order) without one.
        let mut m = method(json!([conv("y"), node(2, &["y"], "z")]));
        assert_eq!(run(&mut m), 1);
        assert_eq!(args(&m)[7..], [Arg::None(()), Arg::Bool(true)]);
        let mut m = method(json!([conv("y"), node(3, &["r", "y"], "z")]));
        assert_eq!(run(&mut m), 1);
        assert_eq!(args(&m)[7..], [refs("r"), Arg::Bool(false)]);
    }

    #[test]
    fn leaves_near_misses_alone() {
        let unbiased = {
            let mut c = conv("y");
            c["args"][2] = json!({"none": null});
            c
        };
        let cases = [
            // No bias: cuDNN's product alone, nothing to fuse.
            json!([unbiased, node(2, &["y"], "z")]),
            // The output read twice.
            json!([conv("y"), node(2, &["y"], "z"), node(3, &["y", "z"], "q")]),
            // An in-place add into the residual (it writes `r`).
            json!([conv("y"), node(1, &["r", "y"], "z")]),
            // A write between the convolution and the node.
            json!([conv("y"), node(1, &["x", "r"], "x2"), node(2, &["y"], "z")]),
            // Nothing to fuse.
            json!([conv("y"), node(4, &["y"], "z")]),
        ];
        for nodes in cases {
            let mut m = method(nodes.clone());
            assert_eq!(run(&mut m), 0, "{nodes}");
        }
    }

    #[test]
    fn runs_only_with_cuda_graphs() {
        assert!(ConvEpilogue.runs_for(Target { cuda_graphs: true, ..Target::default() }));
        assert!(!ConvEpilogue.runs_for(Target { onednn: true, gemm: true, in_place: true, cuda_graphs: false }));
    }
}
