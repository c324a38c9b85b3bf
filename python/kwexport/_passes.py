"""What the core's graph passes (rust/core/src/passes/) leave to torch: the weights the
``batch_norm`` pass folds, computed at load for a file loaded at ``fast`` and when ``kwexport
optimize`` writes one (in float64, rounded once to the weight's dtype); and the Python forms of
the ops the load-time passes insert, for calls their C kernels can't take."""

from typing import Any


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
