"""What the core's graph passes (rust/core/src/passes/) leave to torch: the weights the
``batch_norm`` pass folds, computed at load for a file loaded at ``fast`` and when ``kwexport
optimize`` writes one (in float64, rounded once to the weight's dtype); and the Python forms of
the ops the load-time passes insert, for calls their C kernels can't take."""

import functools
from typing import Any

from kwexport._cuda_fused import add_norm_layer_norm, add_norm_rms_norm, rotary_embedding  # noqa: F401 (re-exported)

# The runtime calls a pass op's Python form here by name (`linear_measured_addmm` for
# `kwexport::linear_measured.addmm`): re-exported.
from kwexport._cuda_gemm import addmm_measured as linear_measured_addmm  # noqa: F401 (re-exported)
from kwexport._cuda_gemm import addmm_measured_gelu as linear_measured_addmm_gelu  # noqa: F401 (re-exported)
from kwexport._cuda_gemm import linear_measured, linear_measured_gelu  # noqa: F401 (re-exported)


def fold_batch_norms(weights: dict[str, Any], folds: list[dict[str, Any]]) -> dict[str, Any]:
    """The new tensors, by weight name, for each fold (the pass's ``Fold``, as a dict):
    ``weight * s`` and ``(conv_bias - mean) * s + beta`` with ``s = gamma / sqrt(var + eps)``.
    Every fold reads the tensors as given, none of the new ones."""
    import torch

    def f64(name: str | None, default: float) -> Any:
        return weights[name].double() if name is not None else torch.tensor(default, dtype=torch.float64)

    new = {}
    with torch.no_grad():
        for f in folds:
            w = weights[f["weight"]]
            scale = f64(f["gamma"], 1.0) / (f64(f["var"], 0.0) + f["eps"]).sqrt()
            per_channel = scale.reshape(-1, *[1] * (w.dim() - 1))
            new[f["weight"]] = (w.double() * per_channel).to(w.dtype)
            bias = (f64(f["conv_bias"], 0.0) - f64(f["mean"], 0.0)) * scale + f64(f["beta"], 0.0)
            new[f["bias"]] = bias.to(weights[f["bias"]].dtype)
    return new


def dequantize_weight(w: Any, scale: Any, zero_point: Any, axis: int) -> Any:
    """An int8 weight's float32 values, as torch's ``dequantize_per_channel`` computes them
    (``(w - zero_point) * scale`` along ``axis``, in float32), for the ``dequantize_weights``
    pass: made once at load, so the convolutions that read it run on float32 weights."""
    import torch

    shape = [1] * w.dim()
    shape[axis] = -1
    with torch.no_grad():
        return (w.to(torch.float32) - zero_point.reshape(shape)) * scale.reshape(shape)


def _post_op(attr: str, scalars: list[Any] | None = None, algorithm: str | None = None) -> Any:
    """The post-op ``attr`` of oneDNN's fused convolution and linear as torch computes it: the
    aten op the core's table names for it (``_rt.POST_OPS``, rust/core/src/passes/post_ops.rs)
    on the result, with the post-op's scalars (ReLU6's bounds) and GELU's approximation."""
    if attr == "none":
        return lambda y: y
    import torch

    from kwexport import _rt

    namespace, name = dict(_rt.POST_OPS)[attr].split("::")
    packet, overload = name.split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    extra = {"approximate": algorithm} if algorithm is not None else {}
    return lambda y: op(y, *(scalars or []), **extra)


def _convolution_pointwise(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any,
    w: Any,
    b: Any,
    padding: list[int],
    stride: list[int],
    dilation: list[int],
    groups: int,
    attr: str,
    scalars: list[Any],
    algorithm: str | None,
) -> Any:
    """``mkldnn::_convolution_pointwise`` where the runtime can't call oneDNN's kernel on the
    tensors (autograd, autocast, an unbatched or non-float32 input, another device): the
    convolution and its activation as torch's own ops, which is what the pass replaced, so
    such a call computes what the graph as exported does."""
    import torch

    return _post_op(attr, scalars)(torch.conv2d(x, w, b, stride, padding, dilation, groups))


def _convolution_pointwise_binary(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any,
    other: Any,
    w: Any,
    b: Any,
    padding: list[int],
    stride: list[int],
    dilation: list[int],
    groups: int,
    binary_attr: str,
    alpha: Any,
    unary_attr: str | None,
    unary_scalars: list[Any],
    unary_algorithm: str | None,
) -> Any:
    """``mkldnn::_convolution_pointwise.binary`` (``conv_residual``'s node) off the runtime's
    kernels: the convolution, the add (broadcasting, promoting) and its ReLU as torch's own
    ops, which is what the pass replaced (rust/core/src/passes/conv_residual.rs)."""
    y = _convolution_pointwise(x, w, b, padding, stride, dilation, groups, "none", [], None) + other
    return _post_op(unary_attr or "none")(y)


def _linear_pointwise(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any,
    w: Any,
    b: Any,
    attr: str,
    scalars: list[Any],
    algorithm: str | None,
) -> Any:
    """``mkldnn::_linear_pointwise`` off the runtime's kernels (autograd, autocast, another
    dtype or device): the linear and its activation as torch's own ops, which is what the
    pass replaced (rust/core/src/passes/linear_pointwise.rs)."""
    import torch

    return _post_op(attr, scalars, algorithm)(torch.nn.functional.linear(x, w, b))


def linear_int8(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any,
    x_scale: float,
    x_zero_point: int,
    x_qmin: int,
    x_qmax: int,
    w: Any,
    w_scale: Any,
    w_zero_point: Any,
    bias: Any,
    attr: str,
    algorithm: str | None,
    out_scale: float | None = None,
    out_zero_point: int = 0,
    out_qmin: int = 0,
    out_qmax: int = 255,
) -> Any:
    """``kwexport::linear_int8`` off the runtime's int8 kernel (autograd, another dtype or
    device, a weight zero point that isn't 0): the ops the pass replaced
    (rust/core/src/passes/linear_int8.rs) as torch defines them
    (``torch/ao/quantization/fx/_decomposed.py``), so the same bits: the input quantized per
    tensor and dequantized, the int8 weight dequantized per output channel, then the linear
    and the activation fused with it (``attr`` and ``algorithm``, as ``mkldnn::_linear_pointwise``
    names them), then, where ``out_scale`` is given, the fake quantization of the result that
    ``linear_int8_output`` moved into it (rust/core/src/passes/linear_int8_output.rs).
    The cast to the 8-bit dtype between is left out: the clamped values are its integers."""
    import torch

    if w.dim() == 4:  # a 1×1 convolution's [n, k, 1, 1] weight, over channels-last pixels
        w = w.flatten(1)
    xd, wd = _dequantized(x, (x_scale, x_zero_point, x_qmin, x_qmax), w, w_scale, w_zero_point)
    y = torch.nn.functional.linear(xd, wd, bias)
    return _int8_post(y, attr, algorithm, (out_scale, out_zero_point, out_qmin, out_qmax))


def _dequantized(x: Any, quant: tuple[float, int, int, int], w: Any, w_scale: Any, w_zero_point: Any) -> Any:
    """The float32 operands of an int8 linear or convolution as torch's ops define them: the
    input quantized per tensor and dequantized, the int8 weight dequantized per output channel
    (dimension 0). The cast to the 8-bit dtype between is left out: the clamped values are its
    integers."""
    import torch

    scale, zero_point, qmin, qmax = quant
    q = torch.clamp(torch.round(x * (1.0 / scale)) + zero_point, qmin, qmax)
    per_channel = [-1] + [1] * (w.dim() - 1)
    wd = (w - w_zero_point.reshape(per_channel)) * w_scale.reshape(per_channel)
    return (q - zero_point) * scale, wd.to(torch.float32)


def _int8_post(y: Any, attr: str, algorithm: str | None, output: tuple[float | None, int, int, int]) -> Any:
    """An int8 op's result after its product: the activation fused with it, then the fake
    quantization of the result ``linear_int8_output`` moved into it, where its scale is given."""
    import torch

    # ReLU6, the one activation with scalars the pass fuses, is named without its bounds.
    y = _post_op(attr, [0.0, 6.0] if attr == "hardtanh" else None, algorithm)(y)
    scale, zero_point, qmin, qmax = output
    return y if scale is None else torch.fake_quantize_per_tensor_affine(y, scale, zero_point, qmin, qmax)


def conv_int8(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any,
    x_scale: float,
    x_zero_point: int,
    x_qmin: int,
    x_qmax: int,
    w: Any,
    w_scale: Any,
    w_zero_point: Any,
    bias: Any,
    stride: list[int],
    padding: list[int],
    groups: int,
    attr: str,
    algorithm: str | None,
    out_scale: float | None = None,
    out_zero_point: int = 0,
    out_qmin: int = 0,
    out_qmax: int = 255,
) -> Any:
    """``kwexport::conv_int8`` off the runtime's int8 kernel (autograd, another dtype or
    device, a weight zero point that isn't 0): the ops the ``linear_int8`` pass replaced
    (rust/core/src/passes/linear_int8.rs) as torch defines them, as :func:`linear_int8` for
    a ``conv2d`` of this stride, padding and groups (dilation 1)."""
    quant = (x_scale, x_zero_point, x_qmin, x_qmax)
    y = _int8_conv2d(x, quant, (w, w_scale, w_zero_point, bias), (stride, padding, groups))
    return _int8_post(y, attr, algorithm, (out_scale, out_zero_point, out_qmin, out_qmax))


def _int8_conv2d(
    x: Any,
    quant: tuple[float, int, int, int],
    weight: tuple[Any, Any, Any, Any],
    conv: tuple[list[int], list[int], int],
) -> Any:
    """The float32 ``conv2d`` of an int8 convolution's operands as torch's ops dequantize them
    (:func:`_dequantized`): the input's quantization, the weight's ``(w, w_scale,
    w_zero_point, bias)``, and ``(stride, padding, groups)`` (dilation 1)."""
    import torch

    w, w_scale, w_zero_point, bias = weight
    xd, wd = _dequantized(x, quant, w, w_scale, w_zero_point)
    stride, padding, groups = conv
    return torch.nn.functional.conv2d(xd, wd, bias, stride, padding, 1, groups)


def conv_int8_residual(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any,
    x_scale: float,
    x_zero_point: int,
    x_qmin: int,
    x_qmax: int,
    w: Any,
    w_scale: Any,
    w_zero_point: Any,
    bias: Any,
    stride: list[int],
    padding: list[int],
    groups: int,
    other: Any,
    attr: str,
    algorithm: str | None,
    out_scale: float | None = None,
    out_zero_point: int = 0,
    out_qmin: int = 0,
    out_qmax: int = 255,
) -> Any:
    """``kwexport::conv_int8.residual``: :func:`conv_int8` with ``other`` added to the
    convolution's result before the activation, the residual add (and ReLU) that the
    ``conv_residual`` pass moved into it (rust/core/src/passes/conv_residual.rs)."""
    quant = (x_scale, x_zero_point, x_qmin, x_qmax)
    y = _int8_conv2d(x, quant, (w, w_scale, w_zero_point, bias), (stride, padding, groups)).add_(other)
    return _int8_post(y, attr, algorithm, (out_scale, out_zero_point, out_qmin, out_qmax))


def linear_int8_tensor(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any,
    x_scale: Any,
    x_zero_point: Any,
    x_qmin: int,
    x_qmax: int,
    w: Any,
    w_scale: Any,
    w_zero_point: Any,
    bias: Any,
    attr: str,
    algorithm: str | None,
    *output: Any,
) -> Any:
    """``kwexport::linear_int8.tensor``: :func:`linear_int8` with the input's scale and zero
    point as one-element tensors (dynamic quantization's), read as torch's ``.tensor``
    quantize reads them (``.item()``)."""
    args = (x_qmin, x_qmax, w, w_scale, w_zero_point, bias, attr, algorithm, *output)
    return linear_int8(x, x_scale.item(), x_zero_point.item(), *args)


def linear_int8_dynamic(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any,
    x_qmin: int,
    x_qmax: int,
    eps: float,
    x_dtype: Any,
    w: Any,
    w_scale: Any,
    w_zero_point: Any,
    bias: Any,
    attr: str,
    algorithm: str | None,
    *output: Any,
) -> Any:
    """``kwexport::linear_int8.dynamic``: :func:`linear_int8_tensor` with the input's scale and
    zero point chosen from it by torch's ``choose_qparams.tensor`` (dynamic quantization)."""
    import torch
    import torch.ao.quantization.fx._decomposed  # noqa: F401 (registers quantized_decomposed)

    scale, zero_point = torch.ops.quantized_decomposed.choose_qparams.tensor(x, x_qmin, x_qmax, eps, x_dtype)
    args = (x_qmin, x_qmax, w, w_scale, w_zero_point, bias, attr, algorithm, *output)
    return linear_int8_tensor(x, scale, zero_point, *args)


def conv_int8_dynamic(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any,
    x_qmin: int,
    x_qmax: int,
    eps: float,
    x_dtype: Any,
    *rest: Any,
) -> Any:
    """``kwexport::conv_int8.dynamic``: :func:`conv_int8` with the input's scale and zero point
    chosen from it by torch's ``choose_qparams.tensor`` (dynamic quantization)."""
    import torch
    import torch.ao.quantization.fx._decomposed  # noqa: F401 (registers quantized_decomposed)

    scale, zero_point = torch.ops.quantized_decomposed.choose_qparams.tensor(x, x_qmin, x_qmax, eps, x_dtype)
    return conv_int8(x, scale.item(), zero_point.item(), x_qmin, x_qmax, *rest)


@functools.cache
def define_ops() -> Any:
    """Defines kwexport's own ops in torch's registry (once per process), so that the runtime
    resolves and dispatches them as it does torch's: ``kwexport::linear_int8`` and
    ``kwexport::conv_int8``, which only the ``linear_int8`` and ``conv_residual`` load-time passes write, ``kwexport::linear_measured``, which only
    ``linear_measured`` writes (``kwexport._cuda_gemm``), and the fused elementwise ops the
    ``add_norm`` and ``rotary`` passes write (``kwexport._cuda_fused``). Each runs its Python form through
    the dispatcher; the runtime's kernels take the calls they can. Returns torch's library object,
    which must live as long as the definitions (the cache holds it)."""
    import torch

    # The weight, then the activation fused with the linear as `mkldnn::_linear_pointwise` names it
    # (one without scalars: ReLU, SiLU, GELU), then the fake quantization of its result, if any.
    output = "float? out_scale=None, int out_zero_point=0, int out_qmin=0, int out_qmax=255"
    weight = (
        f"Tensor w, Tensor w_scale, Tensor w_zero_point, Tensor? bias, str attr, str? algorithm, {output}) -> Tensor"
    )
    tail = f"int x_qmin, int x_qmax, {weight}"
    library = torch.library.Library("kwexport", "DEF")
    library.define(f"linear_int8(Tensor x, float x_scale, int x_zero_point, {tail}")
    library.define(f"linear_int8.tensor(Tensor x, Tensor x_scale, Tensor x_zero_point, {tail}")
    library.impl("linear_int8", linear_int8, "CompositeExplicitAutograd")
    library.define(f"linear_int8.dynamic(Tensor x, int x_qmin, int x_qmax, float eps, ScalarType x_dtype, {weight}")
    library.impl("linear_int8.tensor", linear_int8_tensor, "CompositeExplicitAutograd")
    library.impl("linear_int8.dynamic", linear_int8_dynamic, "CompositeExplicitAutograd")
    quant = "Tensor x, float x_scale, int x_zero_point, int x_qmin, int x_qmax"
    conv = "Tensor w, Tensor w_scale, Tensor w_zero_point, Tensor? bias, int[2] stride, int[2] padding, int groups"
    library.define(f"conv_int8({quant}, {conv}, str attr, str? algorithm, {output}) -> Tensor")
    library.impl("conv_int8", conv_int8, "CompositeExplicitAutograd")
    chosen = "Tensor x, int x_qmin, int x_qmax, float eps, ScalarType x_dtype"
    library.define(f"conv_int8.dynamic({chosen}, {conv}, str attr, str? algorithm, {output}) -> Tensor")
    library.impl("conv_int8.dynamic", conv_int8_dynamic, "CompositeExplicitAutograd")
    library.define(f"conv_int8.residual({quant}, {conv}, Tensor other, str attr, str? algorithm, {output}) -> Tensor")
    library.impl("conv_int8.residual", conv_int8_residual, "CompositeExplicitAutograd")
    # Composite: autograd sees the aten ops the form runs.
    library.define("linear_measured(Tensor input, Tensor weight, Tensor bias) -> Tensor")
    library.define("linear_measured.addmm(Tensor self, Tensor mat1, Tensor mat2) -> Tensor")
    library.impl("linear_measured", linear_measured, "CompositeImplicitAutograd")
    library.impl("linear_measured.addmm", linear_measured_addmm, "CompositeImplicitAutograd")
    library.define("linear_measured.gelu(Tensor input, Tensor weight, Tensor bias, str approximate) -> Tensor")
    library.define("linear_measured.addmm_gelu(Tensor self, Tensor mat1, Tensor mat2, str approximate) -> Tensor")
    library.impl("linear_measured.gelu", linear_measured_gelu, "CompositeImplicitAutograd")
    library.impl("linear_measured.addmm_gelu", linear_measured_addmm_gelu, "CompositeImplicitAutograd")
    norm = "Tensor input, Tensor other, SymInt[] normalized_shape, Tensor? weight"
    library.define(f"add_norm.layer_norm({norm}, Tensor? bias, float eps) -> (Tensor, Tensor)")
    library.define(f"add_norm.rms_norm({norm}, float? eps, ScalarType? dtype) -> (Tensor, Tensor, Tensor)")
    library.define("rotary_embedding(Tensor x, Tensor cos, Tensor sin, int dim, int cat_dim, SymInt split) -> Tensor")
    library.impl("add_norm.layer_norm", add_norm_layer_norm, "CompositeImplicitAutograd")
    library.impl("add_norm.rms_norm", add_norm_rms_norm, "CompositeImplicitAutograd")
    library.impl("rotary_embedding", rotary_embedding, "CompositeImplicitAutograd")
    return library
