//! Batch norm folded into the convolution before it (`optimize="fast"`). In eval mode a batch
//! norm is a per-channel affine map, `y = (c - mean) * s + beta` with
//! `s = gamma / sqrt(var + eps)`, and a convolution is linear in its weight, so
//!
//! ```text
//! c = conv(x, W, b);  y = batch_norm(c, gamma, beta, mean, var, training=False, eps)
//! ```
//!
//! becomes `y = conv(x, W * s, (b - mean) * s + beta)`: one node and one pass over the output
//! instead of two. The pass decides; the new weights are computed with torch where the
//! weights are (`kwexport._passes`, at load or when a file is written), as [`Fold`] says.
//!
//! The folded tensors take the place of existing ones, so the weight table keeps its shapes:
//! `W` holds `W * s`, and the bias goes where the convolution's bias was, or else where
//! `beta` was. Each weight involved must be read by this pattern alone, in every method
//! (a weight another node reads keeps its value), must be float32, bfloat16 or float16 (a
//! reduced-precision model's new weights are computed in float64 and rounded once to its
//! dtype, as eager rounds the convolution's output) and must not be state.

use std::collections::{BTreeMap, HashMap};

use super::pass::{Ctx, Pass};
use super::readers::{one, sole_reader, weight_inputs, Readers};
use super::{Level, Target};
use crate::schema::{Arg, Document, InputSource, Method, Node, Outputs, WeightTensor};

/// The dtypes a folded weight may have.
const FLOATS: [&str; 3] = ["float32", "bfloat16", "float16"];

/// One folded pair, by weight name (the file's, not the graph's), for the code that computes
/// the new tensors: `weight <- weight * s` and `bias <- (conv_bias - mean) * s + beta`, with
/// `s = gamma / sqrt(var + eps)`, an absent `gamma` 1 and an absent `conv_bias` or `beta` 0.
/// Every value is read from the tensors as they were before any fold is applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Fold {
    /// The convolution's weight, rewritten.
    pub weight: String,
    /// The weight that receives the folded bias: `conv_bias`, or else `beta`.
    pub bias: String,
    /// The convolution's bias, if it has one.
    pub conv_bias: Option<String>,
    /// The batch norm's scale, if affine.
    pub gamma: Option<String>,
    /// The batch norm's shift, if affine.
    pub beta: Option<String>,
    /// The running mean.
    pub mean: String,
    /// The running variance.
    pub var: String,
    /// The batch norm's epsilon.
    pub eps: f64,
}

/// Folds every batch norm that follows a convolution, in every method; returns the folds.
pub fn apply(doc: &mut Document) -> Vec<Fold> {
    let mut cx = Ctx::new(doc, Target::default());
    BatchNorm.apply(&mut cx);
    cx.rewrites.folds
}

/// The pass (`fast`): its folds go to `Rewrites::folds`, for the runtime to compute.
pub struct BatchNorm;

impl Pass for BatchNorm {
    fn name(&self) -> &'static str {
        "batch_norm"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        let named = named(cx.doc);
        let mut folds = Vec::new();
        let made = cx.each_method(|_, m, readers, weights| {
            let found = fold_method(m, &weights.tensors, &named, readers);
            let n = found.len();
            folds.extend(found);
            n
        });
        cx.rewrites.folds.extend(folds);
        made
    }
}

/// How often each weight is named anywhere: by a graph input, or as a parameter's default.
fn named(doc: &Document) -> HashMap<String, usize> {
    // How often each weight is named anywhere: by a graph input, or as a parameter's default.
    let mut named: HashMap<String, usize> = HashMap::new();
    for m in doc.methods.values() {
        for i in &m.graph.inputs {
            if let InputSource::Weight(w) = &i.source {
                *named.entry(w.clone()).or_default() += 1;
            }
        }
        for p in &m.signature.params {
            if let Some(w) = &p.default_weight {
                *named.entry(w.clone()).or_default() += 1;
            }
        }
    }
    named
}

fn fold_method(
    m: &mut Method,
    tensors: &BTreeMap<String, WeightTensor>,
    named: &HashMap<String, usize>,
    readers: &Readers,
) -> Vec<Fold> {
    let g = &m.graph;
    let op_of = |n: &Node| m.ops.get(n.op).map(|o| o.name.as_str());
    let weight_of = weight_inputs(g);
    // A float weight (with `channels`, a vector of that many) read only by node `reader`,
    // named once in the file, not state: its weight name.
    let sole_weight = |a: &Arg, reader: usize, channels: Option<i64>| -> Option<String> {
        let Arg::Ref(input) = a else { return None };
        let w = *weight_of.get(input.as_str())?;
        let t = tensors.get(w)?;
        let fits = FLOATS.contains(&t.dtype.as_str())
            && !t.mutable
            && named.get(w) == Some(&1)
            && readers.get(input.as_str()).is_some_and(|r| r.as_slice() == [reader])
            && channels.is_none_or(|c| t.shape == [c]);
        fits.then(|| w.to_owned())
    };
    let optional = |a: Option<&Arg>, reader: usize, channels: i64| -> Option<Option<String>> {
        match a {
            None | Some(Arg::None(())) => Some(None),
            Some(a) => sole_weight(a, reader, Some(channels)).map(Some),
        }
    };
    let mut found: Vec<(usize, usize, Fold, String)> = Vec::new();
    for (ci, conv) in g.nodes.iter().enumerate() {
        // torch's forward convolutions (a batch norm folds before any lowering).
        let Some(op) = super::conv::of(op_of(conv)).filter(|c| c.torch) else { continue };
        if !conv.kwargs.is_empty() || op.transposed(conv) {
            continue;
        }
        let Some(w_name) = conv.args.get(op.weight).and_then(|a| sole_weight(a, ci, None)) else { continue };
        let w = &tensors[&w_name];
        let (Some(&channels), true) = (w.shape.first(), w.shape.len() >= 3) else { continue };
        let Some(conv_bias) = optional(conv.args.get(op.bias), ci, channels) else { continue };
        let Some(bi) = sole_reader(readers, conv) else { continue };
        let bn = &g.nodes[bi];
        let Some((y, [gamma, beta, mean, var], eps)) = batch_norm(op_of(bn), bn, readers) else { continue };
        if !matches!(bn.args.first(), Some(Arg::Ref(r)) if Some(r.as_str()) == one(conv)) {
            continue;
        }
        let (Some(gamma), Some(beta)) = (optional(Some(gamma), bi, channels), optional(Some(beta), bi, channels))
        else {
            continue;
        };
        let (Some(mean), Some(var)) = (sole_weight(mean, bi, Some(channels)), sole_weight(var, bi, Some(channels)))
        else {
            continue;
        };
        let Some(bias) = conv_bias.clone().or_else(|| beta.clone()) else { continue };
        // One dtype throughout: the bias may take `beta`'s place, next to the weight.
        let names = [&conv_bias, &gamma, &beta].into_iter().flatten().chain([&mean, &var, &bias]);
        if names.into_iter().any(|n| tensors[n].dtype != w.dtype) {
            continue;
        }
        let fold = Fold { weight: w_name, bias, conv_bias, gamma, beta, mean, var, eps };
        found.push((ci, bi, fold, y.to_owned()));
    }
    if found.is_empty() {
        return Vec::new();
    }
    // The graph's name for each weight the folds name.
    let input_of: HashMap<String, String> =
        weight_of.iter().map(|(input, w)| ((*w).to_owned(), (*input).to_owned())).collect();
    let mut removed = vec![false; m.graph.nodes.len()];
    let mut unread_inputs = Vec::new();
    for (ci, bi, fold, y) in &found {
        let conv = &mut m.graph.nodes[*ci];
        if conv.args.len() < 3 {
            conv.args.resize(3, Arg::None(()));
        }
        conv.args[2] = Arg::Ref(input_of[&fold.bias].clone());
        conv.outputs = Outputs::One(y.clone());
        removed[*bi] = true;
        let gone = [&fold.gamma, &fold.beta].into_iter().flatten().chain([&fold.mean, &fold.var]);
        unread_inputs.extend(gone.filter(|w| **w != fold.bias).map(|w| input_of[w].clone()));
    }
    super::remove_nodes(&mut m.graph.nodes, &removed);
    m.graph.inputs.retain(|i| !unread_inputs.contains(&i.name));
    found.into_iter().map(|(_, _, fold, _)| fold).collect()
}

/// An eval-mode batch norm: its output, `[gamma, beta, mean, var]` and eps.
/// `batch_norm(x, gamma, beta, mean, var, training=False, momentum, eps, cudnn)`, or
/// `_native_batch_norm_legit_no_training(x, gamma, beta, mean, var, momentum, eps)` whose
/// second and third outputs nothing reads.
fn batch_norm<'a>(op: Option<&str>, n: &'a Node, readers: &Readers) -> Option<(&'a str, [&'a Arg; 4], f64)> {
    if !n.kwargs.is_empty() {
        return None;
    }
    let params = |a: &'a [Arg]| -> [&'a Arg; 4] { [&a[1], &a[2], &a[3], &a[4]] };
    match (op?, n.args.as_slice()) {
        ("aten::batch_norm.default", a @ [_, _, _, _, _, Arg::Bool(false), _, Arg::Float(eps), _]) => {
            Some((one(n)?, params(a), eps.0))
        }
        ("aten::_native_batch_norm_legit_no_training.default", a @ [_, _, _, _, _, _, Arg::Float(eps)]) => {
            let Outputs::Many(outs) = &n.outputs else { return None };
            let (Some(Some(y)), rest) = (outs.first(), outs.get(1..)?) else { return None };
            rest.iter().flatten().all(|o| !readers.contains_key(o.as_str())).then_some((y.as_str(), params(a), eps.0))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// conv2d(x, w) then batch_norm with every parameter a weight of 4 channels.
    fn doc(mutate: impl FnOnce(&mut serde_json::Value)) -> Document {
        let header = |h: &mut serde_json::Value| {
            let m = &mut h["methods"]["forward"];
            m["ops"] = json!([{"name": "aten::conv2d.default", "schema": null},
                              {"name": "aten::batch_norm.default", "schema": null}]);
            m["graph"]["inputs"] = json!([
                {"name": "pw", "source": {"weight": "w"}}, {"name": "pg", "source": {"weight": "g"}},
                {"name": "pb", "source": {"weight": "b"}}, {"name": "pm", "source": {"weight": "m"}},
                {"name": "pv", "source": {"weight": "v"}}, {"name": "x", "source": {"user": 0}}]);
            m["graph"]["nodes"] = json!([
                {"op": 0, "args": [{"ref": "x"}, {"ref": "pw"}], "outputs": {"one": "c"}},
                {"op": 1, "args": [{"ref": "c"}, {"ref": "pg"}, {"ref": "pb"}, {"ref": "pm"}, {"ref": "pv"},
                                   {"bool": false}, {"float": 0.1}, {"float": 1e-5}, {"bool": false}],
                 "outputs": {"one": "y"}}]);
            m["graph"]["outputs"] = json!([{"ref": "y"}]);
            let vec = |i: usize| json!({"dtype": "float32", "shape": [4], "strides": [1], "storage": 0, "storage_offset": 16 + 4 * i});
            h["weights"]["storages"] = json!([{"offset": 0, "nbytes": 160}]);
            h["weights"]["tensors"] = json!({
                "w": {"dtype": "float32", "shape": [4, 1, 2, 2], "strides": [4, 4, 2, 1], "storage": 0},
                "g": vec(0), "b": vec(1), "m": vec(2), "v": vec(3)});
        };
        super::super::tests::document(header, mutate)
    }

    #[test]
    fn folds_a_batch_norm_into_the_convolution() {
        let mut d = doc(|_| {});
        let folds = apply(&mut d);
        let fold = Fold {
            weight: "w".into(),
            bias: "b".into(),
            conv_bias: None,
            gamma: Some("g".into()),
            beta: Some("b".into()),
            mean: "m".into(),
            var: "v".into(),
            eps: 1e-5,
        };
        assert_eq!(folds, [fold]);
        let g = &d.methods["forward"].graph;
        assert_eq!(g.nodes.len(), 1);
        assert_eq!(g.nodes[0].args, [Arg::Ref("x".into()), Arg::Ref("pw".into()), Arg::Ref("pb".into())]);
        assert_eq!(g.nodes[0].outputs, Outputs::One("y".into()));
        // The inputs only the batch norm read are gone; the bias's stays, read by the conv.
        let inputs: Vec<&str> = g.inputs.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(inputs, ["pw", "pb", "x"]);
        // Idempotent: nothing left to fold.
        assert!(apply(&mut d).is_empty());
    }

    #[test]
    fn the_convolutions_bias_takes_the_folded_bias() {
        let mut d = doc(|h| {
            let m = &mut h["methods"]["forward"]["graph"];
            m["inputs"].as_array_mut().unwrap().push(json!({"name": "pc", "source": {"weight": "c"}}));
            m["nodes"][0]["args"] = json!([{"ref": "x"}, {"ref": "pw"}, {"ref": "pc"}]);
            h["weights"]["tensors"]["c"] =
                json!({"dtype": "float32", "shape": [4], "strides": [1], "storage": 0, "storage_offset": 32});
        });
        let folds = apply(&mut d);
        assert_eq!((folds[0].bias.as_str(), folds[0].conv_bias.as_deref()), ("c", Some("c")));
        assert!(!d.methods["forward"].graph.inputs.iter().any(|i| i.name == "pb"));
    }

    #[test]
    fn folds_a_reduced_precision_model_too() {
        let mut d = doc(|h| {
            for t in h["weights"]["tensors"].as_object_mut().unwrap().values_mut() {
                t["dtype"] = json!("bfloat16");
            }
        });
        assert_eq!(apply(&mut d).len(), 1);
    }

    #[test]
    fn leaves_near_misses_alone() {
        let cases: [fn(&mut serde_json::Value); 7] = [
            // A bfloat16 weight beside float32 statistics: the folded bias would take beta's
            // place in another dtype than the weight's.
            |h| h["weights"]["tensors"]["w"]["dtype"] = json!("bfloat16"),
            // Training mode: the statistics are the batch's.
            |h| h["methods"]["forward"]["graph"]["nodes"][1]["args"][5] = json!({"bool": true}),
            // The convolution's output is read elsewhere too.
            |h| h["methods"]["forward"]["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "c"}]),
            // The mean is state.
            |h| h["weights"]["tensors"]["m"]["mutable"] = json!(true),
            // Another node reads the conv weight.
            |h| h["methods"]["forward"]["graph"]["outputs"] = json!([{"ref": "y"}, {"ref": "pw"}]),
            // Another dtype.
            |h| h["weights"]["tensors"]["w"]["dtype"] = json!("float64"),
            // No bias to hold the folded one.
            |h| {
                h["methods"]["forward"]["graph"]["nodes"][1]["args"][2] = json!({"none": null});
            },
        ];
        for (i, case) in cases.into_iter().enumerate() {
            let mut d = doc(case);
            assert!(apply(&mut d).is_empty(), "case {i}");
            assert_eq!(d.methods["forward"].graph.nodes.len(), 2, "case {i}");
        }
    }
}
