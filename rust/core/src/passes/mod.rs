//! Graph passes: rewrites of a document that need no torch, chosen by the optimization level
//! a program is loaded at. Each pass is a module of its own with its tests; the runtime
//! applies what a pass decides that needs torch (repacking a weight).
//!
//! - [`views_as_reshapes`]  `view` nodes as `reshape`, for tensors whose strides may differ
//!   from the ones the graph was traced with
//! - [`channels_last`]      the convolution weights to hold in channels-last memory format
//! - [`dead_code`]          unread pure nodes and assertions a checked call can't fail (every
//!   level)
//! - [`eval_dropout`]       dropouts of an eval-mode graph (`train=False`) read as their input
//!   (`fast`)
//! - [`rms_norm`]           RMS normalization's six ops as one `rms_norm` node (`fast`)
//! - [`gelu_tanh`]          GELU's tanh form written out in eight ops as one `gelu` node
//!   (`fast`)
//! - [`channel_shuffle`]    a channel shuffle written out in four ops (ShuffleNet's) as one
//!   `channel_shuffle` node, which keeps channels-last tensors so (`fast`)
//! - [`batch_norm`]         eval-mode batch norms folded into the convolution before them
//!   (`fast`; the new weights are computed where the tensors are)
//! - [`dequantize_weights`] convolutions' int8 weights as float32 weights made once at load
//!   (`fast`, at load on a CPU with oneDNN; before `quantized_ops` writes the dequantize out)
//! - [`conv_pointwise`]     convolutions (and the activation after) onto oneDNN's fused
//!   convolution over a weight packed once (`fast`, at load on a CPU with oneDNN)
//! - [`conv_residual`]      a lowered convolution's residual add (and the ReLU after it) as its
//!   post-ops (`fast`, at load, where `conv_pointwise` ran)
//! - [`constant_fold`]      nodes that read only constants, run once at load; the rest of
//!   the graph reads their values as weights (`fast`; the runtime splits the validated graph)
//! - [`linear_int8`]        quantized linears (int8 weight, input quantized per tensor) onto
//!   kwexport's int8 GEMM (`fast`, at load, with the runtime's kernels; before
//!   `quantized_ops` writes their quantize and dequantize ops out)
//! - [`fake_quantize`]      a static quantize → dequantize pair as one fake quantization
//!   (`fast`; before `quantized_ops` writes them out)
//! - [`linear_int8_output`] the fake quantization of an int8 linear's result into the linear,
//!   whose GEMM applies it as it stores (`fast`, at load, with the runtime's kernels)
//! - [`linear_pointwise`]   linears (and the ReLU, SiLU or GELU after) onto oneDNN's fused
//!   linear, whose activation the runtime's GEMM applies (`fast`, at load, with the runtime's
//!   GEMM and oneDNN)
//! - [`linear_concat`]      linears that read one input (an attention block's query, key and
//!   value) as one GEMM over their stacked weights (`fast`, at load, on CUDA with CUDA graphs)
//! - [`linear_measured`]    biased linears onto the GEMM measured fastest on the device
//!   (`fast`, at load, on CUDA with CUDA graphs)
//! - [`linear_gelu`]        a measured linear and the GELU after it as one node, its GEMM and
//!   activation chosen on the device (`fast`, at load, on CUDA with CUDA graphs)
//! - [`add_norm`]           a residual add and the layer or RMS norm after it as one node, one
//!   kernel on the device (`fast`, at load, on CUDA with CUDA graphs)
//! - [`rotary`]             the rotary position embedding's seven ops as one node, one kernel
//!   (`fast`, at load, on CUDA with CUDA graphs and on a CPU with the runtime's kernels)
//! - [`inplace_state`]      state writes (a KV cache's) run in place, with nothing to copy back
//!   (every level: the values are the same)

pub mod add_norm;
pub mod batch_norm;
pub mod channel_shuffle;
pub mod channels_last;
pub mod constant_fold;
pub mod conv;
pub mod conv_pointwise;
pub mod conv_residual;
pub mod dead_code;
pub mod dequantize_weights;
mod emit;
pub mod eval_dropout;
pub mod fake_quantize;
pub mod gelu_tanh;
pub mod inplace_state;
pub mod linear_concat;
pub mod linear_gelu;
pub mod linear_int8;
pub mod linear_int8_output;
pub mod linear_measured;
pub mod linear_pointwise;
pub mod pass;
pub mod post_ops;
pub mod quantized_ops;
pub mod readers;
pub mod rms_norm;
pub mod rotary;
pub mod views_as_reshapes;

pub use pass::{Ctx, Pass};
pub use post_ops::RELU6;

use crate::schema::Document;

/// How far a program is optimized: at load, or (a file's `optimized` field) when written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    #[default]
    /// The graph as exported, run with eager's kernels: bitwise what eager computes.
    Exact,
    /// Faster kernels and layouts, within a stated tolerance of eager (`docs/optimize.md`).
    Fast,
}

impl Level {
    /// Parses `"exact"` or `"fast"`.
    pub fn parse(s: &str) -> Option<Level> {
        match s {
            "exact" => Some(Level::Exact),
            "fast" => Some(Level::Fast),
            _ => None,
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            Level::Exact => "exact",
            Level::Fast => "fast",
        }
    }

    /// Whether this is the default level (a file that doesn't say is `exact`).
    pub fn is_exact(&self) -> bool {
        *self == Level::Exact
    }
}

/// What a level leaves for the runtime to do with torch, per method and for the file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rewrites {
    /// Per method, the weights its graph writes in place (no copy back after a call).
    pub in_place: std::collections::BTreeMap<String, Vec<String>>,
    /// The weights to hold channels-last (a no-op for weights a file already holds so).
    pub channels_last: Vec<String>,
    /// Batch norms folded into convolutions: the weights to recompute, before anything else
    /// reads them (`kwexport._passes`).
    pub folds: Vec<batch_norm::Fold>,
    /// int8 convolution weights to dequantize at load, before anything else reads them
    /// (`kwexport._passes`).
    pub dequantized: Vec<dequantize_weights::Dequant>,
    /// The rewrites each pass that ran made, by its name.
    pub counts: pass::Counts,
}

/// What the program that will run the graph can do, for the passes that depend on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Target {
    /// Decide the state written in place (a runtime choice, which a file written by
    /// `kwexport optimize` leaves to the loader).
    pub in_place: bool,
    /// The program runs on a CPU torch built with oneDNN: lower convolutions onto it. Never
    /// for a file being written, which must load on any torch.
    pub onednn: bool,
    /// The runtime has its own kernels for this CPU: its GEMM runs a lowered 1×1 convolution
    /// over channels-last pixels (lower those too, with `onednn`, which runs the rest), and
    /// its other kernels the nodes passes fuse for them (`rotary`).
    pub gemm: bool,
    /// The program runs on CUDA and replays its calls as CUDA graphs, where a kernel more
    /// costs no host time: choose GEMMs by device time alone.
    pub cuda_graphs: bool,
}

/// The passes `fast` runs before every level's: those that read torch's quantize and
/// dequantize ops, which `quantized_ops` writes out as aten arithmetic. Linears take their
/// pairs first, then the fake quantizations of their results.
const FAST_FIRST: &[&dyn Pass] = &[
    &linear_int8::LinearInt8,
    &fake_quantize::FakeQuantize,
    &linear_int8_output::LinearInt8Output,
    &dequantize_weights::DequantizeWeights,
];

/// The passes every level runs, in the order a sweep runs them.
const EXACT: &[&dyn Pass] = &[&quantized_ops::QuantizedOps, &dead_code::DeadCode, &inplace_state::InplaceState];

/// The passes `fast` runs after those. Batch norms fold first, so that a convolution's
/// activation is the node right after it; convolutions lower before their residuals fuse.
const FAST: &[&dyn Pass] = &[
    &eval_dropout::EvalDropout,
    &batch_norm::BatchNorm,
    &views_as_reshapes::ViewsAsReshapes,
    &rms_norm::RmsNorm,
    &gelu_tanh::GeluTanh,
    &channel_shuffle::ChannelShuffle,
    &conv_pointwise::ConvPointwise,
    &conv_residual::ConvResidual,
    &linear_pointwise::LinearPointwise,
    &linear_concat::LinearConcat,
    &linear_measured::LinearMeasured,
    &linear_gelu::LinearGelu,
    &add_norm::AddNorm,
    &rotary::Rotary,
];

/// The passes `level` runs, in order: its own after those of the levels below, except
/// [`FAST_FIRST`]'s, before them.
pub fn registered(level: Level) -> Vec<&'static dyn Pass> {
    let fast = level == Level::Fast;
    let first = if fast { FAST_FIRST } else { &[] };
    let last = if fast { FAST } else { &[] };
    [first, EXACT, last].concat()
}

/// The most sweeps `apply` runs. Each pass rewrites only what it finds and finds nothing in
/// its own output, so a graph settles in two or three; the bound keeps a pass that claimed
/// a change forever from hanging a load.
const MAX_SWEEPS: usize = 8;

/// Applies `level`'s graph passes (and those of every level) to each method of `doc`, sweep
/// after sweep until one changes nothing; the level applied is the higher of `level` and the
/// file's own (`doc.optimized`), and becomes the file's. A file optimized when written passes
/// through unchanged. `target` adds what only a loader may decide.
pub fn apply(doc: &mut Document, level: Level, target: Target) -> Rewrites {
    apply_except(doc, level, target, &[])
}

/// [`apply`] without the passes `skip` names: for measuring what a pass does
/// (`KWEXPORT_SKIP_PASSES`).
pub fn apply_except(doc: &mut Document, level: Level, target: Target, skip: &[String]) -> Rewrites {
    let level = level.max(doc.optimized);
    doc.optimized = level;
    let runs = |p: &&dyn Pass| p.runs_for(target) && !skip.iter().any(|s| s == p.name());
    let passes: Vec<&dyn Pass> = registered(level).into_iter().filter(runs).collect();
    let mut cx = Ctx::new(doc, target);
    for _ in 0..MAX_SWEEPS {
        let mut changed = false;
        for &pass in &passes {
            let made = pass.apply(&mut cx);
            cx.count(pass, made);
            if made > 0 {
                // A pass may change a method without `each_method` (`dequantize_weights` edits
                // every method's graph): no method's readers are known any more.
                cx.forget_readers();
            }
            changed |= made > 0;
        }
        if !changed {
            break;
        }
    }
    let mut rewrites = cx.rewrites;
    if level == Level::Fast {
        // What the rewritten graphs convolve, once they have settled.
        rewrites.channels_last = channels_last::conv_weights(doc);
    }
    rewrites
}

/// The index of op `name` in a method's op table, added if missing (a pass's new node).
fn op_index(ops: &mut Vec<crate::schema::OpEntry>, name: &str) -> usize {
    match ops.iter().position(|o| o.name == name) {
        Some(i) => i,
        None => {
            ops.push(crate::schema::OpEntry { name: name.to_owned(), schema: None });
            ops.len() - 1
        }
    }
}

/// Puts the nodes `at` holds for an index in place of the node there, and drops the nodes
/// `removed` marks (a pass whose rewrite is several nodes: `rms_norm`'s cast, `linear_int8`'s
/// views).
fn splice_nodes(
    nodes: &mut Vec<crate::schema::Node>,
    mut at: std::collections::HashMap<usize, Vec<crate::schema::Node>>,
    removed: &[bool],
) {
    for (i, n) in std::mem::take(nodes).into_iter().enumerate() {
        match at.remove(&i) {
            Some(new) => nodes.extend(new),
            None if removed.get(i) != Some(&true) => nodes.push(n),
            None => {}
        }
    }
}

/// Puts each chain's new nodes in place of the chain's last node and drops its others: the
/// rewrite of a pass that fuses a pattern of nodes (`rms_norm`, `add_norm`, `rotary`). Chains
/// share no node.
fn replace_chains(nodes: &mut Vec<crate::schema::Node>, chains: Vec<(Vec<usize>, Vec<crate::schema::Node>)>) {
    let mut removed = vec![false; nodes.len()];
    let mut at = std::collections::HashMap::new();
    for (chain, new) in chains {
        let Some((&last, rest)) = chain.split_last() else { continue };
        rest.iter().for_each(|&i| removed[i] = true);
        at.insert(last, new);
    }
    splice_nodes(nodes, at, &removed);
}

/// Points every reference to a key of `to` (in the nodes' arguments, the graph's outputs and
/// its mutations' values) at its value: the readers of a node a pass drops reading the value
/// that stands for it.
fn redirect(g: &mut crate::schema::Graph, to: &std::collections::HashMap<String, String>) {
    fn rename(a: &mut crate::schema::Arg, to: &std::collections::HashMap<String, String>) {
        match a {
            crate::schema::Arg::Ref(r) => {
                if let Some(x) = to.get(r.as_str()) {
                    r.clone_from(x);
                }
            }
            crate::schema::Arg::List(items) => items.iter_mut().for_each(|i| rename(i, to)),
            _ => {}
        }
    }
    for n in &mut g.nodes {
        n.args.iter_mut().chain(n.kwargs.values_mut()).for_each(|a| rename(a, to));
    }
    g.outputs.iter_mut().chain(g.mutations.iter_mut().map(|w| &mut w.value)).for_each(|a| rename(a, to));
}

/// Removes the nodes `removed` marks.
fn remove_nodes(nodes: &mut Vec<crate::schema::Node>, removed: &[bool]) {
    let mut i = 0;
    nodes.retain(|_| {
        i += 1;
        !removed[i - 1]
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// The test file with `header` applied before it is written, then `mutate` applied to its
    /// parsed document's JSON (changes a written file couldn't hold, such as a weight's dtype
    /// without its bytes).
    pub(crate) fn document(
        header: impl FnOnce(&mut serde_json::Value),
        mutate: impl FnOnce(&mut serde_json::Value),
    ) -> Document {
        let bytes = crate::artifact::tests::file(header);
        let mut json = serde_json::to_value(crate::parse(&bytes).unwrap().document).unwrap();
        mutate(&mut json);
        serde_json::from_value(json).unwrap()
    }

    /// The test file with a metadata assertion added to its graph.
    fn doc() -> Document {
        let bytes = crate::artifact::tests::file(|h| {
            let m = &mut h["methods"]["forward"];
            m["ops"]
                .as_array_mut()
                .unwrap()
                .push(json!({"name": "aten::_assert_tensor_metadata.default", "schema": null}));
            m["graph"]["nodes"]
                .as_array_mut()
                .unwrap()
                .push(json!({"op": 1, "args": [{"ref": "y"}], "outputs": {"none": null}}));
        });
        crate::parse(&bytes).unwrap().document
    }

    #[test]
    fn each_pass_is_registered_once_at_its_level() {
        let fast = registered(Level::Fast);
        for (i, p) in fast.iter().enumerate() {
            assert!(fast[i + 1..].iter().all(|q| q.name() != p.name()), "{} twice", p.name());
            assert_eq!(EXACT.iter().any(|q| q.name() == p.name()), p.level() == Level::Exact, "{}", p.name());
        }
        assert!(registered(Level::Exact).iter().all(|p| p.level() == Level::Exact));
    }

    #[test]
    fn passes_run_until_a_sweep_changes_nothing_and_report_their_counts() {
        let mut d = doc();
        let target = Target { in_place: true, ..Target::default() };
        let rewrites = apply(&mut d, Level::Fast, target);
        // The assertion went in the first sweep; the second changed nothing.
        assert_eq!(rewrites.counts["dead_code"], 1);
        assert_eq!(rewrites.counts["gelu_tanh"], 0);
        assert!(!rewrites.counts.contains_key("conv_pointwise"), "not for a target without oneDNN");
        assert_eq!(rewrites.in_place.keys().collect::<Vec<_>>(), ["forward"]);
    }

    #[test]
    fn the_level_applied_is_the_higher_of_the_asked_and_the_files() {
        let mut d = doc();
        apply(&mut d, Level::Exact, Target::default());
        assert_eq!((d.optimized, d.methods["forward"].graph.nodes.len()), (Level::Exact, 1));
        d.optimized = Level::Fast;
        apply(&mut d, Level::Exact, Target::default());
        assert_eq!(d.optimized, Level::Fast);
        // Idempotent: a file optimized when written passes through unchanged.
        let before = d.clone();
        apply(&mut d, Level::Fast, Target::default());
        assert_eq!(d, before);
        // The field is written only where it says something.
        let json = serde_json::to_value(&d).unwrap();
        assert_eq!(json["optimized"], "fast");
        d.optimized = Level::Exact;
        assert!(serde_json::to_value(&d).unwrap().get("optimized").is_none());
    }
}
