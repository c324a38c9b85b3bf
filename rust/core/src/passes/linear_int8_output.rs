//! The fake quantization of an int8 linear's result into the linear (`optimize="fast"`, at
//! load, with the runtime's kernels). Where a statically quantized program feeds an int8
//! linear's result to an op no int8 kernel takes (MobileNet's 1×1 expansion into its
//! depthwise convolution), `fake_quantize` leaves
//!
//! ```text
//! y  = kwexport::linear_int8(x, ..., attr, algorithm)
//! ym = movedim(y, -1, -3)                          (a 1×1 convolution's; or none)
//! yq = fake_quantize_per_tensor_affine(ym, scale, zp, qmin, qmax)
//! ```
//!
//! a pass over the whole result (the largest activations of a MobileNet, 1.2 M values, 8%
//! of its call) that the GEMM can do as it stores each result: the linear takes `scale, zp,
//! qmin, qmax` as its `out_*` arguments, the fake quantization goes, and the view (or the
//! linear) binds its value. Elementwise, so the same values through the view; the runtime's
//! kernel computes them as `fake_quantize`'s does (the same bits), the op's Python form runs
//! torch's `fake_quantize_per_tensor_affine` after the activation.
//!
//! Only where the fake quantization alone reads the chain (nothing else sees the unquantized
//! result), or, besides it, int8 ops that quantize the linear's result with the same
//! parameters, directly or through the view that makes it a 1×1 convolution's pixels (a ResNet
//! block's output, read by the next block's convolution and its residual add: they then read
//! the quantized value, whose levels are the same), with literal parameters (a static scale;
//! dynamic ones are chosen per call from the values), on a linear that quantizes nothing yet. It runs after `fake_quantize`, which
//! makes the node (`super::registered`).

use super::fake_quantize::FAKE;
use super::linear_int8::{CONV, CONV_DYNAMIC, CONV_RESIDUAL, FUSED, FUSED_OPS};
use super::pass::{Ctx, Pass};
use super::readers::{one, readers, sole_reader, OUTSIDE};
use super::{Level, Target};
use crate::schema::{Arg, Method, Node};

/// The arguments of the fused op before the output's quantization: the input and its
/// parameters (five), the weight, its scales and zero points, the bias, `attr, algorithm`
/// (the convolution's stride, padding and groups before those: three more; and the residual
/// after them: one more).
const ARGS: usize = 11;

/// The pass (`fast`, where the runtime has its kernels).
pub struct LinearInt8Output;

impl Pass for LinearInt8Output {
    fn name(&self) -> &'static str {
        "linear_int8_output"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn runs_for(&self, target: Target) -> bool {
        target.gemm
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, _, _| apply(m))
    }
}

/// Moves each fake quantization of an int8 linear's result into the linear; returns how many.
pub fn apply(m: &mut Method) -> usize {
    let g = &m.graph;
    let op_of = |n: &Node| m.ops.get(n.op).map_or("", |o| o.name.as_str());
    let read = readers(g);
    let maker: std::collections::HashMap<&str, usize> =
        g.nodes.iter().enumerate().filter_map(|(i, n)| Some((one(n)?, i))).collect();
    // The linear it goes into, the node that binds the quantized value (the view, or the
    // linear), the fake quantization's node,
    // and the int8 ops that read the result besides.
    let mut found: Vec<(usize, usize, usize, Vec<usize>)> = Vec::new();
    for (i, f) in g.nodes.iter().enumerate() {
        let [Arg::Ref(x), Arg::Float(_), Arg::Int(_), Arg::Int(_), Arg::Int(_)] = &f.args[..] else { continue };
        if op_of(f) != FAKE || !f.kwargs.is_empty() || one(f).is_none() {
            continue;
        }
        let Some(&p) = maker.get(x.as_str()) else { continue };
        // The other readers of the result: none, or (the linear's own result) int8 ops that
        // quantize it with the fake quantization's parameters, which then read the quantized
        // value: the same levels (quantizing `(q - zp) * scale` again gives `q`: its error is
        // far under half a step).
        let others: Vec<usize> = read.get(x.as_str()).into_iter().flatten().copied().filter(|&j| j != i).collect();
        // An int8 op reading `input` once as its quantized input, with these parameters.
        let quantizes = |r: &Node, input: &Arg| {
            let same = r.args.get(1..5) == Some(&f.args[1..]) && r.args.first() == Some(input);
            let once = r.args.iter().filter(|a| *a == input).count() == 1;
            [FUSED, CONV, CONV_RESIDUAL].contains(&op_of(r)) && same && once
        };
        // Such an op, or the view that makes the result a 1×1 convolution's pixels
        // (`linear_int8`) read by such an op alone.
        let requantizes = |j: usize| {
            let Some(r) = g.nodes.get(j).filter(|_| j != OUTSIDE) else { return false };
            let pixels = [f.args[0].clone(), Arg::Int(-3), Arg::Int(-1)];
            if op_of(r) == "aten::movedim.int" && r.args == pixels && r.kwargs.is_empty() {
                let view = one(r).map(|v| Arg::Ref(v.to_owned()));
                let reader = sole_reader(&read, r).map(|l| &g.nodes[l]);
                return view.zip(reader).is_some_and(|(view, l)| quantizes(l, &view));
            }
            quantizes(r, &f.args[0])
        };
        let direct = op_of(&g.nodes[p]) != "aten::movedim.int";
        if !others.iter().all(|&j| direct && requantizes(j)) {
            continue;
        }
        // Through the view a 1×1 convolution's linear ends in, read by nothing else.
        let linear = match (op_of(&g.nodes[p]), g.nodes[p].args.first()) {
            ("aten::movedim.int", Some(Arg::Ref(y))) => match maker.get(y.as_str()) {
                Some(&l) if sole_reader(&read, &g.nodes[l]) == Some(p) => l,
                _ => continue,
            },
            _ => p,
        };
        let l = &g.nodes[linear];
        let args = match op_of(l) {
            CONV | CONV_DYNAMIC => ARGS + 3,
            CONV_RESIDUAL => ARGS + 4,
            _ => ARGS,
        };
        if FUSED_OPS.contains(&op_of(l)) && l.args.len() == args && l.kwargs.is_empty() {
            found.push((linear, p, i, others));
        }
    }
    let mut removed = vec![false; m.graph.nodes.len()];
    for (linear, binds, fake, others) in &found {
        let f = m.graph.nodes[*fake].clone();
        m.graph.nodes[*linear].args.extend(f.args[1..].iter().cloned());
        if let Some(quantized) = one(&f) {
            others.iter().for_each(|&j| m.graph.nodes[j].args[0] = Arg::Ref(quantized.to_owned()));
        }
        m.graph.nodes[*binds].outputs = f.outputs;
        removed[*fake] = true;
    }
    super::remove_nodes(&mut m.graph.nodes, &removed);
    found.len()
}

#[cfg(test)]
mod tests {
    use super::super::linear_int8::FUSED;
    use super::*;
    use serde_json::json;

    /// `y = linear_int8(x, ...)`, `ym = movedim(y, -1, -3)` (with `view`), `yq =
    /// fake_quantize(ym or y, ...)`, `out = relu(yq)`; `edit` applied to the JSON.
    fn method(view: bool, edit: impl FnOnce(&mut serde_json::Value)) -> Method {
        let linear = json!({"op": 0, "args": [
            {"ref": "x"}, {"float": 0.02}, {"int": 128}, {"int": 0}, {"int": 255},
            {"ref": "w"}, {"ref": "ws"}, {"ref": "wz"}, {"none": null}, {"str": "hardtanh"}, {"none": null}],
            "outputs": {"one": "y"}});
        let fq = |x: &str| {
            json!({"op": 2, "args": [{"ref": x}, {"float": 0.05}, {"int": 3}, {"int": 0}, {"int": 255}],
            "outputs": {"one": "yq"}})
        };
        let mut nodes = vec![linear];
        if view {
            nodes.push(json!({"op": 1, "args": [{"ref": "y"}, {"int": -1}, {"int": -3}], "outputs": {"one": "ym"}}));
        }
        nodes.push(fq(if view { "ym" } else { "y" }));
        nodes.push(json!({"op": 3, "args": [{"ref": "yq"}], "outputs": {"one": "out"}}));
        let mut m = json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": FUSED, "schema": null}, {"name": "aten::movedim.int", "schema": null},
                    {"name": FAKE, "schema": null}, {"name": "aten::relu.default", "schema": null}],
            "graph": {
                "inputs": [{"name": "x", "source": {"user": 0}}, {"name": "w", "source": {"weight": "w"}},
                           {"name": "ws", "source": {"weight": "ws"}}, {"name": "wz", "source": {"weight": "wz"}}],
                "nodes": nodes,
                "outputs": [{"ref": "out"}]}
        });
        edit(&mut m);
        serde_json::from_value(m).unwrap()
    }

    fn tail(n: &Node) -> Vec<Arg> {
        n.args[ARGS..].to_vec()
    }

    #[test]
    fn a_linears_fake_quantization_goes_into_it_through_the_view_or_without() {
        for view in [true, false] {
            let mut m = method(view, |_| {});
            assert_eq!(apply(&mut m), 1);
            let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
            let want: &[&str] =
                if view { &[FUSED, "aten::movedim.int", "aten::relu.default"] } else { &[FUSED, "aten::relu.default"] };
            assert_eq!(ops, want);
            assert_eq!(
                tail(&m.graph.nodes[0]),
                [Arg::Float(crate::schema::Float(0.05)), Arg::Int(3), Arg::Int(0), Arg::Int(255)]
            );
            // The last node of the chain binds the quantized value the ReLU reads.
            assert_eq!(one(&m.graph.nodes[ops.len() - 2]), Some("yq"));
            assert_eq!(apply(&mut m), 0, "nothing left to fuse");
        }
    }

    #[test]
    fn another_reader_of_the_result_or_a_quantized_linear_keeps_the_fake_quantization() {
        let read_twice = |m: &mut serde_json::Value| m["graph"]["outputs"] = json!([{"ref": "out"}, {"ref": "ym"}]);
        let read_linear = |m: &mut serde_json::Value| m["graph"]["outputs"] = json!([{"ref": "out"}, {"ref": "y"}]);
        let tensor_params = |m: &mut serde_json::Value| m["graph"]["nodes"][2]["args"][1] = json!({"ref": "x"});
        let quantized = |m: &mut serde_json::Value| {
            let args = m["graph"]["nodes"][0]["args"].as_array_mut().unwrap();
            args.extend([json!({"float": 0.1}), json!({"int": 0}), json!({"int": 0}), json!({"int": 255})]);
        };
        let other_op = |m: &mut serde_json::Value| m["ops"][0]["name"] = json!("aten::linear.default");
        let edits: [&dyn Fn(&mut serde_json::Value); 5] =
            [&read_twice, &read_linear, &tensor_params, &quantized, &other_op];
        for (i, edit) in edits.into_iter().enumerate() {
            let mut m = method(true, edit);
            assert_eq!(apply(&mut m), 0, "case {i}");
            assert_eq!(m.graph.nodes.len(), 4, "case {i}");
        }
    }

    /// `method(false)` with a second int8 linear reading `y`, quantizing it with `scale`.
    fn read_by_a_linear(scale: f64) -> Method {
        method(false, |m| {
            let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
            let mut second = nodes[0].clone();
            second["args"][0] = json!({"ref": "y"});
            second["args"][1] = json!({"float": scale});
            second["outputs"] = json!({"one": "y2"});
            nodes.push(second);
            m["graph"]["outputs"] = json!([{"ref": "out"}, {"ref": "y2"}]);
        })
    }

    #[test]
    fn an_int8_op_quantizing_the_result_alike_reads_the_quantized_value() {
        // The reader quantizes with the fake quantization's parameters: the same levels.
        let mut m = read_by_a_linear(0.05);
        m.graph.nodes[3].args[2..5].clone_from_slice(&[Arg::Int(3), Arg::Int(0), Arg::Int(255)]);
        assert_eq!(apply(&mut m), 1);
        let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(ops, [FUSED, "aten::relu.default", FUSED]);
        assert_eq!(m.graph.nodes[2].args[0], Arg::Ref("yq".into()));
        // With another scale it would quantize other levels: left alone.
        let mut m = read_by_a_linear(0.07);
        assert_eq!(apply(&mut m), 0);
    }

    /// `read_by_a_linear(scale)` with the second linear a 1×1 convolution's, reading `y`
    /// through the view to pixels (`pixels`: its source and destination).
    fn read_through_pixels(scale: f64, pixels: [i64; 2]) -> Method {
        let mut m = serde_json::to_value(read_by_a_linear(scale)).unwrap();
        let nodes = m["graph"]["nodes"].as_array_mut().unwrap();
        nodes[3]["args"][0] = json!({"ref": "yp"});
        nodes[3]["args"][2] = json!({"int": 3});
        let view =
            json!({"op": 1, "args": [{"ref": "y"}, {"int": pixels[0]}, {"int": pixels[1]}], "outputs": {"one": "yp"}});
        nodes.insert(3, view);
        serde_json::from_value(m).unwrap()
    }

    #[test]
    fn a_1x1_convolution_quantizing_the_result_alike_reads_the_quantized_value_through_its_view() {
        // A ResNet bottleneck's output, read by the next block's 1×1 convolution (an int8
        // linear over its pixels) and, fake-quantized, by that block's residual add.
        let mut m = read_through_pixels(0.05, [-3, -1]);
        assert_eq!(apply(&mut m), 1);
        let ops: Vec<&str> = m.graph.nodes.iter().map(|n| m.ops[n.op].name.as_str()).collect();
        assert_eq!(ops, [FUSED, "aten::relu.default", "aten::movedim.int", FUSED]);
        assert_eq!(m.graph.nodes[2].args[0], Arg::Ref("yq".into()));
        // Another scale, or another view, is left alone.
        for m in [read_through_pixels(0.07, [-3, -1]), read_through_pixels(0.05, [-1, -3])] {
            let mut m = m;
            assert_eq!(apply(&mut m), 0);
        }
    }
}
