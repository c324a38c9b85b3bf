//! The rotary position embedding as one node (`optimize="fast"`, on CUDA with CUDA graphs,
//! and on a CPU where the runtime has its own kernels).
//! transformers' `apply_rotary_pos_emb` (Llama, Mistral, Qwen, Gemma, ...) exports, for each
//! of the query and the key, as
//!
//! ```text
//! a = mul(x, cos)
//! x1 = slice(x, d, 0, h); x2 = slice(x, d, h, MAX); n = neg(x2); c = cat([n, x1], e)
//! b = mul(c, sin); y = add(a, b)
//! ```
//!
//! (`rotate_half`): five kernels, each a pass over memory, where at batch 1 on a GPU the
//! launches are the cost, and on a CPU seven dispatches. They become `y =
//! kwexport::rotary_embedding(x, cos, sin, d, e, h)`, one Triton kernel on CUDA
//! (`kwexport._cuda_fused`) and kwexport's kernel on a CPU (the runtime's
//! `kernels::rotary`), each taking the transposed `x` as it is.
//!
//! The seven nodes must be consecutive (in any order), so that nothing writes `x` between
//! the reads the one node now makes at once; every intermediate is read only inside the
//! pattern. Either operand order of each `mul` and of the `add` is taken.

use std::collections::HashMap;

use super::pass::{Ctx, Pass};
use super::readers::{one, sole_reader, Readers};
use super::{Level, Target};
use crate::schema::{Arg, Method, Node, Outputs};

/// The op the pattern becomes.
pub const ROTARY: &str = crate::tables::PASS_OPS[10];

/// Fuses each rotary embedding of the method's top-level graph; returns how many.
fn rewrite(m: &mut Method, readers: &Readers) -> usize {
    let found = find(m, readers);
    if found.is_empty() {
        return 0;
    }
    let (op, made) = (super::op_index(&mut m.ops, ROTARY), found.len());
    let chains = found
        .into_iter()
        .map(|(chain, args, outputs)| (chain, vec![Node { op, args, kwargs: Default::default(), outputs }]));
    super::replace_chains(&mut m.graph.nodes, chains.collect());
    made
}

/// The graph as the pattern reads it.
struct View<'m> {
    m: &'m Method,
    readers: &'m Readers,
    /// The node binding each one-output value.
    producer: HashMap<&'m str, usize>,
}

impl<'m> View<'m> {
    fn op(&self, i: usize) -> Option<&'m str> {
        self.m.ops.get(self.m.graph.nodes[i].op).map(|o| o.name.as_str())
    }

    /// The node making `v`, where it is `op` with positional arguments only and `by` is the
    /// one reader of `v`.
    fn made_for(&self, v: &Arg, op: &str, by: usize) -> Option<usize> {
        let Arg::Ref(v) = v else { return None };
        let &i = self.producer.get(v.as_str())?;
        let n = &self.m.graph.nodes[i];
        (self.op(i) == Some(op) && n.kwargs.is_empty() && sole_reader(self.readers, n) == Some(by)).then_some(i)
    }

    /// The two operands of node `i`, in both orders.
    fn orders(&self, i: usize) -> [(&'m Arg, &'m Arg); 2] {
        match self.m.graph.nodes[i].args.as_slice() {
            [a, b] => [(a, b), (b, a)],
            _ => [(&Arg::None(()), &Arg::None(())); 2],
        }
    }

    /// `slice(x, dim, start, end)` (step 1) read only by `by`: `(x, dim, start, end)`.
    fn slice(&self, v: &Arg, by: usize) -> Option<(usize, &'m Arg, i64, i64, i64)> {
        let i = self.made_for(v, "aten::slice.Tensor", by)?;
        match self.m.graph.nodes[i].args.as_slice() {
            [x @ Arg::Ref(_), Arg::Int(d), Arg::Int(s), Arg::Int(e)]
            | [x @ Arg::Ref(_), Arg::Int(d), Arg::Int(s), Arg::Int(e), Arg::Int(1)] => Some((i, x, *d, *s, *e)),
            _ => None,
        }
    }

    /// The pattern ending at the add `ai`: its seven nodes (the add last), the fused node's
    /// arguments.
    fn at(&self, ai: usize) -> Option<(Vec<usize>, Vec<Arg>)> {
        for (direct, turned) in self.orders(ai) {
            let (Some(mi), Some(ti)) =
                (self.made_for(direct, "aten::mul.Tensor", ai), self.made_for(turned, "aten::mul.Tensor", ai))
            else {
                continue;
            };
            for (cat, sin) in self.orders(ti) {
                let Some(ci) = self.made_for(cat, "aten::cat.default", ti) else { continue };
                let (Arg::List(parts), e) = (&self.m.graph.nodes[ci].args[0], self.m.graph.nodes[ci].args.get(1))
                else {
                    continue;
                };
                let e = match e {
                    None => 0,
                    Some(Arg::Int(e)) => *e,
                    Some(_) => continue,
                };
                let [negated, first] = parts.as_slice() else { continue };
                let Some(ni) = self.made_for(negated, "aten::neg.default", ci) else { continue };
                let Some((s2, x, d, h, end)) = self.slice(&self.m.graph.nodes[ni].args[0], ni) else { continue };
                let Some((s1, x_, d_, zero, h_)) = self.slice(first, ci) else { continue };
                if x != x_ || d != d_ || zero != 0 || h_ != h || end != i64::MAX || h < 0 {
                    continue;
                }
                let Some(cos) = self.orders(mi).into_iter().find(|(a, _)| *a == x).map(|(_, c)| c) else { continue };
                if !matches!(cos, Arg::Ref(_)) || !matches!(sin, Arg::Ref(_)) {
                    continue;
                }
                let args = vec![x.clone(), cos.clone(), sin.clone(), Arg::Int(d), Arg::Int(e), Arg::Int(h)];
                return Some((vec![mi, s1, s2, ni, ci, ti, ai], args));
            }
        }
        None
    }
}

/// Every pattern: its nodes (the add last), the fused node's arguments and outputs.
fn find(m: &Method, readers: &Readers) -> Vec<(Vec<usize>, Vec<Arg>, Outputs)> {
    let nodes = &m.graph.nodes;
    let producer = nodes.iter().enumerate().filter_map(|(i, n)| Some((one(n)?, i))).collect();
    let view = View { m, readers, producer };
    let mut found = Vec::new();
    for (ai, add) in nodes.iter().enumerate() {
        if view.op(ai) != Some("aten::add.Tensor") || !add.kwargs.is_empty() {
            continue;
        }
        let Some((chain, args)) = view.at(ai) else { continue };
        // Consecutive: the span the seven nodes cover holds only them.
        let lo = chain.iter().min().copied().unwrap_or(ai);
        if ai - lo + 1 == chain.len() {
            found.push((chain, args, add.outputs.clone()));
        }
    }
    found
}

/// The pass (`fast`, on CUDA with CUDA graphs, and on a CPU with the runtime's kernels).
pub struct Rotary;

impl Pass for Rotary {
    fn name(&self) -> &'static str {
        "rotary"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.cuda_graphs || target.gemm
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

    /// transformers' `apply_rotary_pos_emb` for one tensor, then `mutate`.
    fn method(mutate: impl FnOnce(&mut serde_json::Value)) -> Method {
        let r = |n: &str| json!({"ref": n});
        let i = |v: i64| json!({"int": v});
        let mut m = json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": "aten::mul.Tensor", "schema": "s"}, {"name": "aten::slice.Tensor", "schema": "s"},
                    {"name": "aten::neg.default", "schema": "s"}, {"name": "aten::cat.default", "schema": "s"},
                    {"name": "aten::add.Tensor", "schema": "s"}, {"name": "aten::relu.default", "schema": "s"}],
            "graph": {
                "inputs": [{"name": "x", "source": {"user": 0}}, {"name": "cos", "source": {"user": 1}},
                           {"name": "sin", "source": {"user": 2}}],
                "nodes": [
                    {"op": 0, "args": [r("x"), r("cos")], "outputs": {"one": "a"}},
                    {"op": 1, "args": [r("x"), i(3), i(0), i(32)], "outputs": {"one": "x1"}},
                    {"op": 1, "args": [r("x"), i(3), i(32), i(i64::MAX)], "outputs": {"one": "x2"}},
                    {"op": 2, "args": [r("x2")], "outputs": {"one": "n"}},
                    {"op": 3, "args": [{"list": [r("n"), r("x1")]}, i(-1)], "outputs": {"one": "c"}},
                    {"op": 0, "args": [r("c"), r("sin")], "outputs": {"one": "b"}},
                    {"op": 4, "args": [r("a"), r("b")], "outputs": {"one": "y"}}],
                "outputs": [r("y"), r("x")]}
        });
        mutate(&mut m);
        serde_json::from_value(m).unwrap()
    }

    fn run(m: &mut Method) -> usize {
        let r = readers(&m.graph);
        rewrite(m, &r)
    }

    #[test]
    fn the_seven_ops_become_one_node() {
        let mut m = method(|_| {});
        assert_eq!(run(&mut m), 1);
        assert_eq!(m.graph.nodes.len(), 1);
        let n = &m.graph.nodes[0];
        assert_eq!(m.ops[n.op].name, ROTARY);
        let refs = |s: &str| Arg::Ref(s.into());
        assert_eq!(n.args, [refs("x"), refs("cos"), refs("sin"), Arg::Int(3), Arg::Int(-1), Arg::Int(32)]);
        assert_eq!(n.outputs, Outputs::One("y".into()));
        assert_eq!(run(&mut m), 0, "nothing is found twice");
    }

    #[test]
    fn takes_either_operand_order() {
        let mut m = method(|m| {
            let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
            nodes[0]["args"] = json!([{"ref": "cos"}, {"ref": "x"}]);
            nodes[5]["args"] = json!([{"ref": "sin"}, {"ref": "c"}]);
            nodes[6]["args"] = json!([{"ref": "b"}, {"ref": "a"}]);
        });
        assert_eq!(run(&mut m), 1);
        let refs = |s: &str| Arg::Ref(s.into());
        assert_eq!(m.graph.nodes[0].args[..3], [refs("x"), refs("cos"), refs("sin")]);
    }

    #[test]
    fn leaves_near_misses_alone() {
        let cases: [fn(&mut serde_json::Value); 6] = [
            // An intermediate is read elsewhere.
            |m| m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "c"}]),
            // The halves swapped: not rotate_half.
            |m| m["graph"]["nodes"][4]["args"][0] = json!({"list": [{"ref": "x1"}, {"ref": "n"}]}),
            // The halves split at different places.
            |m| m["graph"]["nodes"][1]["args"][3] = json!({"int": 16}),
            // The second half ends before the end.
            |m| m["graph"]["nodes"][2]["args"][3] = json!({"int": 64}),
            // The first product isn't of the sliced tensor.
            |m| m["graph"]["nodes"][0]["args"] = json!([{"ref": "cos"}, {"ref": "sin"}]),
            // A node runs in the middle of the pattern.
            |m| {
                let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
                nodes.insert(3, json!({"op": 5, "args": [{"ref": "x"}], "outputs": {"one": "z"}}));
                m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "z"}]);
            },
        ];
        for (i, case) in cases.into_iter().enumerate() {
            let mut m = method(case);
            let before = m.graph.nodes.len();
            assert_eq!(run(&mut m), 0, "case {i}");
            assert_eq!(m.graph.nodes.len(), before);
        }
    }
}
