//! Dropouts that drop nothing, read as their input (`optimize="fast"`). An exported model in
//! eval mode keeps every `dropout(x, p, train=False)` of its modules (BERT-base: 25), and
//! torch's `dropout` returns `x` itself there: a node that costs a dispatch (and, on CUDA
//! without graphs, a launch from Python) and splits patterns around it (GPT-2's embedding sum
//! and its first layer norm). Each such node goes, and what read its value reads `x`: the same
//! tensor, so the same values and aliasing as eager's.

use std::collections::HashMap;

use super::pass::{Ctx, Pass};
use super::readers::one;
use super::Level;
use crate::schema::{Arg, Method};

/// Drops each eval-mode dropout of the method's top-level graph; returns how many.
fn rewrite(m: &mut Method) -> usize {
    let g = &m.graph;
    // Each dropout's value and its input, and which nodes go.
    let mut input_of: HashMap<String, String> = HashMap::new();
    let mut removed = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        let is_dropout = m.ops.get(n.op).is_some_and(|o| o.name == "aten::dropout.default");
        let (Some(y), [Arg::Ref(x), _, Arg::Bool(false)]) = (one(n), n.args.as_slice()) else { continue };
        if is_dropout && n.kwargs.is_empty() {
            // A dropout of a dropout reads the first one's input.
            let x = input_of.get(x).cloned().unwrap_or_else(|| x.clone());
            input_of.insert(y.to_owned(), x);
            removed[i] = true;
        }
    }
    if input_of.is_empty() {
        return 0;
    }
    let g = &mut m.graph;
    super::redirect(g, &input_of);
    super::remove_nodes(&mut g.nodes, &removed);
    input_of.len()
}

/// The pass (`fast`).
pub struct EvalDropout;

impl Pass for EvalDropout {
    fn name(&self) -> &'static str {
        "eval_dropout"
    }

    fn level(&self) -> Level {
        Level::Fast
    }

    fn apply(&self, cx: &mut Ctx<'_>) -> usize {
        cx.each_method(|_, m, _, _| rewrite(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `d = dropout(x, 0.1, train)`, `e = dropout(d, 0.1, train)`, `y = relu(e)`; outputs `y`, `e`.
    fn method(train: bool) -> Method {
        serde_json::from_value(json!({
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "leaf"}, "leaves": []},
            "outputs": {"type": "leaf"},
            "ops": [{"name": "aten::dropout.default", "schema": "s"}, {"name": "aten::relu.default", "schema": "s"}],
            "graph": {
                "inputs": [{"name": "x", "source": {"user": 0}}],
                "nodes": [
                    {"op": 0, "args": [{"ref": "x"}, {"float": 0.1}, {"bool": train}], "outputs": {"one": "d"}},
                    {"op": 0, "args": [{"ref": "d"}, {"float": 0.1}, {"bool": train}], "outputs": {"one": "e"}},
                    {"op": 1, "args": [{"list": [{"ref": "e"}]}], "outputs": {"one": "y"}}],
                "outputs": [{"ref": "y"}, {"ref": "e"}]}
        }))
        .unwrap()
    }

    #[test]
    fn eval_dropouts_read_as_their_input() {
        let mut m = method(false);
        assert_eq!(rewrite(&mut m), 2);
        assert_eq!(m.graph.nodes.len(), 1);
        assert_eq!(m.graph.nodes[0].args, [Arg::List(vec![Arg::Ref("x".into())])]);
        assert_eq!(m.graph.outputs, [Arg::Ref("y".into()), Arg::Ref("x".into())]);
        assert_eq!(rewrite(&mut m), 0);
    }

    #[test]
    fn training_dropouts_stay() {
        let mut m = method(true);
        assert_eq!(rewrite(&mut m), 0);
        assert_eq!(m.graph.nodes.len(), 3);
    }
}
