//! Convolution weights in channels-last memory format. torch's CPU convolutions (oneDNN)
//! run several times faster on channels-last tensors, and a convolution whose weight is
//! channels-last returns a channels-last output, which the pointwise ops, pooling and the
//! next convolution keep: repacking the weights once at load puts a whole conv chain in that
//! format, with no conversion node in the graph (the first convolution converts its input).
//! Results differ from eager's by the kernels' rounding (`docs/format.md`'s levels).

use crate::schema::{Arg, Document};

/// The weights read as 4-D convolution weights (`super::conv`: torch's, and the lowered ones
/// of `conv_pointwise` and `conv_residual`, whose oneDNN reorders a weight that isn't
/// channels-last on every call: on an AVX2 CPU, 15× the convolution's own time at 512
/// channels) by a method's top-level graph, that the program doesn't write (state keeps its
/// layout), in name order.
pub fn conv_weights(doc: &Document) -> Vec<String> {
    let mut out: Vec<String> = doc
        .methods
        .values()
        .flat_map(|m| {
            let weight_of = super::readers::weight_inputs(&m.graph);
            m.graph.nodes.iter().filter_map(move |n| {
                let conv = super::conv::of(m.ops.get(n.op).map(|o| o.name.as_str()))?;
                match n.args.get(conv.weight) {
                    Some(Arg::Ref(name)) => weight_of.get(name.as_str()).copied(),
                    _ => None,
                }
            })
        })
        .filter(|w| doc.weights.tensors.get(*w).is_some_and(|t| t.shape.len() == 4 && !t.mutable))
        .map(str::to_owned)
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn finds_4d_conv_weights_only() {
        let bytes = crate::artifact::tests::file(|h| {
            h["methods"]["forward"]["ops"] = json!([{"name": "aten::convolution.default", "schema": null}, {"name": "aten::mul.Tensor", "schema": null}]);
            h["weights"]["storages"] = json!([{"offset": 0, "nbytes": 64}]);
            h["weights"]["tensors"] = json!({
                "w": {"dtype": "float32", "shape": [2, 1, 2, 2], "strides": [4, 4, 2, 1], "storage": 0},
                "v": {"dtype": "float32", "shape": [2], "strides": [1], "storage": 0, "storage_offset": 8},
                "s": {"dtype": "float32", "shape": [1, 1, 1, 1], "strides": [1, 1, 1, 1], "storage": 0, "storage_offset": 12, "mutable": true}
            });
            h["methods"]["forward"]["graph"]["inputs"] = json!([
                {"name": "pw", "source": {"weight": "w"}}, {"name": "pv", "source": {"weight": "v"}},
                {"name": "ps", "source": {"weight": "s"}}, {"name": "x", "source": {"user": 0}}]);
            h["methods"]["forward"]["graph"]["nodes"] = json!([
                {"op": 0, "args": [{"ref": "x"}, {"ref": "pw"}], "outputs": {"one": "a"}},
                {"op": 0, "args": [{"ref": "a"}, {"ref": "ps"}], "outputs": {"one": "b"}},
                {"op": 1, "args": [{"ref": "b"}, {"ref": "pv"}], "outputs": {"one": "y"}}]);
        });
        let doc = crate::parse(&bytes).unwrap().document;
        assert_eq!(conv_weights(&doc), ["w"]);
    }

    /// A lowered convolution's weight (argument 1, or 2 for the residual form) is one too.
    #[test]
    fn finds_the_weights_of_lowered_convolutions() {
        let bytes = crate::artifact::tests::file(|h| {
            h["methods"]["forward"]["ops"] = json!([
                {"name": super::super::conv_pointwise::FUSED, "schema": null},
                {"name": super::super::conv_residual::FUSED, "schema": null}]);
            h["weights"]["storages"] = json!([{"offset": 0, "nbytes": 64}]);
            h["weights"]["tensors"] = json!({
                "w": {"dtype": "float32", "shape": [2, 1, 2, 2], "strides": [4, 4, 2, 1], "storage": 0},
                "u": {"dtype": "float32", "shape": [2, 1, 2, 2], "strides": [4, 4, 2, 1], "storage": 0}
            });
            h["methods"]["forward"]["graph"]["inputs"] = json!([
                {"name": "pw", "source": {"weight": "w"}}, {"name": "pu", "source": {"weight": "u"}},
                {"name": "x", "source": {"user": 0}}]);
            h["methods"]["forward"]["graph"]["nodes"] = json!([
                {"op": 0, "args": [{"ref": "x"}, {"ref": "pw"}], "outputs": {"one": "a"}},
                {"op": 1, "args": [{"ref": "a"}, {"ref": "x"}, {"ref": "pu"}], "outputs": {"one": "y"}}]);
        });
        let doc = crate::parse(&bytes).unwrap().document;
        assert_eq!(conv_weights(&doc), ["u", "w"]);
    }
}
