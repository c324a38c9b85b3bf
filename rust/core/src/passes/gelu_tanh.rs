//! GELU's tanh approximation as one node (`optimize="fast"`). GPT-2 and its descendants
//! (transformers' `NewGELUActivation`) write it out as eight ops over the MLP's widest tensor:
//!
//! ```text
//! h = mul(x, 0.5); p = pow(x, 3); q = mul(p, 0.044715); a = add(x, q)
//! u = mul(a, sqrt(2 / pi)); t = tanh(u); s = add(t, 1); y = mul(h, s)
//! ```
//!
//! which is `y = gelu(x, approximate="tanh")`, torch's definition of that form. The runtime
//! runs it with kwexport's kernel on contiguous float32 CPU tensors. Commutative operands may
//! come in either order; each intermediate must be read only by the next op.

use std::collections::HashMap;

use super::pass::{Ctx, Pass};
use super::readers::{one, readers, sole_reader, Readers};
use super::Level;
use crate::schema::{Arg, Method, Node};

/// Fuses every pattern of the method's top-level graph; returns how many.
pub fn apply(m: &mut Method) -> usize {
    let readers = readers(&m.graph);
    rewrite(m, &readers)
}

/// [`apply`] with the method's readers known.
fn rewrite(m: &mut Method, readers: &Readers) -> usize {
    let found = find(m, readers);
    if found.is_empty() {
        return 0;
    }
    let op = super::op_index(&mut m.ops, "aten::gelu.default");
    let mut removed = vec![false; m.graph.nodes.len()];
    for (chain, x) in &found {
        let (last, rest) = chain.split_last().expect("a chain of eight");
        let y = &mut m.graph.nodes[*last];
        *y = Node {
            op,
            args: vec![Arg::Ref(x.clone())],
            kwargs: [("approximate".to_owned(), Arg::Str("tanh".to_owned()))].into(),
            outputs: y.outputs.clone(),
        };
        rest.iter().for_each(|&i| removed[i] = true);
    }
    super::remove_nodes(&mut m.graph.nodes, &removed);
    found.len()
}

/// Every pattern: its nodes' indices (the last, `y`, is replaced) and `x`.
fn find(m: &Method, readers: &Readers) -> Vec<(Vec<usize>, String)> {
    let g = &m.graph;
    let op_of = |i: usize| m.ops.get(g.nodes[i].op).map(|o| o.name.as_str());
    let producer: HashMap<&str, usize> =
        g.nodes.iter().enumerate().flat_map(|(i, n)| n.outputs.names().map(move |o| (o, i))).collect();
    // Node `i` if it is `op` on two arguments, no keywords: its operands in both orders.
    let binary = |i: usize, op: &str| -> Option<[(&Arg, &Arg); 2]> {
        let n = &g.nodes[i];
        match n.args.as_slice() {
            [a, b] if op_of(i) == Some(op) && n.kwargs.is_empty() => Some([(a, b), (b, a)]),
            _ => None,
        }
    };
    // The node making value `v`, if `reader` alone reads it.
    let feeding = |v: &Arg, reader: usize| -> Option<usize> {
        let Arg::Ref(v) = v else { return None };
        let p = *producer.get(v.as_str())?;
        (sole_reader(readers, &g.nodes[p]) == Some(reader)).then_some(p)
    };
    let float = |a: &Arg, want: f64, tol: f64| matches!(a, Arg::Float(f) if (f.0 - want).abs() <= tol);
    // `value * c` (either order) at node `i`: the other operand.
    let times = |i: usize, c: f64, tol: f64| -> Option<&Arg> {
        binary(i, "aten::mul.Tensor")?.into_iter().find(|(_, k)| float(k, c, tol)).map(|(v, _)| v)
    };
    let sqrt_2_over_pi = (2.0 / std::f64::consts::PI).sqrt();
    let mut found = Vec::new();
    for (ti, t) in g.nodes.iter().enumerate() {
        let chain = (|| {
            if op_of(ti) != Some("aten::tanh.default") || t.args.len() != 1 {
                return None;
            }
            let ui = feeding(&t.args[0], ti)?;
            let ai = feeding(times(ui, sqrt_2_over_pi, 1e-6)?, ui)?;
            // a = x + q, q = pow(x, 3) * 0.044715
            let (x, qi) = binary(ai, "aten::add.Tensor")?.into_iter().find_map(|(x, q)| Some((x, feeding(q, ai)?)))?;
            let pi = feeding(times(qi, 0.044715, 1e-9)?, qi)?;
            let cubed =
                matches!(g.nodes[pi].args.as_slice(), [p, e] if p == x && (float(e, 3.0, 0.0) || *e == Arg::Int(3)));
            if op_of(pi) != Some("aten::pow.Tensor_Scalar") || !cubed || !g.nodes[pi].kwargs.is_empty() {
                return None;
            }
            // s = t + 1; y = h * s with h = x * 0.5
            let (si, t_out) = (sole_reader(readers, t)?, one(t)?);
            let s_ok = binary(si, "aten::add.Tensor")?.into_iter().any(|(v, c)| v.reads(t_out) && float(c, 1.0, 0.0));
            let yi = sole_reader(readers, &g.nodes[si]).filter(|_| s_ok)?;
            let s = one(&g.nodes[si])?;
            let (h, _) = binary(yi, "aten::mul.Tensor")?.into_iter().find(|(_, v)| v.reads(s))?;
            let hi = feeding(h, yi)?;
            if times(hi, 0.5, 0.0)? != x {
                return None;
            }
            let Arg::Ref(x) = x else { return None };
            Some((vec![hi, pi, qi, ai, ui, ti, si, yi], x.clone()))
        })();
        found.extend(chain);
    }
    found
}

/// The pass (`fast`).
pub struct GeluTanh;

impl Pass for GeluTanh {
    fn name(&self) -> &'static str {
        "gelu_tanh"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, readers, _| rewrite(m, readers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Outputs;
    use serde_json::json;

    fn method(mutate: impl FnOnce(&mut serde_json::Value)) -> Method {
        let f = |v: f64| json!({"float": v});
        let r = |v: &str| json!({"ref": v});
        let mut m = json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": "aten::mul.Tensor", "schema": "s"}, {"name": "aten::pow.Tensor_Scalar", "schema": "s"},
                    {"name": "aten::add.Tensor", "schema": "s"}, {"name": "aten::tanh.default", "schema": "s"}],
            "graph": {
                "inputs": [{"name": "x", "source": {"user": 0}}],
                "nodes": [
                    {"op": 0, "args": [r("x"), f(0.5)], "outputs": {"one": "h"}},
                    {"op": 1, "args": [r("x"), f(3.0)], "outputs": {"one": "p"}},
                    {"op": 0, "args": [r("p"), f(0.044715)], "outputs": {"one": "q"}},
                    {"op": 2, "args": [r("x"), r("q")], "outputs": {"one": "a"}},
                    {"op": 0, "args": [r("a"), f(0.7978845608028654)], "outputs": {"one": "u"}},
                    {"op": 3, "args": [r("u")], "outputs": {"one": "t"}},
                    {"op": 2, "args": [r("t"), f(1.0)], "outputs": {"one": "s"}},
                    {"op": 0, "args": [r("h"), r("s")], "outputs": {"one": "y"}}],
                "outputs": [r("y")]}
        });
        mutate(&mut m);
        serde_json::from_value(m).unwrap()
    }

    #[test]
    fn fuses_the_eight_ops_into_gelu() {
        let mut m = method(|_| {});
        assert_eq!(apply(&mut m), 1);
        assert_eq!(m.graph.nodes.len(), 1);
        let n = &m.graph.nodes[0];
        assert_eq!(m.ops[n.op].name, "aten::gelu.default");
        assert_eq!(n.args, [Arg::Ref("x".into())]);
        assert_eq!(n.kwargs["approximate"], Arg::Str("tanh".into()));
        assert_eq!(n.outputs, Outputs::One("y".into()));
        // Operands of commutative ops in the other order.
        let mut m = method(|m| {
            let nodes = &mut m["graph"]["nodes"];
            nodes[3]["args"] = json!([{"ref": "q"}, {"ref": "x"}]);
            nodes[7]["args"] = json!([{"ref": "s"}, {"ref": "h"}]);
            nodes[1]["args"][1] = json!({"int": 3});
        });
        assert_eq!(apply(&mut m), 1);
    }

    #[test]
    fn leaves_near_misses_alone() {
        let cases: [fn(&mut serde_json::Value); 5] = [
            // An intermediate is read elsewhere.
            |m| m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "t"}]),
            // Another coefficient.
            |m| m["graph"]["nodes"][2]["args"][1] = json!({"float": 0.05}),
            // Another power.
            |m| m["graph"]["nodes"][1]["args"][1] = json!({"float": 2.0}),
            // The cube of something else.
            |m| m["graph"]["nodes"][1]["args"][0] = json!({"ref": "h"}),
            // Half of something else.
            |m| m["graph"]["nodes"][0]["args"][0] = json!({"ref": "p"}),
        ];
        for (i, case) in cases.into_iter().enumerate() {
            let mut m = method(case);
            assert_eq!(apply(&mut m), 0, "case {i}");
            assert_eq!(m.graph.nodes.len(), 8, "case {i}");
        }
    }
}
