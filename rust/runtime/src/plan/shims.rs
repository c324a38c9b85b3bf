//! Nodes run through torch's per-op C shims (see `abi::shims`) or rewritten for the
//! dispatcher, each giving the same bits as the op itself:
//!
//! - nodes with a `Scalar`, which the dispatcher's stable stack can't carry: a shim that takes
//!   it as a `double` (`add.Tensor`'s `alpha`, `addmm`'s `beta` and `alpha`,
//!   `pow.Tensor_Scalar`'s exponent), where the literal is exactly a double, run only on
//!   floating tensors;
//! - hot ops, where calling the kernel unboxed saves the dispatcher's boxing and lookup:
//!   `mul.Tensor`, and `linear` on a 2-D input, which is what `at::linear` runs for it
//!   (`addmm(bias, input, weight.t())`, or `mm` without a bias) with `weight.t()` made once;
//! - the `Tensor` overload with the number wrapped as torch wraps it, where torch defines the
//!   `Scalar` overload as exactly that (`ge.Scalar` is `ge.Tensor` on a wrapped number).
//!
//! A shim step checks its tensors on each call and runs the node's Python op where they
//! don't qualify (integer tensors for a `double` Scalar, a 3-D input to `linear`, autograd
//! or autocast for a kernel that skips the dispatcher).

use std::ffi::CString;

use kwexport_core::graph::{SlotArg, SlotNode, SlotOutputs, ValueRef};
use kwexport_core::schema::Arg;

use super::consts::KernelConsts;
use super::{CStep, ShimStep};
use crate::abi::encode::{self, Enc};
use crate::abi::shims::{Family, ShimFn};
use crate::abi::{Abi, Ty};
use crate::operators::{Epilogue, Quant};
use crate::ops::OpSchema;

/// Comparisons whose `Scalar` overload is the `Tensor` overload on a wrapped number.
const WRAPPING_COMPARISONS: [&str; 6] = ["aten::eq", "aten::ne", "aten::lt", "aten::le", "aten::gt", "aten::ge"];

/// Which tensors a shim reads, in its order.
enum Operand {
    /// Schema argument `i`.
    Arg(usize),
    /// The transpose of schema argument `i`, a weight, made once at load.
    WeightT(usize),
}

/// How a node maps onto a shim.
struct ShimUse {
    f: Option<ShimFn>,
    family: Family,
    tensors: Vec<Operand>,
    /// Schema arguments passed as doubles.
    scalars: &'static [usize],
    in_place: bool,
    /// Whether autocast changes the op (`addmm`, `linear`): then a kernel that skips the
    /// dispatcher can't run under autocast.
    autocast: bool,
    /// `(tensor, dims)`: the shim's tensor `tensor` must have `dims` dimensions.
    dims: Option<(usize, i64)>,
    /// Whether that tensor may have more dimensions, contiguous, folded into a matrix.
    fold: bool,
    /// At `fast`, the weight to pack for kwexport's linear kernel.
    packed: Option<Pack>,
    /// A fused linear's activation (`passes::linear_pointwise`).
    epilogue: Epilogue,
}

/// Which schema argument is the weight of kwexport's linear kernel, which shim tensor is its
/// input, and whether the weight is `[n, k]` (linear's: transposed once at load) or already
/// `[k, n]` (addmm's second matrix).
#[derive(Clone, Copy)]
struct Pack {
    arg: usize,
    input: usize,
    transpose: bool,
}

/// The C step for a node that a shim or a rewrite covers, if one does. Off the CPU
/// (`on_cpu` false) only the shims that dispatch are used: `add.Tensor` becomes
/// `subtract.Tensor` with the opposite `alpha`, which is how torch computes a subtraction
/// (the same kernel, `a + alpha * b`), so the bits are the same.
#[allow(clippy::too_many_arguments)]
pub(super) fn compile(
    abi: &Abi,
    op: &OpSchema,
    node: &SlotNode,
    bound: &[&SlotArg],
    is_tensor: &dyn Fn(usize) -> bool,
    consts: &mut dyn KernelConsts,
    on_cpu: bool,
    fast: bool,
) -> Option<CStep> {
    let name = (op.c_name.0.to_str().ok()?, op.c_name.1.to_str().ok()?);
    if name.1 == "Scalar" && WRAPPING_COMPARISONS.contains(&name.0) && bound.len() == 2 {
        return wrapped_overload(abi, op, node, bound, is_tensor, consts);
    }
    // `masked_fill(_).Tensor` takes its 0-dim value's `item()`: the Scalar the node has.
    if name.1 == "Scalar" && matches!(name.0, "aten::masked_fill" | "aten::masked_fill_") && bound.len() == 3 {
        return wrapped_overload(abi, op, node, bound, is_tensor, consts);
    }
    let shims = abi.shims.as_ref()?;
    let cpu = |f, tensors: &[usize], scalars, in_place, autocast| ShimUse {
        f,
        family: Family::Cpu,
        tensors: tensors.iter().map(|&i| Operand::Arg(i)).collect(),
        scalars,
        in_place,
        autocast,
        dims: None,
        fold: false,
        packed: None,
        epilogue: Epilogue::None,
    };
    let bias_given = matches!(bound.get(2), Some(a) if !matches!(a, SlotArg::Literal(Arg::None(()))));
    let aten = |f, tensors, scalars| ShimUse { family: Family::Aten, ..cpu(f, tensors, scalars, false, false) };
    // `linear(x, W, bias?)` as `addmm(bias, x, W.t())` or `mm(x, W.t())` on the input folded
    // into a matrix, as at::linear runs it; `packed` where kwexport's GEMM is a candidate.
    let linear = |packed: bool| match bias_given {
        true => ShimUse {
            tensors: vec![Operand::Arg(2), Operand::Arg(0), Operand::WeightT(1)],
            dims: Some((1, 2)),
            fold: true,
            packed: packed.then_some(Pack { arg: 1, input: 1, transpose: true }),
            ..cpu(shims.addmm_out, &[], &[], false, true)
        },
        false => ShimUse {
            tensors: vec![Operand::Arg(0), Operand::WeightT(1)],
            dims: Some((0, 2)),
            fold: true,
            packed: packed.then_some(Pack { arg: 1, input: 0, transpose: true }),
            ..cpu(shims.mm_out, &[], &[], false, true)
        },
    };
    if !on_cpu {
        let (uses, negate) = match name {
            ("aten::add", "Tensor") => (aten(shims.subtract_tensor, &[0, 1], &[2]), true),
            ("aten::sub", "Tensor") => (aten(shims.subtract_tensor, &[0, 1], &[2]), false),
            _ => return None,
        };
        let mut step = shim_step(abi, op, node, bound, is_tensor, consts, uses)?;
        if negate {
            let shim = step.shim.as_mut()?;
            shim.scalars[0] = -shim.scalars[0];
        }
        return Some(step);
    }
    let uses = match name {
        ("aten::add", "Tensor") => {
            let mut step =
                shim_step(abi, op, node, bound, is_tensor, consts, cpu(shims.add_tensor, &[0, 1], &[2], false, false))?;
            let shim = step.shim.as_mut()?;
            shim.integer_add = shim.scalars == [1.0];
            return Some(step);
        }
        ("aten::add_", "Tensor") => cpu(shims.add_tensor, &[0, 1], &[2], true, false),
        ("aten::sub", "Tensor") => {
            ShimUse { family: Family::Aten, ..cpu(shims.subtract_tensor, &[0, 1], &[2], false, false) }
        }
        ("aten::pow", "Tensor_Scalar") => cpu(shims.pow_tensor_scalar, &[0], &[1], false, true),
        // `addmm(bias, x, W)` with a `[k, n]` weight (GPT-2's Conv1D) is the linear kernel's
        // layout already; at `fast`, with beta = alpha = 1, it is a candidate too.
        ("aten::addmm", "") => ShimUse {
            packed: (fast && [3, 4].iter().all(|&i| bound.get(i).is_none_or(|a| exact_double(a) == Some(1.0))))
                .then_some(Pack { arg: 2, input: 1, transpose: false }),
            ..cpu(shims.addmm_out, &[0, 1, 2], &[3, 4], false, true)
        },
        ("aten::mul", "Tensor") => cpu(shims.mul_tensor, &[0, 1], &[], false, false),
        // Only `optimize="fast"` makes this node (`passes::rms_norm`): kwexport's kernel, over
        // the last dimension, whose size rides along as a second scalar.
        ("aten::rms_norm", "") if bias_given => {
            let [n] = ints(bound.get(1)?)?[..] else { return None };
            let mut step =
                shim_step(abi, op, node, bound, is_tensor, consts, cpu(shims.rms_norm, &[0, 2], &[3], false, false))?;
            step.shim.as_mut()?.scalars.push(n as f64);
            return Some(step);
        }
        // At `fast`, kwexport's kernel: torch's GELU spends ~6 µs setting up a oneDNN
        // primitive per call, and its tanh form runs at a third of the exact one's speed.
        ("aten::gelu", "") if fast => {
            let tanh = match bound.get(1)? {
                SlotArg::Literal(Arg::Str(a)) if a == "none" => 0.0,
                SlotArg::Literal(Arg::Str(a)) if a == "tanh" => 1.0,
                _ => return None,
            };
            let mut step =
                shim_step(abi, op, node, bound, is_tensor, consts, cpu(shims.gelu, &[0], &[], false, false))?;
            step.shim.as_mut()?.scalars.push(tanh);
            return Some(step);
        }
        ("mkldnn::_convolution_pointwise", "" | "binary") => {
            return conv_step(abi, node, bound, is_tensor, consts, shims)
        }
        // At `fast`, kwexport's kernel over the last dimension (its size rides along as a
        // second scalar) where the weight and bias are given: torch's CPU layer norm takes
        // ~7 µs on a small model's `[32, 256]`, mostly in setting up.
        ("aten::layer_norm", "") if fast => {
            let [n] = ints(bound.get(1)?)?[..] else { return None };
            let given = |i: usize| matches!(bound.get(i), Some(SlotArg::Value(_)));
            if !(given(2) && given(3)) {
                return None;
            }
            let uses = cpu(shims.layer_norm, &[0, 2, 3], &[4], false, false);
            let mut step = shim_step(abi, op, node, bound, is_tensor, consts, uses)?;
            step.shim.as_mut()?.scalars.push(n as f64);
            return Some(step);
        }
        // Only a `fast` load on a CPU with oneDNN and kwexport's GEMM makes this node
        // (`passes::linear_pointwise`): a linear, then its activation applied by kwexport.
        ("mkldnn::_linear_pointwise", "") => {
            let SlotArg::List(scalars) = bound.get(4)? else { return None };
            let epilogue = fused_epilogue(bound.get(3)?, bound.get(5)?).filter(|_| scalars.is_empty())?;
            ShimUse { epilogue, ..linear(true) }
        }
        ("aten::linear", "") => linear(fast),
        _ => return None,
    };
    shim_step(abi, op, node, bound, is_tensor, consts, uses)
}

/// What an int8 linear or convolution applies to its results (its last six arguments): the
/// activation fused with it, as `mkldnn::_linear_pointwise` names it, and the quantization
/// of its result (`passes::linear_int8_output`; a scale of None: none). `None` where the
/// kernel can't take them (the node then runs the op's Python form).
fn int8_post(post: &[&SlotArg]) -> Option<(crate::operators::Epilogue, Option<Quant>)> {
    let int = |a: &SlotArg| match a {
        SlotArg::Literal(Arg::Int(i)) => Some(*i),
        _ => None,
    };
    let [attr, algorithm, scale, zero_point, qmin, qmax] = post else { return None };
    let output = match scale {
        SlotArg::Literal(Arg::None(())) => None,
        SlotArg::Literal(Arg::Float(s)) => {
            let quant = Quant { scale: s.0, zero_point: int(zero_point)?, qmin: int(qmin)?, qmax: int(qmax)? };
            Some(quant.fits().then_some(quant)?)
        }
        _ => return None,
    };
    Some((fused_epilogue(attr, algorithm)?, output))
}

/// The epilogue a fused linear's literal `attr` and `algorithm` (oneDNN's names for a post-op
/// and GELU's approximation) ask for; `None` where they aren't literals kwexport applies.
fn fused_epilogue(attr: &SlotArg, algorithm: &SlotArg) -> Option<crate::operators::Epilogue> {
    let algorithm = match algorithm {
        SlotArg::Literal(Arg::Str(a)) => Some(a.as_str()),
        SlotArg::Literal(Arg::None(())) => None,
        _ => return None,
    };
    let SlotArg::Literal(Arg::Str(attr)) = attr else { return None };
    crate::operators::epilogue_of(attr, algorithm)
}

/// At `fast`, the kernel of kwexport's a dispatched node runs where its tensors qualify.
pub(super) fn own_op(op: &OpSchema, bound: &[&SlotArg], consts: &mut dyn KernelConsts) -> Option<super::OwnOp> {
    let name = (op.c_name.0.to_str().ok()?, op.c_name.1.to_str().ok()?);
    match (name, bound) {
        // Only a `fast` load with kwexport's kernels makes this node (`passes::linear_int8`):
        // a weight of the file, its scales a weight too (read per call), and the input's
        // parameters literals (`.default`) or tensors (`.tensor`).
        // (`.dynamic` takes `eps` and a dtype where the others take the scale and zero point),
        // then the activation fused with it.
        (
            ("kwexport::linear_int8", overload @ ("" | "tensor" | "dynamic")),
            [SlotArg::Value(_), a, b, c, d, SlotArg::Value(ValueRef::Weight(w)), SlotArg::Value(ValueRef::Weight(_)), SlotArg::Value(ValueRef::Weight(w_zp)), _, post @ ..],
        ) => {
            use super::Int8Params;
            let int = |a: &SlotArg| match a {
                SlotArg::Literal(Arg::Int(i)) => Some(*i),
                _ => None,
            };
            let (params, range) = match (overload, a, b) {
                ("", SlotArg::Literal(Arg::Float(s)), SlotArg::Literal(Arg::Int(z))) => {
                    (Int8Params::Literal(s.0, *z), [int(c)?, int(d)?])
                }
                ("tensor", SlotArg::Value(_), SlotArg::Value(_)) => (Int8Params::Tensors, [int(c)?, int(d)?]),
                ("dynamic", _, _) => match c {
                    SlotArg::Literal(Arg::Float(eps)) => (Int8Params::Chosen(eps.0), [int(a)?, int(b)?]),
                    _ => return None,
                },
                _ => return None,
            };
            let (epilogue, output) = int8_post(post)?;
            let (panels, [n, k, 1, 1]) = consts.int8_panels(w, w_zp, 1, range[1].saturating_sub(range[0]))? else {
                return None;
            };
            let linear = super::Int8Linear { conv: None, params, range, n, k, epilogue, output, panels };
            Some(super::OwnOp::LinearInt8(std::sync::Arc::new(linear)))
        }
        // The same pass's int8 convolution: a static scale (`.default`, `.residual`) or `eps`
        // and a dtype (`.dynamic`), then the stride, padding and groups (`.residual`: then
        // the tensor added, `passes::conv_residual`).
        (
            ("kwexport::conv_int8", overload @ ("" | "dynamic" | "residual")),
            [SlotArg::Value(_), SlotArg::Literal(a), SlotArg::Literal(b), SlotArg::Literal(c), SlotArg::Literal(d), SlotArg::Value(ValueRef::Weight(w)), SlotArg::Value(ValueRef::Weight(_)), SlotArg::Value(ValueRef::Weight(w_zp)), _, stride, padding, SlotArg::Literal(Arg::Int(groups)), post @ ..],
        ) => {
            let (params, range) = match (overload, a, b, c, d) {
                ("" | "residual", Arg::Float(scale), Arg::Int(zp), Arg::Int(qmin), Arg::Int(qmax)) => {
                    (super::Int8Params::Literal(scale.0, *zp), [*qmin, *qmax])
                }
                ("dynamic", Arg::Int(qmin), Arg::Int(qmax), Arg::Float(eps), _) => {
                    (super::Int8Params::Chosen(eps.0), [*qmin, *qmax])
                }
                _ => return None,
            };
            let (Some(&[sh, sw]), Some(&[ph, pw])) = (ints(stride).as_deref(), ints(padding).as_deref()) else {
                return None;
            };
            let (residual, post) = match (overload, post) {
                ("residual", [SlotArg::Value(_), post @ ..]) => (true, post),
                ("residual", _) => return None,
                _ => (false, post),
            };
            let (epilogue, output) = int8_post(post)?;
            let (panels, shape) =
                consts.int8_panels(w, w_zp, usize::try_from(*groups).ok()?, range[1].saturating_sub(range[0]))?;
            let conv = crate::operators::Conv2d::grouped(shape, [sh, sw], [ph, pw], *groups)?;
            let [n, k] = [shape[0], shape[1]];
            let conv = Some(super::Int8Conv { geometry: conv, residual });
            let linear = super::Int8Linear { conv, params, range, n, k, epilogue, output, panels };
            Some(super::OwnOp::LinearInt8(std::sync::Arc::new(linear)))
        }
        // A quantize → dequantize pair (`passes::fake_quantize`), its parameters literals.
        (
            ("aten::fake_quantize_per_tensor_affine", ""),
            [SlotArg::Value(_), SlotArg::Literal(Arg::Float(scale)), SlotArg::Literal(Arg::Int(zero_point)), SlotArg::Literal(Arg::Int(qmin)), SlotArg::Literal(Arg::Int(qmax))],
        ) => {
            let quant = crate::operators::Quant { scale: scale.0, zero_point: *zero_point, qmin: *qmin, qmax: *qmax };
            quant.fits().then_some(super::OwnOp::FakeQuantize(quant))
        }
        (
            ("aten::fake_quantize_per_tensor_affine", "tensor_qparams"),
            [SlotArg::Value(_), SlotArg::Value(_), SlotArg::Value(_), SlotArg::Literal(Arg::Int(qmin)), SlotArg::Literal(Arg::Int(qmax))],
        ) => Some(super::OwnOp::FakeQuantizeTensors { qmin: *qmin, qmax: *qmax }),
        // A 4-d tensor's mean over its last two dimensions (checked per call).
        (
            ("aten::mean", "dim"),
            [SlotArg::Value(_), dims, SlotArg::Literal(Arg::Bool(keepdim)), SlotArg::Literal(Arg::None(()))],
        ) if matches!(ints(dims).as_deref(), Some([2, 3] | [-2, -1] | [3, 2] | [-1, -2])) => {
            Some(super::OwnOp::MeanPixels { keepdim: *keepdim })
        }
        // The memory format given, or the schema's default (torch's code for it, 0).
        (("aten::contiguous", ""), [SlotArg::Value(_), SlotArg::Literal(format)])
            if matches!(format, Arg::Int(0)) || matches!(format, Arg::MemoryFormat(f) if f == "contiguous_format") =>
        {
            Some(super::OwnOp::Contiguous)
        }
        // Tensors the node's own (`Value`s), joined along a literal dimension.
        (("aten::cat", ""), [SlotArg::List(items), rest @ ..])
            if !items.is_empty() && items.iter().all(|i| matches!(i, SlotArg::Value(_))) =>
        {
            match rest {
                [] => Some(super::OwnOp::Cat { dim: 0 }),
                [SlotArg::Literal(Arg::Int(dim))] => Some(super::OwnOp::Cat { dim: *dim }),
                _ => None,
            }
        }
        (("aten::adaptive_avg_pool2d", ""), [SlotArg::Value(_), SlotArg::List(size)])
            if matches!(size.as_slice(), [SlotArg::Literal(Arg::Int(1)), SlotArg::Literal(Arg::Int(1))]) =>
        {
            Some(super::OwnOp::GlobalAvgPool)
        }
        (
            ("aten::max_pool2d", ""),
            [SlotArg::Value(_), kernel, stride, padding, dilation, SlotArg::Literal(Arg::Bool(ceil))],
        ) => {
            // One size for both dimensions, or one each, as torch takes them.
            let pair = |a: &SlotArg| -> Option<[usize; 2]> {
                let v = match ints(a)?[..] {
                    [a] => [a, a],
                    [a, b] => [a, b],
                    _ => return None,
                };
                Some([usize::try_from(v[0]).ok()?, usize::try_from(v[1]).ok()?])
            };
            let kernel = pair(kernel)?;
            // torch's default stride is the kernel's (an empty list).
            let stride = match stride {
                SlotArg::List(items) if items.is_empty() => kernel,
                _ => pair(stride)?,
            };
            let (padding, dilation) = (pair(padding)?, pair(dilation)?);
            let valid = dilation == [1, 1] && !kernel.contains(&0) && !stride.contains(&0);
            valid.then_some(super::OwnOp::MaxPool(crate::operators::MaxPool { kernel, stride, padding, ceil: *ceil }))
        }
        // Both the halves and their concatenation along the last of `x`'s four dimensions
        // (whose count the kernel checks per call).
        (
            ("kwexport::rotary_embedding", ""),
            [SlotArg::Value(_), SlotArg::Value(_), SlotArg::Value(_), SlotArg::Literal(Arg::Int(dim)), SlotArg::Literal(Arg::Int(cat)), SlotArg::Literal(Arg::Int(split))],
        ) if dim.rem_euclid(4) == 3 && cat.rem_euclid(4) == 3 && (-4..4).contains(dim) && (-4..4).contains(cat) => {
            Some(super::OwnOp::Rotary { split: *split })
        }
        (
            ("aten::scaled_dot_product_attention", ""),
            [SlotArg::Value(_), SlotArg::Value(_), SlotArg::Value(_), mask, dropout, SlotArg::Literal(Arg::Bool(causal)), scale, gqa],
        ) => {
            let no_dropout = matches!(dropout, SlotArg::Literal(Arg::Float(p)) if p.0 == 0.0)
                || matches!(dropout, SlotArg::Literal(Arg::Int(0)));
            let scale = match scale {
                SlotArg::Literal(Arg::None(())) => None,
                SlotArg::Literal(Arg::Float(f)) => Some(f.0),
                _ => return None,
            };
            let mask_ok = matches!(mask, SlotArg::Value(_) | SlotArg::Literal(Arg::None(())));
            let no_gqa = matches!(gqa, SlotArg::Literal(Arg::Bool(false)));
            (no_dropout && mask_ok && no_gqa).then_some(super::OwnOp::Attention {
                causal: *causal,
                scale,
                choices: Default::default(),
            })
        }
        _ => None,
    }
}

/// oneDNN's fused convolution (`passes::conv_pointwise` made the node, or
/// `passes::conv_residual` its `binary` overload): input, weight (a weight of the file, packed
/// on the first call), bias and residual as tensors, the geometry and the post-ops as
/// literals. The shim skips the dispatcher, so autograd and autocast calls run the Python op.
fn conv_step(
    abi: &Abi,
    node: &SlotNode,
    bound: &[&SlotArg],
    is_tensor: &dyn Fn(usize) -> bool,
    consts: &mut dyn KernelConsts,
    shims: &crate::abi::shims::Shims,
) -> Option<CStep> {
    let none = |a: &SlotArg| matches!(a, SlotArg::Literal(Arg::None(())));
    let empty = |a: &SlotArg| matches!(a, SlotArg::List(items) if items.is_empty());
    let str_of = |a: &SlotArg| match a {
        SlotArg::Literal(Arg::Str(s)) => Some(s.clone()),
        _ => None,
    };
    // The post-op, and for the binary overload the residual tensor and the add's own post-op.
    let (f, x, w, bias, [padding, stride, dilation, groups], attr, residual) = match bound {
        [x, SlotArg::Value(ValueRef::Weight(w)), bias, p, s, d, g, attr, scalars, algorithm]
            if match str_of(attr).as_deref() {
                // ReLU6, the one `hardtanh` the pass fuses (`passes::RELU6`).
                Some("hardtanh") => {
                    none(algorithm) && floats(scalars).as_deref() == Some(&kwexport_core::passes::RELU6[..])
                }
                // GELU's approximation is its algorithm.
                Some("gelu") => empty(scalars) && matches!(str_of(algorithm).as_deref(), Some("none" | "tanh")),
                _ => none(algorithm) && empty(scalars),
            } =>
        {
            (shims.conv_pointwise?, *x, w, *bias, [*p, *s, *d, *g], str_of(attr)?, None)
        }
        [x, other, SlotArg::Value(ValueRef::Weight(w)), bias, p, s, d, g, binary, alpha, unary, scalars, algorithm]
            if str_of(binary).as_deref() == Some("add") && none(alpha) && empty(scalars) && none(algorithm) =>
        {
            let unary = if none(unary) { None } else { Some(str_of(unary).filter(|u| u == "relu")?) };
            let attr = unary.clone().unwrap_or_else(|| "none".to_owned());
            (shims.conv_pointwise_binary?, *x, w, *bias, [*p, *s, *d, *g], attr, Some((*other, unary)))
        }
        _ => return None,
    };
    let pair = |a: &SlotArg| -> Option<[i64; 2]> { ints(a)?.try_into().ok() };
    let SlotArg::Literal(Arg::Int(groups)) = groups else { return None };
    if !matches!(node.outputs, SlotOutputs::One(_)) {
        return None;
    }
    let (padding, stride, dilation) = (pair(padding)?, pair(stride)?, pair(dilation)?);
    let weight = consts.weight(w);
    let shape: [i64; 4] = consts.f32_shape(w)?.try_into().ok()?;
    let algorithm = match bound.last() {
        Some(a) if residual.is_none() => str_of(a),
        _ => None,
    };
    let own = crate::operators::epilogue_of(&attr, algorithm.as_deref()).filter(|_| dilation == [1, 1]).and_then(
        |epilogue| {
            use crate::operators::Conv2d;
            let [out, inputs, kh, kw] = shape;
            let geometry = Conv2d::new(shape, stride, padding)?;
            let pointwise = [kh, kw] == [1, 1] && stride == [1, 1] && padding == [0, 0];
            // `weight_panels` packs a `[n, k, 1, 1]` weight of a small enough size at load.
            let gemm = (pointwise && *groups == 1).then(|| consts.weight_panels(w, true)).flatten();
            let kernel = match (*groups, gemm) {
                (1, Some((panels, n))) => super::OwnKernel::Gemm { panels, n },
                (1, None) if crate::operators::patches_tile(&geometry) => {
                    super::OwnKernel::Patches { weight, geometry, panels: std::sync::OnceLock::new() }
                }
                (1, None) if geometry.in_channels <= Conv2d::MAX_DIRECT_IN_CHANNELS && !pointwise => {
                    super::OwnKernel::Direct { taps: consts.conv_taps(w)?.0, geometry }
                }
                (1, None) => {
                    let (panels, bf16) = (std::sync::OnceLock::new(), consts.bf16());
                    let winograd = (!bf16 && crate::operators::winograd_pays(&geometry)).then(|| super::Winograd {
                        panels: std::sync::OnceLock::new(),
                        min_pixels: crate::operators::WINOGRAD_MIN_PIXELS as i64,
                    });
                    super::OwnKernel::Indirect { weight, geometry, panels, bf16, winograd }
                }
                (g, _) if g == out && inputs == 1 => {
                    let geometry = crate::operators::Depthwise::new([out, kh, kw], stride, padding)?;
                    super::OwnKernel::Depthwise { taps: consts.conv_taps(w)?.0, geometry }
                }
                // Grouped (RegNet's, ResNeXt's): a GEMM per group, in float32 only.
                (g, _) if !consts.bf16() => {
                    let geometry = Conv2d::grouped(shape, stride, padding, g)?;
                    let panels = std::sync::OnceLock::new();
                    super::OwnKernel::Indirect { weight, geometry, panels, bf16: false, winograd: None }
                }
                (_, _) => return None,
            };
            // Only the GEMM's blocks apply GELU (a pass over each block's results); the other
            // kernels' epilogues don't, so oneDNN's post-op runs it there.
            let gelu = matches!(epilogue, Epilogue::Gelu | Epilogue::GeluTanh);
            if gelu && !matches!(kernel, super::OwnKernel::Gemm { .. } | super::OwnKernel::Patches { .. }) {
                return None;
            }
            Some(Box::new(super::OwnConv { kernel, epilogue, choices: Default::default() }))
        },
    );
    let mut args = vec![
        (Ty::Tensor, encode::encode(abi, &Ty::Tensor, false, x, is_tensor, consts)?),
        (Ty::Tensor, Enc::Const(weight)),
    ];
    let has_bias = !none(bias);
    if has_bias {
        args.push((Ty::Tensor, encode::encode(abi, &Ty::Tensor, false, bias, is_tensor, consts)?));
    }
    if let Some((other, _)) = residual {
        args.push((Ty::Tensor, encode::encode(abi, &Ty::Tensor, false, other, is_tensor, consts)?));
    }
    let overload = if residual.is_some() { c"binary" } else { c"" };
    let conv = super::Conv {
        padding,
        stride,
        dilation,
        groups: *groups,
        attr: CString::new(attr.as_str()).ok()?,
        scalars: if attr == "hardtanh" { kwexport_core::passes::RELU6.to_vec() } else { Vec::new() },
        algorithm: match algorithm {
            Some(a) => Some(CString::new(a).ok()?),
            None => None,
        },
        bias: has_bias,
        residual: match residual {
            Some((_, Some(unary))) => Some(Some(CString::new(unary).ok()?)),
            Some((_, None)) => Some(None),
            None => None,
        },
        shape,
        weight,
        packed: Default::default(),
        own,
        nan_post_op: crate::operators::epilogue_of(&attr, None)
            .filter(|e| matches!(e, Epilogue::Relu | Epilogue::Relu6 | Epilogue::Hardsigmoid)),
    };
    Some(CStep {
        name: (c"mkldnn::_convolution_pointwise".to_owned(), overload.to_owned()),
        args,
        returns: vec![Ty::Tensor],
        outputs: node.outputs.clone(),
        free: node.free.clone(),
        shim: Some(Box::new(ShimStep {
            f,
            family: Family::Cpu,
            scalars: Vec::new(),
            floating_only: true,
            in_place: false,
            autocast: true,
            dims: Some((0, 4)),
            fold: false,
            packed: None,
            epilogue: Epilogue::None,
            conv: Some(Box::new(conv)),
            fallback: None,
            integer_add: false,
        })),
        view: None,
        own: None,
        node: 0,
        to_caller: false,
        part: None,
        then: None,
    })
}

/// The step for a node through the shim `uses` describes.
fn shim_step(
    abi: &Abi,
    op: &OpSchema,
    node: &SlotNode,
    bound: &[&SlotArg],
    is_tensor: &dyn Fn(usize) -> bool,
    consts: &mut dyn KernelConsts,
    uses: ShimUse,
) -> Option<CStep> {
    if !matches!(node.outputs, SlotOutputs::One(_)) {
        return None;
    }
    let f = uses.f?;
    let mut args = Vec::with_capacity(uses.tensors.len());
    for (k, operand) in uses.tensors.iter().enumerate() {
        let enc = match operand {
            Operand::Arg(i) => {
                let writes = uses.in_place && k == 0;
                encode::encode(abi, &Ty::Tensor, writes, bound.get(*i)?, is_tensor, consts)?
            }
            Operand::WeightT(i) => match bound.get(*i)? {
                SlotArg::Value(ValueRef::Weight(w)) => Enc::Const(consts.weight_t(w)?),
                _ => return None,
            },
        };
        args.push((Ty::Tensor, enc));
    }
    if uses.in_place && !matches!(args[0].1, Enc::Slot(_)) {
        return None;
    }
    let scalars = uses.scalars.iter().map(|&i| exact_double(bound.get(i)?)).collect::<Option<Vec<_>>>()?;
    let packed = match uses.packed.map(|p| (p, bound.get(p.arg))) {
        Some((p, Some(SlotArg::Value(ValueRef::Weight(w))))) => consts
            .weight_panels(w, p.transpose)
            .map(|(panels, n)| Box::new(super::Packed { panels, n, input: p.input, choices: Default::default() })),
        _ => None,
    };
    Some(CStep {
        name: op.c_name.clone(),
        args,
        returns: vec![Ty::Tensor],
        outputs: node.outputs.clone(),
        free: node.free.clone(),
        shim: Some(Box::new(ShimStep {
            f,
            family: uses.family,
            floating_only: !scalars.is_empty(),
            scalars,
            in_place: uses.in_place,
            autocast: uses.autocast,
            dims: uses.dims,
            fold: uses.fold,
            packed,
            epilogue: uses.epilogue,
            conv: None,
            fallback: None,
            integer_add: false,
        })),
        view: None,
        own: None,
        node: 0,
        to_caller: false,
        part: None,
        then: None,
    })
}

/// `op.Scalar(..., value)` as `op.Tensor(..., wrapped(value))`, for a literal last argument.
fn wrapped_overload(
    abi: &Abi,
    op: &OpSchema,
    node: &SlotNode,
    bound: &[&SlotArg],
    is_tensor: &dyn Fn(usize) -> bool,
    consts: &mut dyn KernelConsts,
) -> Option<CStep> {
    let (last, tensors) = bound.split_last()?;
    let SlotArg::Literal(value) = last else { return None };
    let mut args = Vec::with_capacity(bound.len());
    for (param, a) in op.args.iter().zip(tensors) {
        args.push((Ty::Tensor, encode::encode(abi, &Ty::Tensor, param.writes, a, is_tensor, consts)?));
    }
    args.push((Ty::Tensor, Enc::Const(consts.number(value)?)));
    Some(CStep {
        name: (op.c_name.0.clone(), CString::new("Tensor").ok()?),
        args,
        returns: vec![Ty::Tensor],
        outputs: node.outputs.clone(),
        free: node.free.clone(),
        shim: None,
        view: None,
        own: None,
        node: 0,
        to_caller: false,
        part: None,
        then: None,
    })
}

/// A list of int literals (a size, a stride), `None` for anything else.
/// A list of literal floats.
fn floats(a: &SlotArg) -> Option<Vec<f64>> {
    let SlotArg::List(items) = a else { return None };
    items
        .iter()
        .map(|i| match i {
            SlotArg::Literal(Arg::Float(v)) => Some(v.0),
            _ => None,
        })
        .collect()
}

fn ints(a: &SlotArg) -> Option<Vec<i64>> {
    let SlotArg::List(items) = a else { return None };
    items
        .iter()
        .map(|i| match i {
            SlotArg::Literal(Arg::Int(v)) => Some(*v),
            _ => None,
        })
        .collect()
}

/// A `Scalar` literal as the double a shim takes, if that double is exactly it: an int
/// within 2^53 or a float. Bools and symbolic values stay on the Python path.
fn exact_double(a: &SlotArg) -> Option<f64> {
    match a {
        SlotArg::Literal(Arg::Float(f)) => Some(f.0),
        SlotArg::Literal(Arg::Int(i)) if i.unsigned_abs() <= 1 << 53 => Some(*i as f64),
        _ => None,
    }
}
