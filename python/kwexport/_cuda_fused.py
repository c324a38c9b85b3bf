"""The Python forms of kwexport's fused elementwise ops for CUDA: a residual add with the norm
after it (``kwexport::add_norm``, ``rust/core/src/passes/add_norm.rs``), the rotary
embedding (``kwexport::rotary_embedding``, ``rust/core/src/passes/rotary.rs``), and a
product's bias and GELU (one of the ways ``kwexport::linear_measured.gelu`` may compute,
``kwexport._cuda_gemm``).

A transformer at batch 1 on a GPU is bound by its kernels' count, not their work: each small
elementwise op is a launch and a pass over memory. The passes insert these ops where calls
replay as CUDA graphs (``fast`` with ``cuda_graphs``), and each runs as one Triton kernel
(Triton ships with CUDA builds of torch) where the ops it replaced took two to five. Anywhere
else (no Triton, a CPU tensor, a shape or dtype the kernel doesn't take) the form runs the
ops the pass replaced, as the graph held them, so it computes what the exported graph does.

The kernels compute in float32 and round once, where the ops they replaced rounded after each
op: within a unit in the last place of the model's dtype, as ``fast`` allows
(``docs/optimize.md``). A residual sum the graph reads again is rounded to its dtype first,
as the add did, so it is bitwise the add's.
"""

from __future__ import annotations

import functools
import os
from typing import Any

# The dtypes the kernels take; others run the ops the pass replaced.
_FLOATS = ("float32", "bfloat16", "float16")
# The widest row a norm's kernel holds in registers (one row per program).
_MAX_ROW = 16384


@functools.cache
def kernels() -> Any:
    """The Triton kernels, compiled per shape class on first launch; ``None`` where Triton
    can't be imported (a CPU-only torch)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def add_norm(  # noqa: PLR0917 (a kernel's arguments)
        x, r, w, b, s, y, n, eps, RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr
    ):
        # One row per program: s = x + r rounded to s's dtype (the add's), then the norm of s
        # (cast to y's dtype first, as a `to` between them does) in float32, rounded once.
        row = tl.program_id(0).to(tl.int64) * n
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        xs = tl.load(x + row + cols, mask=mask, other=0.0).to(tl.float32)
        rs = tl.load(r + row + cols, mask=mask, other=0.0).to(tl.float32)
        total = (xs + rs).to(s.dtype.element_ty)
        tl.store(s + row + cols, total, mask=mask)
        v = total.to(y.dtype.element_ty).to(tl.float32)
        if RMS:
            out = v * (1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n + eps))
        else:
            d = tl.where(mask, v - tl.sum(v, axis=0) / n, 0.0)
            out = d * (1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n + eps))
        if HAS_W:
            out = out * tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            out = out + tl.load(b + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y + row + cols, out.to(y.dtype.element_ty), mask=mask)

    @triton.jit
    def rotary(  # noqa: PLR0917 (a kernel's arguments)
        x,
        c,
        s,
        y,
        H,
        S,
        D,
        split,
        xs0,
        xs1,
        xs2,
        xs3,
        cs0,
        cs1,
        cs2,
        cs3,
        ss0,
        ss1,
        ss2,
        ss3,
        ys0,
        ys1,
        ys2,
        ys3,
        BLOCK: tl.constexpr,
    ):
        # One row (batch, head, position) per program, all four tensors strided:
        # y = x * c + cat([-x[split:], x[:split]]) * s along the last dimension.
        pid = tl.program_id(0).to(tl.int64)
        p = pid % S
        h = (pid // S) % H
        bt = pid // (S * H)
        j = tl.arange(0, BLOCK)
        mask = j < D
        keep = D - split  # positions [0, keep) read -x[j + split]; the rest x[j - keep]
        rot = tl.where(j < keep, j + split, j - keep)
        xrow = x + bt * xs0 + h * xs1 + p * xs2
        xv = tl.load(xrow + j * xs3, mask=mask, other=0.0).to(tl.float32)
        xr = tl.load(xrow + rot * xs3, mask=mask, other=0.0).to(tl.float32)
        xr = tl.where(j < keep, -xr, xr)
        cv = tl.load(c + bt * cs0 + h * cs1 + p * cs2 + j * cs3, mask=mask, other=0.0).to(tl.float32)
        sv = tl.load(s + bt * ss0 + h * ss1 + p * ss2 + j * ss3, mask=mask, other=0.0).to(tl.float32)
        out = xv * cv + xr * sv
        tl.store(y + bt * ys0 + h * ys1 + p * ys2 + j * ys3, out.to(y.dtype.element_ty), mask=mask)

    @triton.jit
    def bias_gelu(y, b, n, total, TANH: tl.constexpr, BLOCK: tl.constexpr):  # noqa: PLR0917 (a kernel's arguments)
        # In place over a product's rows: y = gelu(y + b) in float32, rounded once. The tanh
        # form as 0.5 * (1 + tanh(z)) = 1 / (1 + exp(-2z)), which doesn't cancel.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        v = tl.load(y + offs, mask=mask, other=0.0).to(tl.float32)
        v += tl.load(b + offs % n, mask=mask, other=0.0).to(tl.float32)
        if TANH:
            out = v / (1.0 + tl.exp(-1.5957691216057308 * (v + 0.044715 * v * v * v)))
        else:
            out = 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))
        tl.store(y + offs, out.to(y.dtype.element_ty), mask=mask)

    return {
        "add_norm": add_norm,
        "rotary": rotary,
        "bias_gelu": bias_gelu,
        "next_power_of_2": triton.next_power_of_2,
        "cdiv": triton.cdiv,
    }


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _on_kernel(*tensors: Any) -> bool:
    """Whether the kernels take these tensors: on one CUDA device (or any device, where Triton
    runs interpreted for the tests: ``TRITON_INTERPRET=1``), of one float dtype, none that
    autograd records (the kernels have no backward), Triton present."""
    first = tensors[0]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    same = all(t.device == first.device and t.dtype == first.dtype and not t.requires_grad for t in tensors)
    usable = first.is_cuda or interpreted
    return same and usable and _dtype_name(first) in _FLOATS and kernels() is not None


def _add_norm(x: Any, other: Any, n: Any, w: Any, b: Any, eps: float, dtype: Any, rms: bool) -> Any:  # noqa: PLR0917
    """``(norm(x + other), x + other)`` by the kernel; ``None`` where it doesn't take them."""
    import torch

    norm_dtype = x.dtype if dtype is None else dtype
    params = [t for t in (w, b) if t is not None]
    dense = x.shape == other.shape and x.is_contiguous() and other.is_contiguous() and x.numel() > 0
    fits = len(n) == 1 and x.dim() >= 1 and x.shape[-1] == n[0] and 0 < n[0] <= _MAX_ROW
    if not (dense and fits and _on_kernel(x, other) and norm_dtype == x.dtype):
        return None
    if not all(t.shape == (n[0],) and t.is_contiguous() and _on_kernel(x, t) for t in params):
        return None
    k = kernels()
    total, y = torch.empty_like(x), torch.empty_like(x)
    block = k["next_power_of_2"](n[0])
    rows = x.numel() // n[0]
    warps = 4 if block <= 2048 else 8
    k["add_norm"][(rows,)](
        x, other, w if w is not None else x, b if b is not None else x, total, y, n[0], eps,
        RMS=rms, HAS_W=w is not None, HAS_B=b is not None, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return y, total


def add_norm_layer_norm(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any, other: Any, normalized_shape: list[int], weight: Any, bias: Any, eps: float
) -> tuple[Any, Any]:
    """``kwexport::add_norm.layer_norm``: ``s = add(x, other)`` then ``layer_norm(s, ...)``;
    returns the norm and ``s``."""
    import torch

    fused = _add_norm(x, other, normalized_shape, weight, bias, eps, None, rms=False)
    if fused is not None:
        return fused
    total = torch.add(x, other)
    return torch.layer_norm(total, normalized_shape, weight, bias, eps), total


def add_norm_rms_norm(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any, other: Any, normalized_shape: list[int], weight: Any, eps: float | None, dtype: Any
) -> tuple[Any, Any, Any]:
    """``kwexport::add_norm.rms_norm``: ``s = add(x, other)``, cast to ``dtype`` where given
    (Llama's `to`), then ``rms_norm``; returns the norm, ``s`` and ``s`` cast (``s`` itself
    where the cast changes nothing, as ``to`` returns it)."""
    import torch

    if eps is not None:
        fused = _add_norm(x, other, normalized_shape, weight, None, eps, dtype, rms=True)
        if fused is not None:
            return (*fused, fused[1])
    total = torch.add(x, other)
    cast = total if dtype is None else total.to(dtype)
    return torch.rms_norm(cast, normalized_shape, weight, eps), total, cast


def rotary_embedding(  # noqa: PLR0917 (the op's schema, positionally)
    x: Any, cos: Any, sin: Any, dim: int, cat_dim: int, split: int
) -> Any:
    """``kwexport::rotary_embedding``: ``x * cos + cat([-x[split:], x[:split]], cat_dim) * sin``,
    the halves sliced along ``dim`` (transformers' ``rotate_half`` for ``split`` half the
    last dimension)."""
    import torch

    if x.dim() == 4 and dim % 4 == 3 and cat_dim % 4 == 3 and 0 <= split <= x.shape[3] and x.numel() > 0:
        try:
            c, s = torch.broadcast_to(cos, x.shape), torch.broadcast_to(sin, x.shape)
        except RuntimeError:
            c = s = None
        if c is not None and _on_kernel(x, c, s) and x.shape[3] <= _MAX_ROW:
            k = kernels()
            y = torch.empty_like(x)
            b, h, p, d = x.shape
            k["rotary"][(b * h * p,)](
                x, c, s, y, h, p, d, split, *x.stride(), *c.stride(), *s.stride(), *y.stride(),
                BLOCK=k["next_power_of_2"](d), num_warps=1 if d <= 128 else 4,
            )  # fmt: skip
            return y
    end = x.shape[dim]
    halves = [torch.neg(torch.narrow(x, dim, split, end - split)), torch.narrow(x, dim, 0, split)]
    return x * cos + torch.cat(halves, cat_dim) * sin


# Elements per program of the bias-and-GELU kernel.
_GELU_BLOCK = 1024


def bias_gelu_(y: Any, bias: Any, approximate: str) -> Any:
    """``gelu(y + bias, approximate)`` written into ``y`` (a product's fresh ``[m, n]`` rows,
    ``bias`` of ``n``): one kernel where the ops take two."""
    import torch

    n = y.shape[-1] if y.dim() else 0
    fits = y.dim() == 2 and y.is_contiguous() and bias.shape == (n,) and bias.is_contiguous() and y.numel() > 0
    if fits and approximate in ("none", "tanh") and _on_kernel(y, bias):
        k = kernels()
        total = y.numel()
        k["bias_gelu"][(k["cdiv"](total, _GELU_BLOCK),)](
            y, bias, n, total, TANH=approximate == "tanh", BLOCK=_GELU_BLOCK, num_warps=4
        )
        return y
    return torch.ops.aten.gelu_(y.add_(bias), approximate=approximate)
