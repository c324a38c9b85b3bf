//! Stage 2, plan: the validated graph compiled once at load into what the run loop executes.
//! Every op, weight and literal is resolved; each node is checked against its op's schema and
//! given a path (torch's stable C ABI where it covers the node and pays off, torch's Python op
//! object otherwise); consecutive nodes of one path form a segment, and the values that must
//! cross between paths are worked out here.
//!
//! - `consts`    weights, wrapped numbers and literals as the objects nodes read
//! - `cstep`     nodes compiled for the C ABI
//! - `shims`     nodes through torch's per-op C shims, and Scalar rewrites
//! - `hop`       higher-order ops' nodes, with a nested plan per subgraph
//! - `cost`      which C-capable runs are worth their crossings
//! - `segments`  grouping by path, and the crossings each segment needs
//! - `fold`      the nodes that read only constants, run once at load (`fast`)
//! - `concat`    concatenations whose convolutions write their parts in place (`fast`)
//! - `heads`     1×1 expansions run with the depthwise convolution after them (`fast`)

mod choices;
mod concat;
mod consts;
mod cost;
mod cstep;
pub mod fold;
mod heads;
mod hop;
mod segments;
mod shims;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::atomic::AtomicU64;

use kwexport_core::graph::{SlotArg, SlotGraph, SlotNode, SlotOutputs, ValueRef};
use kwexport_core::hops::HopKind;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::abi::encode::Enc;
use crate::abi::shims::{Family, ShimFn};
use crate::abi::{self, Abi, Ty};
use crate::errors::RtResult;
use crate::ops::ResolvedOp;

pub use choices::{Choices, TRIAL_RUNS};
pub use concat::PartOf;

/// Which dispatch paths a plan may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    /// The stable C ABI where it covers a node and saves more than the conversions around
    /// it cost; Python otherwise.
    Auto,
    /// The stable C ABI for every node it covers, whatever the cost.
    Abi,
    /// torch's Python op objects for every node.
    Python,
}

impl Dispatch {
    /// Parses `"auto"`, `"abi"` or `"python"`.
    pub fn parse(s: &str) -> Option<Dispatch> {
        match s {
            "auto" => Some(Dispatch::Auto),
            "abi" => Some(Dispatch::Abi),
            "python" => Some(Dispatch::Python),
            _ => None,
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            Dispatch::Auto => "auto",
            Dispatch::Abi => "abi",
            Dispatch::Python => "python",
        }
    }
}

/// An argument of a Python-path node.
pub enum PyArg {
    /// A value slot.
    Slot(usize),
    /// A weight, literal or wrapped number, made once at load.
    Const(Py<PyAny>),
    /// A list with at least one slot in it.
    List(Vec<PyArg>),
}

/// What a Python-path node calls.
pub enum PyOp {
    /// torch's op object (or a Python operator).
    Call(Py<PyAny>),
    /// A higher-order op, run by kwexport with nested plans.
    Hop(Box<HopStep>),
}

/// A higher-order op's node: its subgraphs' plans and what it needs of torch. Its operands
/// (after `cond`'s predicate) are the step's `args`.
pub struct HopStep {
    pub(crate) kind: HopKind,
    /// How many of the step's arguments each of the layout's groups has (see `HopCall`).
    pub(crate) groups: Vec<usize>,
    /// `torch.stack`, for the loops' per-row outputs.
    pub(crate) stack: Py<PyAny>,
    /// The body, or `cond`'s true and false branches.
    pub(crate) bodies: Vec<Plan>,
    /// `torch._C._set_grad_enabled` and `torch.is_grad_enabled`, for grad-mode regions.
    pub(crate) grad_mode: (Py<PyAny>, Py<PyAny>),
    /// The value a grad-mode region sets.
    pub(crate) enabled: bool,
    /// `torch.autocast` and its keyword arguments, for autocast regions.
    pub(crate) autocast: Option<(Py<PyAny>, Py<PyDict>)>,
}

/// A node run through torch's Python op object, or a higher-order op.
pub struct PyStep {
    pub(crate) op: PyOp,
    /// The node's index in its graph and its op, for errors.
    pub(crate) node: usize,
    pub(crate) op_name: std::sync::Arc<kwexport_core::graph::OpName>,
    pub(crate) args: Vec<PyArg>,
    pub(crate) kwargs: Vec<(Py<PyString>, PyArg)>,
    pub(crate) outputs: SlotOutputs,
    pub(crate) free: Vec<usize>,
}

/// A node run through torch's stable C ABI.
pub struct CStep {
    /// The op's name and overload, as the dispatcher takes them.
    pub(crate) name: (CString, CString),
    /// One encoded argument per schema argument, with its type; for a shim, its tensors.
    pub(crate) args: Vec<(Ty, Enc)>,
    pub(crate) returns: Vec<Ty>,
    pub(crate) outputs: SlotOutputs,
    pub(crate) free: Vec<usize>,
    /// Set where the node runs through a per-op shim rather than the dispatcher.
    pub(crate) shim: Option<Box<ShimStep>>,
    /// Set where the node is a view of a tensor slot that kwexport can compute
    /// (`views.rs`): made without the dispatcher on calls with no autograd to record.
    pub(crate) view: Option<crate::views::ViewKind>,
    /// At `fast`, a kernel of kwexport's that the node runs where its tensors qualify, on
    /// calls with no autograd to record; the dispatcher's op otherwise.
    pub(crate) own: Option<OwnOp>,
    /// The node's index in its graph, for errors.
    pub(crate) node: usize,
    /// An output of the node is one of the graph's: made outside kwexport's arena.
    pub(crate) to_caller: bool,
    /// For a convolution whose output is one of the inputs of a concatenation made in place
    /// (`concat`): where it goes in the concatenation's result.
    pub(crate) part: Option<concat::PartOf>,
    /// For a 1×1 convolution: the depthwise convolution after it, the only reader of its
    /// output, which runs with it (`heads`).
    pub(crate) then: Option<Box<CStep>>,
}

/// A kernel of kwexport's for a node that otherwise dispatches (`CStep::own`).
#[derive(Debug, Clone)]
pub enum OwnOp {
    /// `adaptive_avg_pool2d(x, [1, 1])` on a channels-last float32 CPU tensor: each channel's
    /// mean over its pixels (`kernels::mean_pixels_f32`; torch's op is a `mean` over the
    /// two dimensions, which sets up a reduction on every call).
    GlobalAvgPool,
    /// `mean(x, [2, 3], keepdim)` (or `[-2, -1]`) with no dtype on the same tensors: the same
    /// kernel, its output laid out as torch's reduction gives it.
    MeanPixels { keepdim: bool },
    /// `scaled_dot_product_attention` without dropout over float32 CPU tensors and few keys
    /// (`kernels::attention_f32`): the mask (argument 3) as the call gives it, or the causal
    /// triangle, and the scale where the node sets one; `choices` records, per number of
    /// queries and keys and thread count, whether it beat torch's kernel where the keys are
    /// more than the family takes unmeasured (`exec::choice`).
    Attention { causal: bool, scale: Option<f64>, choices: std::sync::Arc<Choices> },
    /// `cat` of float32 CPU tensors dense in the order torch gives the result
    /// (`kernels::copy`), its output in kwexport's arena (`abi::arena`).
    Cat { dim: i64 },
    /// `contiguous` of a float32 CPU tensor with two axes of a dense one swapped
    /// (`kernels::copy::swap_axes`: a channel shuffle's, an attention head's).
    Contiguous,
    /// `max_pool2d` without dilation or ceil mode on a channels-last float32 CPU tensor
    /// (`kernels::max_pool_f32`; torch's channels-last kernel sets up per call and runs at a
    /// fifth of the speed on resnet18's stem pooling).
    MaxPool(crate::operators::MaxPool),
    /// `kwexport::rotary_embedding` (`passes::rotary`) halving and concatenating along the
    /// last dimension, over float32 CPU tensors (`kernels::rotary`): `x`'s second half
    /// from `split`.
    Rotary { split: i64 },
    /// `kwexport::linear_int8` and `kwexport::conv_int8` (`passes::linear_int8`) on a float32
    /// CPU input and the weight's panels (`kernels::int8`).
    LinearInt8(std::sync::Arc<Int8Linear>),
    /// `fake_quantize_per_tensor_affine` with literal parameters (`passes::fake_quantize`) on
    /// a dense float32 CPU tensor (`kernels::int8::fake_quantize_f32`, through `operators`).
    FakeQuantize(crate::operators::Quant),
    /// `fake_quantize_per_tensor_affine.tensor_qparams`: the same with the scale and zero
    /// point one-element CPU tensors (arguments 1 and 2, read per call) and this range.
    FakeQuantizeTensors { qmin: i64, qmax: i64 },
}

/// What an int8 linear's kernel needs besides the node's tensors: where the input's scale
/// and zero point come from, its range, the weight's `[n, k]`, the activation fused with it,
/// the quantization of its result fused with it (`passes::linear_int8_output`), and the
/// weight's panels; for an int8 convolution, its geometry (`k` then its input channels) and
/// whether it adds a residual.
#[derive(Debug)]
pub struct Int8Linear {
    pub(crate) conv: Option<Int8Conv>,
    pub(crate) params: Int8Params,
    pub(crate) range: [i64; 2],
    pub(crate) n: i64,
    pub(crate) k: i64,
    pub(crate) epilogue: crate::operators::Epilogue,
    pub(crate) output: Option<crate::operators::Quant>,
    pub(crate) panels: crate::operators::Int8Panels,
}

/// An int8 convolution's geometry, and whether it adds the tensor of argument 12 to its
/// results before the activation (`kwexport::conv_int8.residual`, `passes::conv_residual`).
#[derive(Debug)]
pub struct Int8Conv {
    pub(crate) geometry: crate::operators::Conv2d,
    pub(crate) residual: bool,
}

/// An int8 linear's input scale and zero point: literals (`.default`), the tensors of
/// arguments 1 and 2 (`.tensor`), or chosen from each call's input with this `eps`
/// (`.dynamic`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Int8Params {
    Literal(f64, i64),
    Tensors,
    Chosen(f64),
}

/// A node run through one of torch's per-op C shims (see `shims`).
pub struct ShimStep {
    pub(crate) f: ShimFn,
    pub(crate) family: Family,
    /// The `Scalar` arguments, exactly representable as doubles.
    pub(crate) scalars: Vec<f64>,
    /// The shim takes Scalars as doubles: it runs on floating tensors only.
    pub(crate) floating_only: bool,
    /// The op writes its result into its first tensor (`add_`).
    pub(crate) in_place: bool,
    /// Autocast changes the op, so a kernel that skips the dispatcher can't run under it.
    pub(crate) autocast: bool,
    /// `(tensor, dims)`: the shim's tensor `tensor` must have `dims` dimensions.
    pub(crate) dims: Option<(usize, i64)>,
    /// Whether that tensor may have more dimensions where it is contiguous: it is folded to
    /// a matrix and the result unfolded, as `at::linear` does (`Abi::fold_leading`).
    pub(crate) fold: bool,
    /// At `fast`, a linear's weight transposed and contiguous for kwexport's small-batch
    /// kernel, and which kernel won for each number of rows seen.
    pub(crate) packed: Option<Box<Packed>>,
    /// The activation a fused linear applies to its result (`passes::linear_pointwise`):
    /// kwexport's GEMM as it stores, or kwexport's pointwise kernel after torch's.
    pub(crate) epilogue: crate::operators::Epilogue,
    /// For oneDNN's fused convolution, its geometry and packed weight.
    pub(crate) conv: Option<Box<Conv>>,
    /// The node through its Python op, for calls the shim can't take (integer tensors).
    pub(crate) fallback: Option<PyStep>,
    /// `add(a, b)` with alpha 1: where the shim can't take the tensors (it takes `alpha` as a
    /// double, which torch refuses for integers), kwexport's int64 kernel adds them exactly
    /// (position arithmetic) instead of the Python op.
    pub(crate) integer_add: bool,
}

/// A convolution on oneDNN's fused kernel (`passes::conv_pointwise`): the geometry it was
/// compiled with, and its weight packed into oneDNN's layout for this CPU on the first call
/// at each thread count (`mkldnn::_reorder_convolution_weight`; a load shouldn't pay for
/// packing every weight). Threads that call first together wait for one packing.
pub struct Conv {
    pub(crate) padding: [i64; 2],
    pub(crate) stride: [i64; 2],
    pub(crate) dilation: [i64; 2],
    pub(crate) groups: i64,
    /// The post-op: `relu`, `hardswish`, ... or `none`.
    pub(crate) attr: std::ffi::CString,
    /// The post-op's scalars: ReLU6's bounds for `hardtanh`, else none.
    pub(crate) scalars: Vec<f64>,
    /// The post-op's algorithm: GELU's approximation (`none` or `tanh`), else none.
    pub(crate) algorithm: Option<std::ffi::CString>,
    /// Whether the step's third tensor is a bias.
    pub(crate) bias: bool,
    /// For `_convolution_pointwise.binary` (`passes::conv_residual`): the residual add, whose
    /// tensor is the step's last, and the post-op after it (`relu`, or none).
    pub(crate) residual: Option<Option<std::ffi::CString>>,
    /// The weight's `[out, in, kh, kw]`.
    pub(crate) shape: [i64; 4],
    /// The const index of the plain weight.
    pub(crate) weight: usize,
    /// The packed weight per intra-op thread count (1, 2, 3, then 4 or more), or the plain
    /// one where torch couldn't pack it (oneDNN then reorders it on each call: slower, the
    /// same values). oneDNN's kernel, and the blocking it wants, depends on the threads: a
    /// weight packed at two threads is reordered on every call at one (shufflenet_v2 on an
    /// AVX2 CPU: 36.6 ms a call against 6.9).
    pub(crate) packed: [std::sync::OnceLock<Option<crate::abi::Tensor>>; 4],
    /// kwexport's kernel for this convolution, where it has one (below).
    pub(crate) own: Option<Box<OwnConv>>,
    /// The post-op (or, with a residual, the one after the add) where oneDNN's kernel turns
    /// NaN into a number (`relu` and `hardsigmoid`: its `max`/`min` return the non-NaN
    /// operand, where torch's ops keep NaN), as kwexport's epilogue: where an input isn't
    /// finite, `exec` runs oneDNN without the post-op, then this.
    pub(crate) nan_post_op: Option<crate::operators::Epilogue>,
}

impl Conv {
    /// The output's sizes for input `x`, `None` where its sizes can't be read or the kernel
    /// doesn't fit.
    ///
    /// # Safety
    /// `x` must be a live handle.
    pub(crate) unsafe fn output_sizes(&self, abi: &crate::abi::Abi, x: crate::abi::Raw) -> Option<Vec<i64>> {
        // SAFETY: the caller's live handle.
        let (s, _) = unsafe { abi.sizes_strides(x) }?;
        let out = |d: usize| {
            let reach = self.dilation[d] * (self.shape[2 + d] - 1) + 1;
            let span = s.get(2 + d)? + 2 * self.padding[d] - reach;
            (span >= 0 && self.stride[d] > 0).then(|| span / self.stride[d] + 1)
        };
        Some(vec![*s.first()?, self.shape[0], out(0)?, out(1)?])
    }
}

/// A convolution kwexport runs on a kernel of its own over channels-last pixels, where that
/// measured faster than oneDNN for that many pixels (`exec`), with the post-op applied as
/// each result is stored.
pub struct OwnConv {
    pub(crate) kernel: OwnKernel,
    pub(crate) epilogue: crate::operators::Epilogue,
    pub(crate) choices: Choices,
}

/// Which of kwexport's kernels, on which packed weight (a const index).
pub enum OwnKernel {
    /// A 1×1 convolution with stride 1, no padding and one group: a matrix product over
    /// pixels, on the `[n, k, 1, 1]` weight's `[k, n]` transpose packed into panels.
    Gemm { panels: std::sync::Arc<crate::operators::Panels>, n: i64 },
    /// A depthwise convolution (one group per channel, one output per group, no dilation):
    /// its `[c, 1, kh, kw]` weight as `[kh * kw, c]` taps.
    Depthwise { taps: usize, geometry: crate::operators::Depthwise },
    /// A convolution over few input channels (a stem's: `kernels::Conv2d::MAX_DIRECT_IN_CHANNELS`),
    /// one group, on an input of any layout: its weight as `[in * kh * kw, out]` taps.
    Direct { taps: usize, geometry: crate::operators::Conv2d },
    /// A patch embedding (`kernels::patches::tiles`: the kernel tiles the image, ViT's
    /// 16×16 at stride 16), on an input of any layout: each patch gathered into a dense row,
    /// then the GEMM, on the weight packed into panels on the node's first call.
    Patches {
        weight: usize,
        geometry: crate::operators::Conv2d,
        panels: std::sync::OnceLock<Option<crate::abi::Tensor>>,
    },
    /// Any other convolution with one group: the GEMM over channels-last patches read in
    /// place (`kernels::indirect_f32`), on the plain weight packed into panels on the node's first
    /// call (`kernels::pack_conv_panels`), as oneDNN's is: a load shouldn't pay for every
    /// weight of a network.
    Indirect {
        weight: usize,
        geometry: crate::operators::Conv2d,
        panels: std::sync::OnceLock<Option<crate::abi::Tensor>>,
        /// Packed for the bfloat16 GEMM (`precision="bf16"`, `kernels::bf16::indirect`).
        bf16: bool,
        /// For a float32 3×3 at stride 1, Winograd's kernel, which runs it where the output
        /// has enough pixels.
        winograd: Option<Winograd>,
    },
}

/// A 3×3 convolution's weight transformed for Winograd's F(2×2, 3×3) (`kernels::winograd`),
/// packed on first use, and the fewest output pixels the kernel runs for
/// (`kernels::winograd::MIN_PIXELS`; fewer run the direct kernel).
pub struct Winograd {
    pub(crate) panels: std::sync::OnceLock<Option<crate::abi::Tensor>>,
    pub(crate) min_pixels: i64,
}

/// A linear's weight for kwexport's kernel (`kernels::linear_f32`), and the kernel measured
/// fastest for each number of input rows seen, per process.
pub struct Packed {
    /// The weight as `[k, n]` packed into the kernel's panels (a copy made on the first call
    /// that runs the kernel: of `weight.t()` for a linear, of the weight itself for an
    /// `addmm`'s second matrix), and `n`.
    pub(crate) panels: std::sync::Arc<crate::operators::Panels>,
    pub(crate) n: i64,
    /// Which of the step's tensors is the input matrix (a bias, if any, is tensor 0 before it).
    pub(crate) input: usize,
    pub(crate) choices: Choices,
}

/// Why a node runs on the Python path, as `Program.dispatch` reports it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Why {
    /// `dispatch="python"`.
    Asked,
    /// The running torch has no usable stable C ABI.
    NoAbi,
    /// A Python operator on sizes (`operator.mul`, ...).
    PythonOperator,
    /// A higher-order op, which kwexport runs; its subgraphs' nodes are counted on their own.
    HigherOrder,
    /// An argument whose schema type the ABI can't pass: `(name, type)`.
    ArgType(String, String),
    /// An argument whose value the ABI can't pass for its type: `(name, type)`.
    ArgValue(String, String),
    /// A default of the schema that kwexport can't express.
    Default,
    /// Return types the ABI can't pass back.
    ReturnType(String),
    /// `dispatch="auto"`: converting its values to and from the C path costs more than it saves.
    NotWorthIt,
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::Asked => write!(f, "dispatch='python' was asked for"),
            Why::NoAbi => write!(f, "the running torch has no usable stable C ABI (torch 2.13 and later have one)"),
            Why::PythonOperator => write!(f, "a Python operator on symbolic sizes"),
            Why::HigherOrder => {
                write!(f, "a higher-order op: kwexport runs it; its subgraphs' nodes count on their own")
            }
            Why::ArgType(name, ty) => {
                let ty = if ty == "number" { "Scalar" } else { ty }; // as torch prints a Scalar's type
                write!(f, "argument '{name}' is a {ty}, which the stable C ABI can't pass")
            }
            Why::ArgValue(name, ty) => {
                write!(f, "the value given for argument '{name}' ({ty}) can't be passed as that type")
            }
            Why::Default => write!(f, "a default of the op's schema that kwexport can't express"),
            Why::ReturnType(ty) => write!(f, "it returns {ty}, which the stable C ABI can't pass back"),
            Why::NotWorthIt => {
                write!(f, "dispatch='auto': moving its values to and from the C path costs more than it saves")
            }
        }
    }
}

/// Consecutive nodes on one path, with the crossings they need first.
pub enum Segment {
    /// Nodes on the Python path.
    Python {
        /// Slots whose native values are read here: converted to Python first.
        to_py: Vec<usize>,
        /// The nodes.
        steps: Vec<PyStep>,
    },
    /// Nodes on the C path.
    C {
        /// Slots whose Python values are read here: converted to native first.
        to_native: Vec<usize>,
        /// The nodes.
        steps: Vec<CStep>,
        /// Python forms of the slots these steps free, dropped once the GIL is back.
        free_py: Vec<usize>,
        /// How long the segment took last time, in nanoseconds.
        last_ns: AtomicU64,
    },
}

/// A program's execution plan.
pub struct Plan {
    pub(crate) n_slots: usize,
    pub(crate) user_inputs: Vec<(usize, usize)>,
    pub(crate) segments: Vec<Segment>,
    /// Native slots the outputs read, converted after the last segment.
    pub(crate) outputs_to_py: Vec<usize>,
    pub(crate) outputs: Vec<PyArg>,
    pub(crate) abi: Option<&'static Abi>,
    /// Weights and wrapped numbers that C steps read, as handles.
    pub(crate) consts: Vec<abi::Tensor>,
    pub(crate) tensor_type: Py<PyAny>,
    /// Nodes on the C path, subgraphs' included.
    pub n_c: usize,
    /// Each node on the Python path, subgraphs' included: its op and why.
    pub on_python: Vec<(String, Why)>,
    /// Whether each output is always a tensor (for the C path of a plan around this one).
    pub(crate) output_is_tensor: Vec<bool>,
    /// `torch.is_autocast_enabled`, where some step runs an op that autocast changes through a
    /// shim that skips the dispatcher: each run checks that autocast is off.
    pub(crate) autocast_probe: Option<Py<PyAny>>,
    /// Whether some step runs a shim that skips the dispatcher (so autograd is checked).
    pub(crate) has_direct_shims: bool,
    /// `torch.is_grad_enabled` and `torch._C._set_grad_enabled`, where weights were marked
    /// as requiring grad: calls with no input that requires grad run with grad mode off.
    pub(crate) grad_switch: Option<(Py<PyAny>, Py<PyAny>)>,
}

impl Plan {
    /// Runs calls that no input makes differentiable with grad mode off (see
    /// `weights::mark_grad_sensitive`).
    pub fn set_grad_off_when_unused(&mut self, torch: &Bound<'_, PyModule>) -> PyResult<()> {
        let set = torch.getattr("_C")?.getattr("_set_grad_enabled")?;
        self.grad_switch = Some((torch.getattr("is_grad_enabled")?.unbind(), set.unbind()));
        Ok(())
    }
}

/// A node compiled for one path, before segmenting.
enum Compiled {
    Python(PyStep),
    C(CStep),
}

/// What a plan is built from: the resolved ops, the weights, the subgraphs and the
/// dispatch mode, shared by a plan and the plans nested in it.
pub struct Context<'a, 'py> {
    /// The running `torch` module.
    pub torch: &'a Bound<'py, PyModule>,
    /// The op table, resolved.
    pub ops: &'a [ResolvedOp],
    /// The weights, as tensors over the mapped file.
    pub weights: &'a BTreeMap<String, Py<PyAny>>,
    /// The subgraphs higher-order ops run.
    pub subgraphs: &'a BTreeMap<String, SlotGraph>,
    /// Which paths plans may use.
    pub dispatch: Dispatch,
    /// Whether the program runs on the CPU: the shims that call CPU kernels directly are
    /// compiled only then.
    pub on_cpu: bool,
    /// `optimize="fast"`: kernels may differ from eager's within the level's tolerance
    /// (kwexport's own small-batch linear, chosen by measuring).
    pub fast: bool,
    /// `precision="bf16"`: kwexport's GEMM runs on weights packed in bfloat16.
    pub bf16: bool,
}

/// Runs `f` with torch's grad mode set to `enabled`, then restores it (also when `f` fails).
pub fn with_grad_mode<T>(torch: &Bound<'_, PyModule>, enabled: bool, f: impl FnOnce() -> T) -> PyResult<T> {
    let set = torch.getattr("_C")?.getattr("_set_grad_enabled")?;
    let was_enabled = torch.call_method0("is_grad_enabled")?;
    set.call1((enabled,))?;
    let out = f();
    set.call1((was_enabled,))?;
    Ok(out)
}

/// Resolves weights and literals, checks each node against its op's schema, and chooses
/// each node's path. `leaf_is_tensor` says which of the graph's leaves are tensors.
pub fn build(cx: &Context<'_, '_>, graph: &SlotGraph, leaf_is_tensor: &[bool]) -> RtResult<Plan> {
    let py = cx.torch.py();
    let abi = match cx.dispatch {
        // The kernels split their work on torch's pool from the first plan on.
        Dispatch::Auto | Dispatch::Abi => Abi::get(py).inspect(|&abi| crate::operators::install_pool(abi)),
        Dispatch::Python => None,
    };
    let mut consts = consts::ConstTable::new(py, cx.torch, cx.weights, abi, cx.bf16);
    // Plans of the higher-order nodes' subgraphs first: what they return says which of the
    // nodes' outputs are tensors.
    let mut tensor_slot = vec![false; graph.n_slots];
    for &(slot, leaf) in &graph.user_inputs {
        tensor_slot[slot] = leaf_is_tensor.get(leaf).copied().unwrap_or(false);
    }
    let mut hops = Vec::with_capacity(graph.nodes.len());
    for (i, node) in graph.nodes.iter().enumerate() {
        let op = &cx.ops[node.op];
        let hop = match op.hop {
            Some(kind) => Some(HopStep::build(cx, kind, node, &tensor_slot, i)?),
            None => None,
        };
        mark_tensor_outputs(&mut tensor_slot, node, op, hop.as_ref());
        hops.push(hop);
    }
    let is_tensor = |s: usize| tensor_slot[s];
    let mut c_steps = Vec::with_capacity(graph.nodes.len());
    for (i, node) in graph.nodes.iter().enumerate() {
        let op = &cx.ops[node.op];
        if let Some(schema) = &op.schema {
            schema.check(node, || format!("graph.nodes[{i}] ({})", node.op_name))?;
        }
        let step = match (cx.dispatch, abi, &op.schema, op.hop) {
            (Dispatch::Python, ..) => Err(Why::Asked),
            (_, _, _, Some(_)) => Err(Why::HigherOrder),
            (_, _, None, _) => Err(Why::PythonOperator),
            (_, None, ..) => Err(Why::NoAbi),
            (_, Some(abi), Some(schema), None) => match schema.bind(node) {
                None => Err(Why::Default),
                Some(bound) => {
                    match shims::compile(abi, schema, node, &bound, &is_tensor, &mut consts, cx.on_cpu, cx.fast) {
                        Some(step) => Ok(step),
                        None => match CStep::compile(abi, schema, node, &bound, &is_tensor, &mut consts) {
                            Ok(mut step) => {
                                if cx.fast && cx.on_cpu {
                                    step.own = shims::own_op(schema, &bound, &mut consts);
                                }
                                Ok(step)
                            }
                            Err(why) => {
                                consts.folded_factory(node, op, i)?.map(|c| CStep::clone_of(c, node)).ok_or(why)
                            }
                        },
                    }
                }
            },
        };
        c_steps.push(step);
    }
    if cx.dispatch == Dispatch::Auto {
        cost::keep_profitable(&mut c_steps, graph);
    }
    let mut compiled = Vec::with_capacity(graph.nodes.len());
    let (mut n_c, mut on_python) = (0, Vec::new());
    for (i, ((node, c), hop)) in graph.nodes.iter().zip(c_steps).zip(hops).enumerate() {
        compiled.push(match (c, hop) {
            (Ok(mut s), _) => {
                n_c += 1;
                s.node = i;
                if let Some(abi) = abi {
                    s.cast_numbers_ahead(abi, &mut consts);
                }
                if let Some(shim) = &mut s.shim {
                    shim.fallback = Some(consts.py_step(node, &cx.ops[node.op], i)?);
                }
                Compiled::C(s)
            }
            (Err(why), hop) => {
                on_python.push((node.op_name.to_string(), why));
                match hop {
                    Some(hop) => {
                        for body in &hop.bodies {
                            n_c += body.n_c;
                            on_python.extend(body.on_python.iter().cloned());
                        }
                        Compiled::Python(consts.hop_step(node, hop, i)?)
                    }
                    None => Compiled::Python(consts.py_step(node, &cx.ops[node.op], i)?),
                }
            }
        });
    }
    let outputs = graph
        .outputs
        .iter()
        .map(|a| consts.py_arg(a, None, &|| "graph.outputs".to_owned()))
        .collect::<RtResult<Vec<_>>>()?;
    let handles = match abi {
        Some(abi) => consts.into_handles(abi)?,
        None => Vec::new(),
    };
    let output_is_tensor = graph.outputs.iter().map(|a| is_tensor_arg(a, &tensor_slot)).collect();
    let direct = |autocast: bool| {
        compiled.iter().any(|c| {
            matches!(c, Compiled::C(CStep { shim: Some(s), .. }) if s.family == Family::Cpu && (s.autocast || !autocast))
        })
    };
    // Views made without the dispatcher need the same check of autograd as direct shims.
    let has_direct_shims = direct(false)
        || compiled.iter().any(|c| matches!(c, Compiled::C(CStep { view: Some(_), .. } | CStep { own: Some(_), .. })));
    let autocast_probe = direct(true).then(|| cx.torch.getattr("is_autocast_enabled")).transpose()?.map(Bound::unbind);
    let mut returned = vec![false; graph.n_slots];
    graph.outputs.iter().for_each(|a| kwexport_core::graph::visit_slots(a, &mut |s| returned[s] = true));
    for c in &mut compiled {
        if let Compiled::C(step) = c {
            step.to_caller = step.outputs.defined().any(|(_, s)| returned[s]);
        }
    }
    if cx.fast && cx.on_cpu {
        concat::in_place(graph, &mut compiled);
    }
    let (mut segments, outputs_to_py) = segments::segment(graph, compiled);
    if cx.fast && cx.on_cpu {
        heads::fuse(graph, &mut segments);
    }
    Ok(Plan {
        n_slots: graph.n_slots,
        user_inputs: graph.user_inputs.clone(),
        segments,
        outputs_to_py,
        outputs,
        abi,
        consts: handles,
        tensor_type: cx.torch.getattr("Tensor")?.unbind(),
        n_c,
        on_python,
        output_is_tensor,
        autocast_probe,
        has_direct_shims,
        grad_switch: None,
    })
}

/// Marks the node's outputs that always hold tensors: where its schema returns a tensor, or
/// (a higher-order op) where every subgraph it may run returns one. Python operators on
/// sizes return numbers.
fn mark_tensor_outputs(tensor_slot: &mut [bool], node: &SlotNode, op: &ResolvedOp, hop: Option<&HopStep>) {
    if let Some(hop) = hop {
        // `while_loop`'s first subgraph is its condition: its body's returns are the node's.
        let results = if hop.kind == HopKind::WhileLoop { &hop.bodies[1..] } else { &hop.bodies[..] };
        for (i, s) in node.outputs.defined() {
            tensor_slot[s] = results.iter().all(|b| b.output_is_tensor.get(i).copied().unwrap_or(false));
        }
        return;
    }
    let returns = op.schema.as_ref().and_then(|s| s.c_returns.as_deref()).unwrap_or(&[]);
    for (i, s) in node.outputs.defined() {
        tensor_slot[s] = match returns {
            [Ty::List(inner)] => **inner == Ty::Tensor,
            _ => returns.get(i) == Some(&Ty::Tensor),
        };
    }
}

/// Whether an argument is always a tensor: a tensor slot, or a weight.
fn is_tensor_arg(a: &SlotArg, tensor_slot: &[bool]) -> bool {
    match a {
        SlotArg::Value(ValueRef::Slot(s)) => tensor_slot[*s],
        SlotArg::Value(ValueRef::Weight(_)) => true,
        _ => false,
    }
}
