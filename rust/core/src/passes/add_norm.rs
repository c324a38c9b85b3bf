//! A residual add and the norm that reads it as one node (`optimize="fast"`, on CUDA with
//! CUDA graphs). Every transformer block ends a sublayer with
//!
//! ```text
//! s = add(x, residual); y = layer_norm(s, [n], w, b, eps)     # or rms_norm(s, [n], w, eps),
//!                                                             # or rms_norm(to(s, dtype), ...)
//! ```
//!
//! two kernels, the second reading back what the first wrote. At batch 1 on a GPU a call is
//! bound by its kernels' count, so the pair becomes `kwexport::add_norm.layer_norm` (or
//! `.rms_norm`), which returns `(y, s)` (`.rms_norm`: `(y, s, to(s, dtype))`): one Triton
//! kernel (`kwexport._cuda_fused`) that writes the sum (a pre-norm model reads it again, as
//! the next residual) and the norm.
//!
//! The three nodes must be consecutive, so that nothing runs between the add and the norm
//! (an in-place op on `x` there would change what a later add reads); the `to`, where there
//! is one, only casts (`rms_norm::cast_to`), and what else reads the sum or its cast reads it
//! after the norm.

use super::pass::{Ctx, Pass};
use super::readers::{one, Readers};
use super::{Level, Target};
use crate::schema::{Arg, Float, Method, Node, Outputs};

/// The op a residual add and its layer norm become.
pub const LAYER_NORM: &str = crate::tables::PASS_OPS[8];
/// The op a residual add and its RMS norm become.
pub const RMS_NORM: &str = crate::tables::PASS_OPS[9];

/// A pair found: the add's, the cast's and the norm's indices (the norm's last, replaced),
/// and the fused node's op, arguments and outputs.
type Found = (Vec<usize>, (&'static str, Vec<Arg>, Outputs));

/// Fuses each add → norm pair of the method's top-level graph; returns how many.
fn rewrite(m: &mut Method, readers: &Readers) -> usize {
    let found = find(m, readers);
    let made = found.len();
    let chains = found.into_iter().map(|(chain, (op, args, outputs))| {
        let op = super::op_index(&mut m.ops, op);
        (chain, vec![Node { op, args, kwargs: Default::default(), outputs }])
    });
    let chains = chains.collect();
    super::replace_chains(&mut m.graph.nodes, chains);
    made
}

/// Every pair. Pairs share no node: each norm reads one add, through at most one cast.
fn find(m: &Method, readers: &Readers) -> Vec<Found> {
    let nodes = &m.graph.nodes;
    let op_of = |i: usize| m.ops.get(nodes[i].op).map(|o| o.name.as_str());
    // Only positional tensors and literals: kwargs would need the schema's names.
    let plain = |n: &Node| n.kwargs.is_empty();
    let mut found = Vec::new();
    for (i, norm) in nodes.iter().enumerate() {
        let rms = match op_of(i) {
            Some("aten::layer_norm.default") => false,
            Some("aten::rms_norm.default") => true,
            _ => continue,
        };
        let (Some(Arg::Ref(input)), Some(Arg::List(shape)), Some(y)) = (norm.args.first(), norm.args.get(1), one(norm))
        else {
            continue;
        };
        if !plain(norm) || !matches!(shape.as_slice(), [Arg::Int(_)]) {
            continue;
        }
        // The node before the norm is the cast, if it makes the norm's input.
        let cast = i.checked_sub(1).filter(|&c| {
            op_of(c) == Some("aten::to.dtype")
                && one(&nodes[c]) == Some(input.as_str())
                && super::rms_norm::cast_to(&nodes[c]).is_some()
                && plain(&nodes[c])
        });
        if cast.is_some() && !rms {
            continue;
        }
        // A node after the norm, or the graph's outputs, reading `v` again: the fused node binds
        // it too.
        let read_again = |v: &str| readers.get(v).is_some_and(|r| r.iter().any(|&j| j > i));
        let summed = match (cast, &nodes[cast.unwrap_or(i)].args[0]) {
            (Some(_), Arg::Ref(s)) => s.as_str(),
            (Some(_), _) => continue,
            (None, _) => input.as_str(),
        };
        // What reads the cast reads it after the norm (a float32 Llama's residual: its no-op
        // cast to float32).
        if cast.is_some() && readers.get(input.as_str()).is_some_and(|r| r.iter().any(|&j| j < i)) {
            continue;
        }
        let Some(a) = cast.unwrap_or(i).checked_sub(1) else { continue };
        let add = &nodes[a];
        let (Some("aten::add.Tensor"), Some(s), [Arg::Ref(_), Arg::Ref(_)]) = (op_of(a), one(add), add.args.as_slice())
        else {
            continue;
        };
        if s != summed || !plain(add) {
            continue;
        }
        let mut outputs = vec![Some(y.to_owned()), read_again(s).then(|| s.to_owned())];
        let mut args = add.args.clone();
        args.push(norm.args[1].clone());
        let at = |k: usize, default: Arg| norm.args.get(k).cloned().unwrap_or(default);
        let node = if rms {
            args.extend([at(2, Arg::None(())), at(3, Arg::None(()))]);
            args.push(cast.map_or(Arg::None(()), |c| nodes[c].args[1].clone()));
            outputs.push(cast.and_then(|_| read_again(input).then(|| input.clone())));
            (RMS_NORM, args, Outputs::Many(outputs))
        } else {
            // layer_norm's `cudnn_enable` (its sixth) changes nothing on any device.
            args.extend([at(2, Arg::None(())), at(3, Arg::None(())), at(4, Arg::Float(Float(1e-5)))]);
            (LAYER_NORM, args, Outputs::Many(outputs))
        };
        found.push(([Some(a), cast, Some(i)].into_iter().flatten().collect(), node));
    }
    found
}

/// The pass (`fast`, on CUDA with CUDA graphs).
pub struct AddNorm;

impl Pass for AddNorm {
    fn name(&self) -> &'static str {
        "add_norm"
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

    /// `s = add(x, r); y = layer_norm(s, [8], w, b, 1e-12)`, then `mutate`.
    fn method(mutate: impl FnOnce(&mut serde_json::Value)) -> Method {
        let mut m = json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": "aten::add.Tensor", "schema": "s"}, {"name": "aten::layer_norm.default", "schema": "s"},
                    {"name": "aten::rms_norm.default", "schema": "s"}, {"name": "aten::to.dtype", "schema": "s"},
                    {"name": "aten::relu.default", "schema": "s"}],
            "graph": {
                "inputs": [{"name": "w", "source": {"weight": "ln.weight"}}, {"name": "b", "source": {"weight": "ln.bias"}},
                           {"name": "x", "source": {"user": 0}}, {"name": "r", "source": {"user": 1}}],
                "nodes": [
                    {"op": 0, "args": [{"ref": "x"}, {"ref": "r"}], "outputs": {"one": "s"}},
                    {"op": 1, "args": [{"ref": "s"}, {"list": [{"int": 8}]}, {"ref": "w"}, {"ref": "b"}, {"float": 1e-12}],
                     "outputs": {"one": "y"}}],
                "outputs": [{"ref": "y"}]}
        });
        mutate(&mut m);
        serde_json::from_value(m).unwrap()
    }

    fn run(m: &mut Method) -> usize {
        let r = readers(&m.graph);
        rewrite(m, &r)
    }

    fn names(m: &Method) -> Vec<&str> {
        m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect()
    }

    #[test]
    fn an_add_and_its_layer_norm_become_one_node() {
        let mut m = method(|_| {});
        assert_eq!(run(&mut m), 1);
        assert_eq!(names(&m), [LAYER_NORM]);
        let n = &m.graph.nodes[0];
        let refs = |s: &str| Arg::Ref(s.into());
        let shape = Arg::List(vec![Arg::Int(8)]);
        assert_eq!(n.args, [refs("x"), refs("r"), shape, refs("w"), refs("b"), Arg::Float(Float(1e-12))]);
        // Nothing else reads the sum: it isn't bound.
        assert_eq!(n.outputs, Outputs::Many(vec![Some("y".into()), None]));
        assert_eq!(run(&mut m), 0, "nothing is found twice");
    }

    #[test]
    fn a_sum_read_again_is_bound_and_defaults_are_written_out() {
        let mut m = method(|m| {
            m["graph"]["nodes"][1]["args"] = json!([{"ref": "s"}, {"list": [{"int": 8}]}]);
            m["graph"]["nodes"]
                .as_array_mut()
                .unwrap()
                .push(json!({"op": 4, "args": [{"ref": "s"}], "outputs": {"one": "z"}}));
            m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "z"}]);
        });
        assert_eq!(run(&mut m), 1);
        assert_eq!(names(&m), [LAYER_NORM, "aten::relu.default"]);
        let n = &m.graph.nodes[0];
        assert_eq!(n.args[3..], [Arg::None(()), Arg::None(()), Arg::Float(Float(1e-5))]);
        assert_eq!(n.outputs, Outputs::Many(vec![Some("y".into()), Some("s".into())]));
    }

    #[test]
    fn an_rms_norm_through_its_cast() {
        let mut m = method(|m| {
            let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
            nodes.insert(1, json!({"op": 3, "args": [{"ref": "s"}, {"dtype": "bfloat16"}], "outputs": {"one": "sc"}}));
            nodes[2] = json!({"op": 2, "args": [{"ref": "sc"}, {"list": [{"int": 8}]}, {"ref": "w"}, {"float": 1e-6}],
                              "outputs": {"one": "y"}});
            m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "s"}]);
        });
        assert_eq!(run(&mut m), 1);
        assert_eq!(names(&m), [RMS_NORM]);
        let n = &m.graph.nodes[0];
        assert_eq!(n.args[3..], [Arg::Ref("w".into()), Arg::Float(Float(1e-6)), Arg::Dtype("bfloat16".into())]);
        assert_eq!(n.outputs, Outputs::Many(vec![Some("y".into()), Some("s".into()), None]));
        // A float32 Llama reads its no-op cast again as the residual, not the sum.
        let mut m = method(|m| {
            let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
            nodes.insert(1, json!({"op": 3, "args": [{"ref": "s"}, {"dtype": "float32"}], "outputs": {"one": "sc"}}));
            nodes[2] = json!({"op": 2, "args": [{"ref": "sc"}, {"list": [{"int": 8}]}, {"ref": "w"}, {"float": 1e-6}],
                              "outputs": {"one": "y"}});
            nodes.push(json!({"op": 0, "args": [{"ref": "sc"}, {"ref": "y"}], "outputs": {"one": "z"}}));
            m["graph"]["outputs"] = json!([{"ref": "z"}]);
        });
        assert_eq!(run(&mut m), 1);
        assert_eq!(names(&m), [RMS_NORM, "aten::add.Tensor"]);
        assert_eq!(m.graph.nodes[0].outputs, Outputs::Many(vec![Some("y".into()), None, Some("sc".into())]));
    }

    #[test]
    fn leaves_near_misses_alone() {
        let cases: [fn(&mut serde_json::Value); 5] = [
            // A node runs between the add and the norm.
            |m| {
                let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
                nodes.insert(1, json!({"op": 4, "args": [{"ref": "x"}], "outputs": {"one": "z"}}));
            },
            // The add scales its second operand (alpha).
            |m| m["graph"]["nodes"][0]["kwargs"] = json!({"alpha": {"int": 2}}),
            // An add of a scalar.
            |m| m["graph"]["nodes"][0]["args"][1] = json!({"float": 1.0}),
            // A norm over two dimensions.
            |m| m["graph"]["nodes"][1]["args"][1] = json!({"list": [{"int": 2}, {"int": 8}]}),
            // A cast before a layer norm.
            |m| {
                let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
                nodes.insert(
                    1,
                    json!({"op": 3, "args": [{"ref": "s"}, {"dtype": "bfloat16"}], "outputs": {"one": "sc"}}),
                );
                nodes[2]["args"][0] = json!({"ref": "sc"});
            },
        ];
        for (i, case) in cases.into_iter().enumerate() {
            let mut m = method(case);
            let before = m.graph.nodes.len();
            assert_eq!(run(&mut m), 0, "case {i}");
            assert_eq!(m.graph.nodes.len(), before);
        }
    }

    #[test]
    fn runs_only_with_cuda_graphs() {
        assert!(AddNorm.runs_for(Target { cuda_graphs: true, ..Target::default() }));
        assert!(!AddNorm.runs_for(Target { onednn: true, gemm: true, in_place: true, cuda_graphs: false }));
    }
}
