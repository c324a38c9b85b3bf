//! RMS normalization as one node (`optimize="fast"`). Llama-family models compute it as six
//! ops, each a dispatch and a pass over memory:
//!
//! ```text
//! p = pow(x, 2); m = mean(p, [-1], keepdim=True); a = add(m, eps); r = rsqrt(a)
//! h = mul(x, r); y = mul(w, h)            # w: a 1-D weight, either operand order
//! ```
//!
//! which becomes `y = rms_norm(x, [n], w, eps)` with `n` the weight's size. The runtime runs
//! that node with kwexport's kernel on contiguous float32 CPU tensors (`kernels/mod.rs`), and with
//! torch's `rms_norm` otherwise. Each intermediate must be read only by the next op, so nothing
//! else needs the values that disappear.
//!
//! A bfloat16 or float16 model computes the norm in float32 between two casts (Llama's
//! `x = x0.to(float32)` first, `h.to(dtype)` before a weight of that dtype), which becomes
//! `rms_norm(x0.to(dtype), [n], w, eps)`: torch's `rms_norm` computes in float32 too, and on
//! CUDA in one kernel (`_fused_rms_norm`) where the ops took nine. The `to` is no copy where
//! `x0` has that dtype already (the model's), and keeps the graph's dtype where it hasn't.

use super::pass::{Ctx, Pass};
use super::readers::{one, readers, sole_reader, weight_inputs, Readers};
use super::Level;
use crate::schema::{Arg, Method, Node, Weights};

/// Fuses every RMS-norm pattern of the method's top-level graph; returns how many.
pub fn apply(m: &mut Method, weights: &Weights) -> usize {
    let readers = readers(&m.graph);
    rewrite(m, weights, &readers)
}

/// [`apply`] with the method's readers known.
fn rewrite(m: &mut Method, weights: &Weights, readers: &Readers) -> usize {
    // Patterns share no node (each intermediate has one reader), so all are found in one
    // pass over the graph and rewritten together.
    let found = find(m, weights, readers);
    if found.is_empty() {
        return 0;
    }
    let mut names = super::emit::value_names(&m.graph);
    // What replaces each chain's last node; the chains' other nodes go.
    let mut chains = Vec::with_capacity(found.len());
    for (chain, mut args, outputs, downcast) in found {
        let base = format!("{}_rms", outputs.names().next().unwrap_or("y"));
        let mut emit = super::emit::Emit::new(&mut m.ops, &mut names, base);
        if let Some(dtype) = downcast {
            args[0] = emit.call("aten::to.dtype", vec![args[0].clone(), Arg::Dtype(dtype)], &[]);
        }
        emit.bind("aten::rms_norm.default", args, &[], outputs);
        chains.push((chain, emit.nodes));
    }
    let made = chains.len();
    super::replace_chains(&mut m.graph.nodes, chains);
    made
}

/// One pattern found: its nodes' indices (the last is replaced), the fused node's arguments and
/// outputs, and the dtype its input is cast to first (a reduced-precision model's).
type Found = (Vec<usize>, Vec<Arg>, crate::schema::Outputs, Option<String>);

/// Every pattern.
fn find(m: &Method, weights: &Weights, readers: &Readers) -> Vec<Found> {
    let g = &m.graph;
    let op_of = |n: &Node| m.ops.get(n.op).map(|o| o.name.as_str());
    // The node that alone reads `n`'s value, if it is `op`.
    let sole_reader =
        |n: &Node, op: &str| -> Option<usize> { sole_reader(readers, n).filter(|&j| op_of(&g.nodes[j]) == Some(op)) };
    let weight_of = weight_inputs(g);
    let weight_1d = |name: &str| -> Option<(String, i64, &str)> {
        let t = weights.tensors.get(*weight_of.get(name)?)?;
        match (t.shape.as_slice(), t.mutable) {
            ([n], false) => Some((name.to_owned(), *n, t.dtype.as_str())),
            _ => None,
        }
    };
    let mut found = Vec::new();
    for (p, pow) in g.nodes.iter().enumerate() {
        if op_of(pow) != Some("aten::pow.Tensor_Scalar") || !pow.kwargs.is_empty() {
            continue;
        }
        let (Some(Arg::Ref(x)), Some(exp)) = (pow.args.first(), pow.args.get(1)) else { continue };
        if !matches!(exp, Arg::Int(2)) && !matches!(exp, Arg::Float(f) if f.0 == 2.0) {
            continue;
        }
        let Some(mi) = sole_reader(pow, "aten::mean.dim") else { continue };
        let mean = &g.nodes[mi];
        let last_dim = matches!(mean.args.get(1), Some(Arg::List(d)) if d.as_slice() == [Arg::Int(-1)]);
        if !last_dim || mean.args.get(2) != Some(&Arg::Bool(true)) || mean.args.len() != 3 || !mean.kwargs.is_empty() {
            continue;
        }
        let Some(ai) = sole_reader(mean, "aten::add.Tensor") else { continue };
        let add = &g.nodes[ai];
        let (Some(Arg::Float(eps)), true) = (add.args.get(1), add.args.len() == 2 && add.kwargs.is_empty()) else {
            continue;
        };
        let Some(ri) = sole_reader(add, "aten::rsqrt.default") else { continue };
        let Some(hi) = sole_reader(&g.nodes[ri], "aten::mul.Tensor") else { continue };
        let h = &g.nodes[hi];
        let Some(r_name) = one(&g.nodes[ri]) else { continue };
        fn pair(n: &Node) -> Option<(&String, &String)> {
            match (n.args.first(), n.args.get(1)) {
                (Some(Arg::Ref(a)), Some(Arg::Ref(b))) if n.args.len() == 2 && n.kwargs.is_empty() => Some((a, b)),
                _ => None,
            }
        }
        let Some((a, b)) = pair(h) else { continue };
        if !((a == x && b == r_name) || (a == r_name && b == x)) {
            continue;
        }
        // Llama casts `h` back to the input's dtype before the weight: a float32 model's
        // `to(h, float32)` is `h` itself (then the weight must be float32 too); a reduced
        // precision model's casts to its dtype, from a float32 copy of its input.
        let cast = sole_reader(h, "aten::to.dtype").filter(|&ci| cast_to(&g.nodes[ci]).is_some());
        let downcast = cast.and_then(|ci| cast_to(&g.nodes[ci])).filter(|&d| d != "float32");
        let input = match downcast {
            Some(_) => match upcast_of(g, x, &op_of) {
                Some(x0) => x0,
                None => continue,
            },
            None => x.clone(),
        };
        let last = cast.unwrap_or(hi);
        let Some(yi) = sole_reader(&g.nodes[last], "aten::mul.Tensor") else { continue };
        let y = &g.nodes[yi];
        let Some(h_name) = one(&g.nodes[last]) else { continue };
        let Some((a, b)) = pair(y) else { continue };
        let other = if a == h_name {
            b
        } else if b == h_name {
            a
        } else {
            continue;
        };
        let Some((w, n, dtype)) = weight_1d(other) else { continue };
        // The weight has the dtype the norm's result is cast to.
        if cast.is_some_and(|ci| cast_to(&g.nodes[ci]) != Some(dtype)) {
            continue;
        }
        let args = vec![Arg::Ref(input), Arg::List(vec![Arg::Int(n)]), Arg::Ref(w), Arg::Float(*eps)];
        let mut chain = vec![p, mi, ai, ri, hi];
        chain.extend(cast);
        chain.push(yi);
        found.push((chain, args, y.outputs.clone(), downcast.map(str::to_owned)));
    }
    found
}

/// The floating dtype `to(v, dtype)` casts to, where it has no other effect (non_blocking and
/// copy false, no memory format).
pub(super) fn cast_to(n: &Node) -> Option<&str> {
    let Some(Arg::Dtype(d)) = n.args.get(1) else { return None };
    let rest_ok = n.args.iter().skip(2).all(|a| matches!(a, Arg::Bool(false)));
    let kwargs_ok = n.kwargs.values().all(|a| matches!(a, Arg::Bool(false) | Arg::None(())));
    let floating = matches!(d.as_str(), "float32" | "bfloat16" | "float16");
    (floating && rest_ok && kwargs_ok && n.args.len() <= 4).then_some(d.as_str())
}

/// The value `x` is a float32 cast of (`x = to(x0, float32)`), if it is one.
fn upcast_of<'g>(g: &'g crate::schema::Graph, x: &str, op_of: &impl Fn(&Node) -> Option<&'g str>) -> Option<String> {
    let n = g.nodes.iter().find(|n| one(n) == Some(x))?;
    match n.args.first() {
        Some(Arg::Ref(x0)) if op_of(n) == Some("aten::to.dtype") && cast_to(n) == Some("float32") => Some(x0.clone()),
        _ => None,
    }
}

/// The pass (`fast`).
pub struct RmsNorm;

impl Pass for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, readers, weights| rewrite(m, weights, readers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Outputs;
    use serde_json::json;

    fn method(mutate: impl FnOnce(&mut serde_json::Value)) -> (Method, Weights) {
        let mut m = json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": "aten::pow.Tensor_Scalar", "schema": "s"}, {"name": "aten::mean.dim", "schema": "s"},
                    {"name": "aten::add.Tensor", "schema": "s"}, {"name": "aten::rsqrt.default", "schema": "s"},
                    {"name": "aten::mul.Tensor", "schema": "s"}],
            "graph": {
                "inputs": [{"name": "w", "source": {"weight": "norm.weight"}}, {"name": "x", "source": {"user": 0}}],
                "nodes": [
                    {"op": 0, "args": [{"ref": "x"}, {"int": 2}], "outputs": {"one": "p"}},
                    {"op": 1, "args": [{"ref": "p"}, {"list": [{"int": -1}]}, {"bool": true}], "outputs": {"one": "m"}},
                    {"op": 2, "args": [{"ref": "m"}, {"float": 1e-6}], "outputs": {"one": "a"}},
                    {"op": 3, "args": [{"ref": "a"}], "outputs": {"one": "r"}},
                    {"op": 4, "args": [{"ref": "x"}, {"ref": "r"}], "outputs": {"one": "h"}},
                    {"op": 4, "args": [{"ref": "w"}, {"ref": "h"}], "outputs": {"one": "y"}}],
                "outputs": [{"ref": "y"}]}
        });
        mutate(&mut m);
        let weights = serde_json::from_value(json!({
            "storages": [{"offset": 0, "nbytes": 32}],
            "tensors": {"norm.weight": {"dtype": "float32", "shape": [8], "strides": [1], "storage": 0}}
        }))
        .unwrap();
        (serde_json::from_value(m).unwrap(), weights)
    }

    #[test]
    fn fuses_the_six_ops_into_rms_norm() {
        let (mut m, w) = method(|_| {});
        assert_eq!(apply(&mut m, &w), 1);
        assert_eq!(m.graph.nodes.len(), 1);
        let node = &m.graph.nodes[0];
        assert_eq!(m.ops[node.op].name, "aten::rms_norm.default");
        assert_eq!(
            node.args,
            [
                Arg::Ref("x".into()),
                Arg::List(vec![Arg::Int(8)]),
                Arg::Ref("w".into()),
                Arg::Float(crate::schema::Float(1e-6))
            ]
        );
        assert_eq!(node.outputs, Outputs::One("y".into()));
    }

    #[test]
    fn takes_a_float32_cast_before_the_weight() {
        let cast = |m: &mut serde_json::Value| {
            let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
            nodes.insert(5, json!({"op": 5, "args": [{"ref": "h"}, {"dtype": "float32"}], "outputs": {"one": "hc"}}));
            nodes[6]["args"][1] = json!({"ref": "hc"});
            m["ops"].as_array_mut().unwrap().push(json!({"name": "aten::to.dtype", "schema": "s"}));
        };
        let (mut m, w) = method(cast);
        assert_eq!(apply(&mut m, &w), 1);
        assert_eq!(m.graph.nodes.len(), 1);
        // A cast to another dtype is a real cast: left alone.
        let (mut m, w) = method(|m| {
            cast(m);
            m["graph"]["nodes"][5]["args"][1] = json!({"dtype": "bfloat16"});
        });
        assert_eq!(apply(&mut m, &w), 0);
    }

    #[test]
    fn takes_a_reduced_precision_norm_between_its_casts() {
        // x = to(x0, float32) ... h.to(bfloat16) * w, with a bfloat16 weight.
        let casts = |to: &'static str| {
            move |m: &mut serde_json::Value| {
                let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
                nodes.insert(
                    0,
                    json!({"op": 5, "args": [{"ref": "x0"}, {"dtype": "float32"}], "outputs": {"one": "x"}}),
                );
                nodes.insert(6, json!({"op": 5, "args": [{"ref": "h"}, {"dtype": to}], "outputs": {"one": "hc"}}));
                nodes[7]["args"][1] = json!({"ref": "hc"});
                m["ops"].as_array_mut().unwrap().push(json!({"name": "aten::to.dtype", "schema": "s"}));
                m["graph"]["inputs"][1]["name"] = json!("x0");
            }
        };
        let (mut m, mut w) = method(casts("bfloat16"));
        w.tensors.get_mut("norm.weight").unwrap().dtype = "bfloat16".into();
        assert_eq!(apply(&mut m, &w), 1);
        let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        // The float32 copy stays for dead code to drop (nothing reads it now).
        assert_eq!(ops, ["aten::to.dtype", "aten::to.dtype", "aten::rms_norm.default"]);
        let (cast, norm) = (&m.graph.nodes[1], &m.graph.nodes[2]);
        assert_eq!(cast.args, [Arg::Ref("x0".into()), Arg::Dtype("bfloat16".into())]);
        assert_eq!(norm.args[0], Arg::Ref("y_rms0".into()));
        assert_eq!(cast.outputs, Outputs::One("y_rms0".into()));
        assert_eq!(norm.outputs, Outputs::One("y".into()));
        // A weight of another dtype than the cast's, or a norm of a value no upcast made: left.
        let (mut m, mut w) = method(casts("float16"));
        w.tensors.get_mut("norm.weight").unwrap().dtype = "bfloat16".into();
        assert_eq!(apply(&mut m, &w), 0);
        let (mut m, mut w) = method(|m| {
            casts("bfloat16")(m);
            m["graph"]["nodes"][0]["args"][1] = json!({"dtype": "float64"});
        });
        w.tensors.get_mut("norm.weight").unwrap().dtype = "bfloat16".into();
        assert_eq!(apply(&mut m, &w), 0);
    }

    #[test]
    fn leaves_near_misses_alone() {
        let cases: [fn(&mut serde_json::Value); 5] = [
            // An intermediate is read elsewhere.
            |m| m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "r"}]),
            // Another exponent.
            |m| m["graph"]["nodes"][0]["args"][1] = json!({"int": 3}),
            // Another dimension.
            |m| m["graph"]["nodes"][1]["args"][1] = json!({"list": [{"int": 0}]}),
            // The scale isn't a weight.
            |m| m["graph"]["nodes"][5]["args"][0] = json!({"ref": "x"}),
            // Normalized by something other than its own input.
            |m| m["graph"]["nodes"][4]["args"][0] = json!({"ref": "w"}),
        ];
        for (i, case) in cases.into_iter().enumerate() {
            let (mut m, w) = method(case);
            assert_eq!(apply(&mut m, &w), 0, "case {i}");
            assert_eq!(m.graph.nodes.len(), 6);
        }
    }
}
