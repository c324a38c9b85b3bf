//! A channel shuffle that keeps a channels-last tensor so (`optimize="fast"`). ShuffleNet's
//! (torchvision's `channel_shuffle`) is written out as four ops:
//!
//! ```text
//! v = view(x, [b, g, c/g, h, w]); t = transpose(v, 1, 2); u = contiguous(t)
//! y = view(u, [b, c, h, w])            (`reshape` for either view at `fast`; -1 for c)
//! ```
//!
//! whose `contiguous` copies a channels-last `x` (as `fast`'s convolutions make it) into a
//! channels-first tensor, which the next convolution converts back. The same shuffle over the
//! channels of each pixel, with the copy in channels-last order:
//!
//! ```text
//! s = reshape(x, [b, c, h, w]); p = permute(s, [0, 2, 3, 1]); r = reshape(p, [b, h, w, g, c/g])
//! t = transpose(r, 3, 4); u = contiguous(t); q = reshape(u, [b, h, w, c]); y = permute(q, [0, 3, 1, 2])
//! ```
//!
//! computes the same values for any `x` (reshapes compose in row-major order; each element
//! moves as before), with one copy where `x` is channels-last (every other node a view) and a
//! channels-last `y`. Every node is a plain aten op, so autograd runs through it. (torch's
//! `native_channel_shuffle` keeps channels-last in one pass too, but has no derivative, and
//! `channel_shuffle` returns channels-first.)

use std::collections::HashMap;

use super::emit::{value_names, Emit};
use super::pass::{Ctx, Pass};
use super::readers::{one, readers, sole_reader, Readers};
use super::Level;
use crate::schema::{Arg, Method, Node};

/// Rewrites every pattern of the method's top-level graph; returns how many.
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
    let ints = |v: &[i64]| Arg::List(v.iter().map(|&i| Arg::Int(i)).collect());
    let mut names = value_names(&m.graph);
    let mut removed = vec![false; m.graph.nodes.len()];
    // The nodes that stand where each pattern's last did (after every node its input needs).
    let mut replacing: HashMap<usize, Vec<Node>> = HashMap::new();
    for p in &found {
        let ([b, c, h, w], [_, _, _, yi]) = (p.sizes, p.nodes);
        let y = m.graph.nodes[yi].outputs.clone();
        let mut e = Emit::new(&mut m.ops, &mut names, format!("{}_shuffle", p.v));
        let s = e.call("aten::reshape.default", vec![Arg::Ref(p.x.clone()), ints(&p.sizes)], &[]);
        let q = e.call("aten::permute.default", vec![s, ints(&[0, 2, 3, 1])], &[]);
        let r = e.call("aten::reshape.default", vec![q, ints(&[b, h, w, p.groups, c / p.groups])], &[]);
        let t = e.call("aten::transpose.int", vec![r, Arg::Int(3), Arg::Int(4)], &[]);
        let u = e.call("aten::contiguous.default", vec![t], &[]);
        let q = e.call("aten::reshape.default", vec![u, ints(&[b, h, w, c])], &[]);
        e.bind("aten::permute.default", vec![q, ints(&[0, 3, 1, 2])], &[], y);
        p.nodes.iter().for_each(|&i| removed[i] = true);
        replacing.insert(yi, e.nodes);
    }
    let nodes = std::mem::take(&mut m.graph.nodes);
    let mut out = Vec::with_capacity(nodes.len() + 3 * found.len());
    for (i, n) in nodes.into_iter().enumerate() {
        out.extend(replacing.remove(&i).into_iter().flatten());
        if !removed[i] {
            out.push(n);
        }
    }
    m.graph.nodes = out;
    found.len()
}

/// One pattern: its nodes `[v, t, u, y]`, the shuffled value `x`, `v`'s output name (which
/// the new values' names start from), the sizes `[b, c, h, w]` and the groups.
struct Found {
    nodes: [usize; 4],
    x: String,
    v: String,
    sizes: [i64; 4],
    groups: i64,
}

/// Every pattern, with each intermediate read by the next node alone.
fn find(m: &Method, readers: &Readers) -> Vec<Found> {
    let g = &m.graph;
    let op_of = |i: usize| m.ops.get(g.nodes[i].op).map(|o| o.name.as_str());
    let is_view = |i: usize| matches!(op_of(i), Some("aten::view.default" | "aten::reshape.default"));
    // Node `i`'s literal sizes, if it is a view or reshape of `from` to them.
    let sizes = |i: usize, from: &str| -> Option<Vec<i64>> {
        let n = &g.nodes[i];
        match n.args.as_slice() {
            [Arg::Ref(r), Arg::List(s)] if is_view(i) && r == from && n.kwargs.is_empty() => {
                s.iter().map(|a| if let Arg::Int(v) = a { Some(*v) } else { None }).collect()
            }
            _ => None,
        }
    };
    let mut found = Vec::new();
    for (vi, v) in g.nodes.iter().enumerate() {
        let pattern = (|| {
            let Some(Arg::Ref(x)) = v.args.first() else { return None };
            let Ok([b, groups, per, h, w]) = <[i64; 5]>::try_from(sizes(vi, x)?) else { return None };
            if [b, groups, per, h, w].iter().any(|&s| s < 1) {
                return None;
            }
            let v_out = one(v)?;
            let ti = sole_reader(readers, v)?;
            let t = &g.nodes[ti];
            let swaps = matches!(t.args.as_slice(), [Arg::Ref(r), Arg::Int(1), Arg::Int(2)] | [Arg::Ref(r), Arg::Int(2), Arg::Int(1)] if r == v_out);
            if op_of(ti) != Some("aten::transpose.int") || !swaps || !t.kwargs.is_empty() {
                return None;
            }
            let ui = sole_reader(readers, t)?;
            let u = &g.nodes[ui];
            // `contiguous()` with the default (contiguous) format only.
            let plain = u
                .kwargs
                .iter()
                .all(|(k, a)| k == "memory_format" && *a == Arg::MemoryFormat("contiguous_format".into()));
            if op_of(ui) != Some("aten::contiguous.default")
                || u.args.as_slice() != [Arg::Ref(one(t)?.to_owned())]
                || !plain
            {
                return None;
            }
            let yi = sole_reader(readers, u)?;
            let c = groups.checked_mul(per)?;
            match sizes(yi, one(u)?)?.as_slice() {
                [b2, c2, h2, w2] if [*b2, *h2, *w2] == [b, h, w] && (*c2 == c || *c2 == -1) => {}
                _ => return None,
            }
            Some(Found { nodes: [vi, ti, ui, yi], x: x.clone(), v: v_out.to_owned(), sizes: [b, c, h, w], groups })
        })();
        found.extend(pattern);
    }
    found
}

/// The pass (`fast`).
pub struct ChannelShuffle;

impl Pass for ChannelShuffle {
    fn name(&self) -> &'static str {
        "channel_shuffle"
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
        let r = |v: &str| json!({"ref": v});
        let ints = |v: &[i64]| json!({"list": v.iter().map(|i| json!({"int": i})).collect::<Vec<_>>()});
        let mut m = json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": "aten::view.default", "schema": "s"}, {"name": "aten::transpose.int", "schema": "s"},
                    {"name": "aten::contiguous.default", "schema": "s"}],
            "graph": {
                "inputs": [{"name": "x", "source": {"user": 0}}],
                "nodes": [
                    {"op": 0, "args": [r("x"), ints(&[1, 2, 58, 28, 28])], "outputs": {"one": "v"}},
                    {"op": 1, "args": [r("v"), {"int": 1}, {"int": 2}], "outputs": {"one": "t"}},
                    {"op": 2, "args": [r("t")], "outputs": {"one": "u"}},
                    {"op": 0, "args": [r("u"), ints(&[1, -1, 28, 28])], "outputs": {"one": "y"}}],
                "outputs": [r("y")]}
        });
        mutate(&mut m);
        serde_json::from_value(m).unwrap()
    }

    #[test]
    fn the_four_ops_become_views_around_one_channels_last_copy() {
        let mut m = method(|_| {});
        assert_eq!(apply(&mut m), 1);
        let ints = |v: &[i64]| Arg::List(v.iter().map(|&i| Arg::Int(i)).collect());
        let steps: Vec<(&str, Vec<Arg>)> = m
            .graph
            .nodes
            .iter()
            .map(|n| (m.ops[n.op].name.as_str(), n.args.iter().skip(1).cloned().collect()))
            .collect();
        assert_eq!(
            steps,
            [
                ("aten::reshape.default", vec![ints(&[1, 116, 28, 28])]),
                ("aten::permute.default", vec![ints(&[0, 2, 3, 1])]),
                ("aten::reshape.default", vec![ints(&[1, 28, 28, 2, 58])]),
                ("aten::transpose.int", vec![Arg::Int(3), Arg::Int(4)]),
                ("aten::contiguous.default", vec![]),
                ("aten::reshape.default", vec![ints(&[1, 28, 28, 116])]),
                ("aten::permute.default", vec![ints(&[0, 3, 1, 2])]),
            ]
        );
        let nodes = &m.graph.nodes;
        assert_eq!(nodes[0].args[0], Arg::Ref("x".into()));
        assert_eq!(nodes[6].outputs, Outputs::One("y".into()));
        // Each node reads the one before it.
        for pair in nodes.windows(2) {
            let Outputs::One(out) = &pair[0].outputs else { panic!() };
            assert_eq!(pair[1].args[0], Arg::Ref(out.clone()));
        }
        // The transpose's dimensions in the other order; the last view's channels spelled out.
        let mut m = method(|m| {
            m["graph"]["nodes"][1]["args"] = json!([{"ref": "v"}, {"int": 2}, {"int": 1}]);
            m["graph"]["nodes"][3]["args"][1]["list"][1] = json!({"int": 116});
        });
        assert_eq!(apply(&mut m), 1);
        // What it writes is no pattern of its own: a second sweep finds nothing.
        assert_eq!(apply(&mut m), 0);
    }

    #[test]
    fn leaves_near_misses_alone() {
        let cases: [fn(&mut serde_json::Value); 6] = [
            // An intermediate is read elsewhere.
            |m| m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "t"}]),
            // Another transpose.
            |m| m["graph"]["nodes"][1]["args"][2] = json!({"int": 3}),
            // A view back to other sizes.
            |m| m["graph"]["nodes"][3]["args"][1]["list"][2] = json!({"int": 14}),
            // Sizes that are values, not literals.
            |m| m["graph"]["nodes"][0]["args"][1]["list"][0] = json!({"ref": "x"}),
            // A channels-last contiguous.
            |m| m["graph"]["nodes"][2]["kwargs"] = json!({"memory_format": {"memory_format": "channels_last"}}),
            // Not a 5-D view.
            |m| m["graph"]["nodes"][0]["args"][1]["list"] = json!([{"int": 2}, {"int": 58}, {"int": 784}]),
        ];
        for (i, case) in cases.into_iter().enumerate() {
            let mut m = method(case);
            assert_eq!(apply(&mut m), 0, "case {i}");
            assert_eq!(m.graph.nodes.len(), 4, "case {i}");
        }
    }
}
