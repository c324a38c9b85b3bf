//! A quantize read by a dequantize of the same parameters as one fake quantization
//! (`optimize="fast"`): what torch's pt2e flows leave before every op no int8 kernel takes
//! (a convolution, a residual add, a pooling),
//!
//! ```text
//! q  = quantize_per_tensor(x, scale, zp, qmin, qmax, uint8|int8)
//! xd = dequantize_per_tensor(q, scale, zp, qmin, qmax, same dtype)
//! ```
//!
//! which `quantized_ops` would write out as eight aten ops, each a pass over the tensor,
//! becomes `xd = fake_quantize_per_tensor_affine(x, scale, zp, qmin, qmax)`: torch's own op
//! for exactly that (`clamp(round(x * (1 / scale)) + zp, qmin, qmax)`, less `zp`, times
//! `scale`), which the runtime runs on kwexport's one-pass kernel (`kernels::int8`) for float32
//! CPU tensors. Tensor parameters (dynamic quantization's, chosen per call by
//! `choose_qparams.tensor`, which `quantized_ops` writes out) make the same pair the
//! `.tensor_qparams` overload. The quantize stays where anything else reads it (then
//! `quantized_ops` writes it out), and goes otherwise.
//!
//! A quantize that two ops read (GhostNet's primary convolution, quantized once for its
//! depthwise convolution and once for the concatenation) had a dequantize for each, so it
//! becomes two fake quantizations of one value with the same parameters: the second goes and
//! its readers read the first (the same values; GhostNet's int8 program computed 37 of its
//! 143 twice).
//!
//! A fake quantization of a concatenation of values each fake-quantized with its parameters
//! goes too (pt2e quantizes a `cat`'s inputs and result alike: GhostNet's 32).
//!
//! A fake quantization that only a max pool reads runs after the pool instead, over a
//! quarter of the values or fewer (SqueezeNet's stem: 1.2 M): the two commute, fake
//! quantization being monotone (the same values; where the input holds a NaN, which the
//! quantized graph's cast to 8 bits leaves undefined, the pool's NaN is then quantized).
//!
//! It runs after `linear_int8`, which takes the pairs that feed a linear, and before
//! `quantized_ops` (`super::registered`).

use std::collections::HashMap;

use super::pass::{Ctx, Pass};
use super::readers::{one, readers};
use super::Level;
use crate::schema::{Arg, Method, Node};

/// The op a quantize → dequantize pair becomes.
pub const FAKE: &str = "aten::fake_quantize_per_tensor_affine.default";
/// The op a pair with tensor parameters becomes (dynamic quantization's, which
/// `choose_qparams.tensor` picks per call).
pub const FAKE_TENSOR: &str = "aten::fake_quantize_per_tensor_affine.tensor_qparams";

/// The pass (`fast`).
pub struct FakeQuantize;

impl Pass for FakeQuantize {
    fn name(&self) -> &'static str {
        "fake_quantize"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, _, _| apply(m))
    }
}

/// Rewrites each static dequantize of a quantize in the method's top-level graph; returns
/// how many.
pub fn apply(m: &mut Method) -> usize {
    let n = pairs(m) + merge(m) + of_quantized_cats(m) + after_pools(m);
    detach_tensor_parameters(m);
    n
}

/// Each fake quantization with tensor parameters reads them through `detach`: dynamic
/// quantization chooses them from the input, so under autograd they require a gradient, which
/// torch's op refuses ("not differentiable with respect to argument 'scale'") where the
/// reference graph's quantize and dequantize take them. The values are the same; off autograd
/// the runtime's kernel reads them as before.
fn detach_tensor_parameters(m: &mut Method) {
    const DETACH: &str = "aten::detach.default";
    let made_by_detach: std::collections::HashSet<String> = m
        .graph
        .nodes
        .iter()
        .filter(|n| m.ops.get(n.op).is_some_and(|o| o.name == DETACH))
        .filter_map(|n| one(n).map(str::to_owned))
        .collect();
    let attached = |n: &Node| {
        m.ops.get(n.op).is_some_and(|o| o.name == FAKE_TENSOR)
            && n.args[1..3].iter().any(|a| matches!(a, Arg::Ref(r) if !made_by_detach.contains(r)))
    };
    if !m.graph.nodes.iter().any(attached) {
        return;
    }
    let todo: Vec<bool> = m.graph.nodes.iter().map(attached).collect();
    let mut names = super::emit::value_names(&m.graph);
    for (i, mut node) in std::mem::take(&mut m.graph.nodes).into_iter().enumerate() {
        if todo[i] {
            let base = format!("{}_param", one(&node).unwrap_or("fake_quantize"));
            let mut e = super::emit::Emit::new(&mut m.ops, &mut names, base);
            for a in &mut node.args[1..3] {
                if matches!(a, Arg::Ref(r) if !made_by_detach.contains(r)) {
                    *a = e.call(DETACH, vec![a.clone()], &[]);
                }
            }
            m.graph.nodes.extend(e.nodes);
        }
        m.graph.nodes.push(node);
    }
}

/// Each static fake quantization of a `cat` whose inputs are each a fake quantization's value
/// with the same parameters goes, its readers reading the `cat` (already on those levels:
/// quantizing is idempotent); not one whose value leaves the graph. Returns how many.
fn of_quantized_cats(m: &mut Method) -> usize {
    let g = &m.graph;
    let op_of = |n: &Node| m.ops.get(n.op).map_or("", |o| o.name.as_str());
    let read = readers(g);
    let maker: HashMap<&str, usize> = g.nodes.iter().enumerate().filter_map(|(i, n)| Some((one(n)?, i))).collect();
    let made_by = |r: &Arg| match r {
        Arg::Ref(r) => maker.get(r.as_str()).map(|&i| &g.nodes[i]),
        _ => None,
    };
    let mut renamed: HashMap<String, String> = HashMap::new();
    let mut removed = vec![false; g.nodes.len()];
    for (i, f) in g.nodes.iter().enumerate() {
        let [x @ Arg::Ref(c), Arg::Float(_), ..] = &f.args[..] else { continue };
        let Some(out) = one(f).filter(|_| op_of(f) == FAKE && f.kwargs.is_empty()) else { continue };
        let leaves = read.get(out).is_some_and(|r| r.contains(&super::readers::OUTSIDE));
        let Some(cat) = made_by(x).filter(|n| op_of(n) == "aten::cat.default" && n.kwargs.is_empty()) else { continue };
        let Some(Arg::List(inputs)) = cat.args.first() else { continue };
        let quantized = |a: &Arg| made_by(a).is_some_and(|q| op_of(q) == FAKE && q.args[1..] == f.args[1..]);
        if !leaves && !inputs.is_empty() && inputs.iter().all(quantized) {
            renamed.insert(out.to_owned(), c.clone());
            removed[i] = true;
        }
    }
    rename_refs(m, &renamed, &removed)
}

/// Redirects the readers of each key of `renamed` to its value and drops the `removed`
/// nodes; returns how many values were renamed.
fn rename_refs(m: &mut Method, renamed: &HashMap<String, String>, removed: &[bool]) -> usize {
    super::redirect(&mut m.graph, renamed);
    super::remove_nodes(&mut m.graph.nodes, removed);
    renamed.len()
}

/// The quantize → dequantize pairs as fake quantizations; returns how many.
fn pairs(m: &mut Method) -> usize {
    let g = &m.graph;
    let op_of = |n: &Node| m.ops.get(n.op).map_or("", |o| o.name.as_str());
    let maker: HashMap<&str, usize> = g.nodes.iter().enumerate().filter_map(|(i, n)| Some((one(n)?, i))).collect();
    let mut found = Vec::new();
    for (i, dq) in g.nodes.iter().enumerate() {
        let overload = match op_of(dq) {
            "quantized_decomposed::dequantize_per_tensor.default" => "default",
            "quantized_decomposed::dequantize_per_tensor.tensor" => "tensor",
            _ => continue,
        };
        let Some(Arg::Ref(qv)) = dq.args.first() else { continue };
        let Some(q) = maker.get(qv.as_str()).map(|&j| &g.nodes[j]) else { continue };
        let quantize = op_of(q) == format!("quantized_decomposed::quantize_per_tensor.{overload}");
        if !quantize || !super::linear_int8::is_pair(q, dq) {
            continue;
        }
        let [x @ Arg::Ref(_), scale, zp, Arg::Int(qmin), Arg::Int(qmax), _] = &q.args[..] else { continue };
        // Literal parameters (static quantization), or tensors (dynamic: the same two for both).
        let (op, params_ok) = match (scale, zp) {
            (Arg::Float(s), Arg::Int(z)) => (FAKE, s.0.is_finite() && s.0 > 0.0 && (qmin..=qmax).contains(&z)),
            (Arg::Ref(_), Arg::Ref(_)) => (FAKE_TENSOR, true),
            _ => continue,
        };
        if !params_ok {
            continue;
        }
        let args = vec![x.clone(), scale.clone(), zp.clone(), Arg::Int(*qmin), Arg::Int(*qmax)];
        found.push((i, maker[qv.as_str()], op, args));
    }
    if found.is_empty() {
        return 0;
    }
    for (i, _, op, args) in &found {
        let op = super::op_index(&mut m.ops, op);
        let node = &mut m.graph.nodes[*i];
        (node.op, node.args, node.kwargs) = (op, args.clone(), Default::default());
    }
    // The quantizes nothing reads now.
    let read = readers(&m.graph);
    let mut removed = vec![false; m.graph.nodes.len()];
    for &(_, qi, _, _) in &found {
        removed[qi] = m.graph.nodes[qi].outputs.names().all(|o| !read.contains_key(o));
    }
    super::remove_nodes(&mut m.graph.nodes, &removed);
    found.len()
}

/// Each fake quantization of a value with the same parameters as an earlier one of it, or of
/// that one's value, goes, its readers reading the earlier one's value; not one whose value
/// leaves the graph, which would make two outputs one tensor. Returns how many.
fn merge(m: &mut Method) -> usize {
    let g = &m.graph;
    let read = readers(g);
    let leaves =
        |n: &Node| n.outputs.names().any(|o| read.get(o).is_some_and(|r| r.contains(&super::readers::OUTSIDE)));
    // Each kept one's op, arguments and value (arguments hold floats: compared, not hashed).
    let mut first: Vec<(usize, &[Arg], &str)> = Vec::new();
    let mut renamed: HashMap<String, String> = HashMap::new();
    let mut removed = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        let fake = m.ops.get(n.op).is_some_and(|o| o.name == FAKE || o.name == FAKE_TENSOR);
        let Some(out) = one(n).filter(|_| fake && n.kwargs.is_empty()) else { continue };
        // The same fake quantization of the value, or of this value's own fake quantization
        // with the same parameters (a max pool's, which shares its input's): the same values,
        // quantizing being idempotent (`(l - zp) * scale * (1 / scale)` rounds back to `l - zp`).
        let same = |(op, args, _): &&(usize, &[Arg], &str)| *op == n.op && *args == n.args.as_slice();
        let again = |(op, args, out): &&(usize, &[Arg], &str)| {
            *op == n.op && args[1..] == n.args[1..] && matches!(&n.args[0], Arg::Ref(x) if x == out)
        };
        match first.iter().find(same).map(|f| f.2).or_else(|| first.iter().find(again).map(|f| f.2)) {
            Some(kept) if !leaves(n) => {
                renamed.insert(out.to_owned(), kept.to_owned());
                removed[i] = true;
            }
            Some(_) => {}
            None => first.push((n.op, n.args.as_slice(), out)),
        }
    }
    rename_refs(m, &renamed, &removed)
}

/// Each fake quantization a max pool alone reads, moved after the pool: the pool reads its
/// input (and binds the value the fake quantization did, which nothing else reads), the fake
/// quantization reads the pool's result and binds the pool's value. Returns how many.
fn after_pools(m: &mut Method) -> usize {
    let g = &m.graph;
    let read = readers(g);
    let is = |n: &Node, names: &[&str]| m.ops.get(n.op).is_some_and(|o| names.contains(&o.name.as_str()));
    let moves: Vec<(usize, usize)> = (g.nodes.iter().enumerate())
        .filter(|(_, f)| is(f, &[FAKE, FAKE_TENSOR]) && f.kwargs.is_empty())
        .filter_map(|(i, f)| {
            let p = super::readers::sole_reader(&read, f)?;
            let pool = &g.nodes[p];
            let reads = matches!(pool.args.first(), Some(Arg::Ref(x)) if Some(x.as_str()) == one(f));
            // Its other arguments literals, so that it can run where the fake quantization did.
            let mut refs = 0;
            pool.args[1..].iter().chain(pool.kwargs.values()).for_each(|a| a.for_each_ref(&mut |_| refs += 1));
            (is(pool, &["aten::max_pool2d.default"]) && reads && refs == 0 && one(pool).is_some()).then_some((i, p))
        })
        .collect();
    for &(i, p) in &moves {
        let (f, pool) = (m.graph.nodes[i].clone(), m.graph.nodes[p].clone());
        let Arg::Ref(x) = &f.args[0] else { continue };
        let mut new_pool = pool.clone();
        new_pool.args[0] = Arg::Ref(x.clone());
        new_pool.outputs = f.outputs.clone();
        let mut new_fake = f.clone();
        new_fake.args[0] = Arg::Ref(one(&f).unwrap_or_default().to_owned());
        new_fake.outputs = pool.outputs;
        // The pool where the fake quantization was (its input is defined by then), the fake
        // quantization where the pool was (so are the pool's other arguments and its own).
        m.graph.nodes[i] = new_pool;
        m.graph.nodes[p] = new_fake;
    }
    moves.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `x → quantize → dequantize → relu`, with `edit` applied to the JSON.
    fn method(edit: impl FnOnce(&mut serde_json::Value)) -> Method {
        let params = || json!([{"float": 0.02}, {"int": 131}, {"int": 0}, {"int": 255}, {"dtype": "uint8"}]);
        let with = |first: &str| {
            let mut a = vec![json!({"ref": first})];
            a.extend(params().as_array().unwrap().iter().cloned());
            a
        };
        let mut m = json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": "quantized_decomposed::quantize_per_tensor.default", "schema": "s"},
                    {"name": "quantized_decomposed::dequantize_per_tensor.default", "schema": "s"},
                    {"name": "aten::relu.default", "schema": "s"}],
            "graph": {
                "inputs": [{"name": "x", "source": {"user": 0}}],
                "nodes": [
                    {"op": 0, "args": with("x"), "outputs": {"one": "q"}},
                    {"op": 1, "args": with("q"), "outputs": {"one": "xd"}},
                    {"op": 2, "args": [{"ref": "xd"}], "outputs": {"one": "y"}}],
                "outputs": [{"ref": "y"}]}
        });
        edit(&mut m);
        serde_json::from_value(m).unwrap()
    }

    #[test]
    fn a_quantize_and_its_dequantize_become_one_fake_quantize() {
        let mut m = method(|_| {});
        assert_eq!(apply(&mut m), 1);
        let node = &m.graph.nodes[0];
        assert_eq!(m.ops[node.op].name, FAKE);
        let want =
            [Arg::Ref("x".into()), Arg::Float(crate::schema::Float(0.02)), Arg::Int(131), Arg::Int(0), Arg::Int(255)];
        assert_eq!(node.args, want);
        // The quantize, which nothing reads now, went; nothing is found twice.
        let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(ops, [FAKE, "aten::relu.default"]);
        assert_eq!(apply(&mut m), 0);
        // A quantize something else reads (an output) stays.
        let mut m = method(|m| m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "q"}]));
        assert_eq!(apply(&mut m), 1);
        assert_eq!(m.graph.nodes.len(), 3);
    }

    #[test]
    fn a_quantize_read_by_two_dequantizes_becomes_one_fake_quantize_both_read() {
        let second = |m: &mut serde_json::Value| {
            let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
            let mut dq = nodes[1].clone();
            dq["outputs"] = json!({"one": "xd2"});
            nodes.insert(2, dq);
            nodes.push(json!({"op": 2, "args": [{"ref": "xd2"}], "outputs": {"one": "y2"}}));
            m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "y2"}]);
        };
        let mut m = method(second);
        let (p, g) = (pairs(&mut m), merge(&mut m));
        assert_eq!((p, g), (2, 1), "two pairs, one merged");
        let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(ops, [FAKE, "aten::relu.default", "aten::relu.default"]);
        assert!(m.graph.nodes[1..].iter().all(|n| n.args == [Arg::Ref("xd".into())]));
        assert_eq!(apply(&mut m), 0);
        // A second fake quantization whose value is an output stays.
        let mut m = method(|m| {
            second(m);
            m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "xd2"}]);
        });
        assert_eq!(apply(&mut m), 2);
        assert_eq!(m.graph.nodes.iter().filter(|n| m.ops[n.op].name == FAKE).count(), 2);
        // A fake quantization of the first one's value, with its parameters: the same values.
        let mut m = method(second);
        pairs(&mut m);
        m.graph.nodes[1].args[0] = Arg::Ref("xd".into());
        assert_eq!(merge(&mut m), 1);
        assert!(m.graph.nodes[1..].iter().all(|n| n.args == [Arg::Ref("xd".into())]));
        // One of other parameters (a fake quantization in the file) stays.
        let mut m = method(second);
        pairs(&mut m);
        m.graph.nodes[1].args[1] = Arg::Float(crate::schema::Float(0.03));
        assert_eq!(merge(&mut m), 0);
    }

    #[test]
    fn a_fake_quantization_of_a_cat_of_values_quantized_alike_goes() {
        // y = relu(xd) becomes c = cat([xd, xd], 1), then yq = fake_quantize(c, same), read by
        // a relu.
        let cat = |params: serde_json::Value| {
            move |m: &mut serde_json::Value| {
                m["ops"][2]["name"] = json!("aten::cat.default");
                m["ops"].as_array_mut().unwrap().push(json!({"name": FAKE, "schema": "s"}));
                m["ops"].as_array_mut().unwrap().push(json!({"name": "aten::relu.default", "schema": "s"}));
                m["graph"]["nodes"][2] = json!({"op": 2, "args": [{"list": [{"ref": "xd"}, {"ref": "xd"}]}, {"int": 1}], "outputs": {"one": "c"}});
                let mut args = vec![json!({"ref": "c"})];
                args.extend(params.as_array().unwrap().iter().cloned());
                let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
                nodes.push(json!({"op": 3, "args": args, "outputs": {"one": "yq"}}));
                nodes.push(json!({"op": 4, "args": [{"ref": "yq"}], "outputs": {"one": "y"}}));
            }
        };
        let same = json!([{"float": 0.02}, {"int": 131}, {"int": 0}, {"int": 255}]);
        let mut m = method(cat(same));
        apply(&mut m);
        let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(ops, [FAKE, "aten::cat.default", "aten::relu.default"]);
        assert_eq!(m.graph.nodes[2].args, [Arg::Ref("c".into())]);
        // Another scale: the values aren't on its levels, it stays.
        let other = json!([{"float": 0.03}, {"int": 131}, {"int": 0}, {"int": 255}]);
        let mut m = method(cat(other));
        apply(&mut m);
        assert_eq!(m.graph.nodes.iter().filter(|n| m.ops[n.op].name == FAKE).count(), 2);
    }

    #[test]
    fn a_fake_quantization_a_max_pool_alone_reads_runs_after_it() {
        let pooled = |m: &mut serde_json::Value| {
            m["ops"][2]["name"] = json!("aten::max_pool2d.default");
            m["graph"]["nodes"][2]["args"] = json!([{"ref": "xd"}, {"list": [{"int": 3}, {"int": 3}]}]);
        };
        let mut m = method(pooled);
        assert_eq!(apply(&mut m), 2, "the pair, then the move");
        let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(ops, ["aten::max_pool2d.default", FAKE]);
        let (pool, fake) = (&m.graph.nodes[0], &m.graph.nodes[1]);
        assert_eq!((pool.args[0].clone(), one(pool)), (Arg::Ref("x".into()), Some("xd")));
        assert_eq!((fake.args[0].clone(), one(fake)), (Arg::Ref("xd".into()), Some("y")));
        assert_eq!(apply(&mut m), 0);
        // Something else reads the fake quantization: it stays before the pool.
        let mut m = method(|m| {
            pooled(m);
            m["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "xd"}]);
        });
        assert_eq!(apply(&mut m), 1);
        assert_eq!(m.ops[m.graph.nodes[0].op].name, FAKE);
    }

    #[test]
    fn a_pair_of_tensor_parameters_becomes_the_tensor_qparams_overload() {
        let tensors = |m: &mut serde_json::Value| {
            for (i, op) in [(0, "quantize"), (1, "dequantize")] {
                m["ops"][i]["name"] = json!(format!("quantized_decomposed::{op}_per_tensor.tensor"));
                m["graph"]["nodes"][i]["args"][1] = json!({"ref": "s"});
                m["graph"]["nodes"][i]["args"][2] = json!({"ref": "z"});
            }
            m["graph"]["inputs"]
                .as_array_mut()
                .unwrap()
                .extend([json!({"name": "s", "source": {"user": 1}}), json!({"name": "z", "source": {"user": 2}})]);
        };
        let mut m = method(tensors);
        assert_eq!(apply(&mut m), 1);
        // The parameters read through `detach` (autograd), then the fake quantization.
        let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(ops[..3], ["aten::detach.default", "aten::detach.default", FAKE_TENSOR]);
        let detached: Vec<&Arg> = m.graph.nodes[..2].iter().map(|n| &n.args[0]).collect();
        assert_eq!(detached, [&Arg::Ref("s".into()), &Arg::Ref("z".into())]);
        let node = &m.graph.nodes[2];
        let made = |i: usize| Arg::Ref(one(&m.graph.nodes[i]).unwrap().to_owned());
        assert_eq!(node.args, [Arg::Ref("x".into()), made(0), made(1), Arg::Int(0), Arg::Int(255)]);
        let before = m.graph.nodes.len();
        apply(&mut m);
        assert_eq!(m.graph.nodes.len(), before, "detached once");
        // Other tensors on the dequantize: another pair.
        let mut m = method(|m| {
            tensors(m);
            m["graph"]["nodes"][1]["args"][1] = json!({"ref": "x"});
        });
        assert_eq!(apply(&mut m), 0);
    }

    #[test]
    fn leaves_other_pairs_alone() {
        let cases: [fn(&mut serde_json::Value); 5] = [
            // Other parameters on the dequantize.
            |m| m["graph"]["nodes"][1]["args"][2] = json!({"int": 130}),
            // A dtype wider than 8 bits, or a range outside the dtype's.
            |m| {
                m["graph"]["nodes"][0]["args"][5] = json!({"dtype": "int32"});
                m["graph"]["nodes"][1]["args"][5] = json!({"dtype": "int32"});
            },
            |m| {
                m["graph"]["nodes"][0]["args"][4] = json!({"int": 256});
                m["graph"]["nodes"][1]["args"][4] = json!({"int": 256});
            },
            // A dequantize to another dtype than float32.
            |m| m["graph"]["nodes"][1]["kwargs"] = json!({"out_dtype": {"dtype": "bfloat16"}}),
            // A zero scale (torch refuses it at run time).
            |m| {
                m["graph"]["nodes"][0]["args"][1] = json!({"float": 0.0});
                m["graph"]["nodes"][1]["args"][1] = json!({"float": 0.0});
            },
        ];
        for (i, case) in cases.into_iter().enumerate() {
            assert_eq!(apply(&mut method(case)), 0, "case {i}");
        }
    }
}
