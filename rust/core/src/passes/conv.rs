//! What a convolution node is, for every pass that reads one: the one matcher (ONNX
//! Runtime's optimizer keeps its op kinds in one place too). torch's forward convolutions and
//! the lowered ones the passes make, with where each takes its weight and bias.

use crate::schema::{Arg, Node};

/// A convolution op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvOp {
    /// Its name in an op table.
    pub name: &'static str,
    /// The argument its weight is at.
    pub weight: usize,
    /// The argument its bias is at.
    pub bias: usize,
    /// torch's own op (as exported), not one a pass lowered.
    pub torch: bool,
}

/// Every convolution op the passes know.
pub const CONVOLUTIONS: &[ConvOp] = &[
    ConvOp { name: "aten::conv1d.default", weight: 1, bias: 2, torch: true },
    ConvOp { name: "aten::conv2d.default", weight: 1, bias: 2, torch: true },
    ConvOp { name: "aten::conv2d.padding", weight: 1, bias: 2, torch: true },
    ConvOp { name: "aten::convolution.default", weight: 1, bias: 2, torch: true },
    ConvOp { name: super::conv_pointwise::FUSED, weight: 1, bias: 2, torch: false },
    ConvOp { name: super::conv_residual::FUSED, weight: 2, bias: 3, torch: false },
];

/// The convolution op `op` is, if it is one.
pub fn of(op: Option<&str>) -> Option<&'static ConvOp> {
    CONVOLUTIONS.iter().find(|c| Some(c.name) == op)
}

impl ConvOp {
    /// Whether node `n` of this op is transposed (`convolution` with `transposed` not a
    /// literal false), whose weight's channels are its second dimension.
    pub fn transposed(&self, n: &Node) -> bool {
        self.name == "aten::convolution.default" && n.args.get(6) != Some(&Arg::Bool(false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Outputs;

    #[test]
    fn convolution_reads_its_transposed_flag() {
        let node = |transposed: bool| Node {
            op: 0,
            args: [vec![Arg::Ref("x".into()); 6], vec![Arg::Bool(transposed)]].concat(),
            kwargs: Default::default(),
            outputs: Outputs::None(()),
        };
        let conv = of(Some("aten::convolution.default")).unwrap();
        assert!(!conv.transposed(&node(false)) && conv.transposed(&node(true)));
        let lowered = of(Some(super::super::conv_residual::FUSED)).unwrap();
        assert!(!lowered.transposed(&node(true)) && lowered.weight == 2);
        assert!(of(Some("aten::relu.default")).is_none());
    }
}
