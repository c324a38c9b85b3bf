"""The Python forms of ``kwexport::linear_measured`` (``rust/core/src/passes/linear_measured.rs``):
a biased linear, or ``addmm(bias, x, w)``, whose GEMM is chosen on the device; and the same
with the GELU that alone reads its result (``.gelu``, ``.addmm_gelu``).

torch runs a biased linear on CUDA as cuBLASLt with the bias as an epilogue; for some shapes
its heuristic picks a much slower kernel than plain cuBLAS picks for the product alone. The
first time a shape, dtype and device is seen outside a CUDA graph capture, each way of
computing the same thing is timed on the device, and the fastest runs from then on (the
exported op keeps its place unless another is 5% faster). Only the GPU's time counts: the
pass inserts the op where calls replay as CUDA graphs, which launch a kernel more for free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# Each candidate computes `x @ w + bias` over x's last dimension, `w` given as `[k, n]`: the
# exported op (cuBLASLt's bias epilogue), the product then the bias added in place (plain
# cuBLAS, a second kernel), and the bias broadcast into the output that cuBLAS accumulates
# onto (`beta = 1`; a copy kernel first).
CANDIDATES = ("epilogue", "product", "accumulate")
# With a GELU: each of those then the GELU, the product's with its bias in one kernel
# (`_cuda_fused.bias_gelu_`); for GELU's tanh form also cuBLASLt's GELU epilogue
# (`_addmm_activation`, whose activation is that form), one kernel in all.
TANH_CANDIDATES = (*CANDIDATES, "activation")

# The choice per (candidate's shapes, dtype, device); read without the lock, written under it.
_chosen: dict[tuple[Any, ...], str] = {}
# What each candidate measured for those keys, in µs.
_measured: dict[tuple[Any, ...], dict[str, float]] = {}
_lock = threading.Lock()
# The margin by which another candidate must beat the exported op.
MARGIN = 0.95
# Runs per timing, rounds per candidate, and GPU cycles the stream sleeps before each timing
# so that the host has queued every run (the timing is then the GPU's alone).
RUNS, ROUNDS, SLEEP_CYCLES = 10, 3, 2_000_000


def candidates(gelu: str | None) -> tuple[str, ...]:
    """The ways of computing a product with this GELU after it (``None``: none)."""
    return TANH_CANDIDATES if gelu == "tanh" else CANDIDATES


def _run(how: str, bias: Any, x: Any, w_kn: Any, gelu: str | None = None) -> Any:
    import torch

    if gelu is not None:
        from kwexport import _cuda_fused

        if how == "activation":
            return torch._addmm_activation(bias, x, w_kn, use_gelu=True)
        if how == "product":
            return _cuda_fused.bias_gelu_(torch.mm(x, w_kn), bias, gelu)
        return torch.ops.aten.gelu_(_run(how, bias, x, w_kn), approximate=gelu)
    if how == "epilogue":
        return torch.addmm(bias, x, w_kn)
    if how == "product":
        return torch.mm(x, w_kn).add_(bias)
    return torch.addmm(bias.expand(x.shape[0], w_kn.shape[1]), x, w_kn)


def _device_us(f: Callable[[], Any]) -> float:
    """The GPU's microseconds per call of ``f``, queued behind a sleep."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    for _ in range(RUNS):
        f()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / RUNS


def _choose(key: tuple[Any, ...], bias: Any, x: Any, w_kn: Any, gelu: str | None) -> str:
    """Times every candidate on these tensors (interleaved rounds, best of each) and keeps
    the fastest for ``key``."""
    import torch

    ways = candidates(gelu)
    with torch.no_grad():
        for how in ways:  # warm: cuBLAS's handles and workspaces, Triton's compilation
            _run(how, bias, x, w_kn, gelu)
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(ROUNDS):
            for how in ways:
                best[how] = min(best[how], _device_us(lambda how=how: _run(how, bias, x, w_kn, gelu)))
    fastest = min(best, key=best.__getitem__)
    choice = fastest if best[fastest] < MARGIN * best["epilogue"] else "epilogue"
    with _lock:
        _measured.setdefault(key, best)
        return _chosen.setdefault(key, choice)


def _addmm(bias: Any, x: Any, w_kn: Any, gelu: str | None = None) -> Any:
    """``bias + x @ w_kn`` for a 2-D ``x`` (then ``gelu(·, approximate=gelu)``, where given), by
    the candidate chosen for these shapes; the exported ops themselves off CUDA, for a bias
    that isn't one row, under autograd (the candidates write in place), or for a shape first
    seen in a capture (no timing can run there)."""
    import torch

    cuda = x.is_cuda and bias.dim() == 1 and x.dim() == 2 and w_kn.dim() == 2
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (bias, x, w_kn))
    if not cuda or recorded or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        y = torch.addmm(bias, x, w_kn)
        return y if gelu is None else torch.nn.functional.gelu(y, approximate=gelu)
    key = (tuple(x.shape), tuple(w_kn.shape), w_kn.stride(), x.dtype, bias.dtype, x.device, gelu)
    how = _chosen.get(key)
    if how is None:
        capturing = torch.cuda.is_current_stream_capturing()
        how = "epilogue" if capturing else _choose(key, bias, x, w_kn, gelu)
    return _run(how, bias, x, w_kn, gelu)


def _linear(x: Any, w: Any, bias: Any, gelu: str | None) -> Any:
    """``linear(x, w, bias)`` (then its GELU, where given), flattened to rows as torch's own
    ``linear`` does for a contiguous input."""
    import torch

    if not (x.is_cuda and x.dim() >= 2 and x.is_contiguous() and w.dim() == 2):
        y = torch.nn.functional.linear(x, w, bias)
        return y if gelu is None else torch.nn.functional.gelu(y, approximate=gelu)
    y = _addmm(bias, x.reshape(-1, x.shape[-1]), w.t(), gelu)
    return y.reshape(*x.shape[:-1], w.shape[0])


def linear_measured(x: Any, w: Any, bias: Any) -> Any:
    """``kwexport::linear_measured``: ``linear(x, w, bias)``."""
    return _linear(x, w, bias, None)


def addmm_measured(bias: Any, x: Any, w_kn: Any) -> Any:
    """``kwexport::linear_measured.addmm``: ``addmm(bias, x, w_kn)``."""
    return _addmm(bias, x, w_kn)


def linear_measured_gelu(x: Any, w: Any, bias: Any, approximate: str) -> Any:
    """``kwexport::linear_measured.gelu``: ``gelu(linear(x, w, bias), approximate)``."""
    return _linear(x, w, bias, approximate)


def addmm_measured_gelu(bias: Any, x: Any, w_kn: Any, approximate: str) -> Any:
    """``kwexport::linear_measured.addmm_gelu``: ``gelu(addmm(bias, x, w_kn), approximate)``."""
    return _addmm(bias, x, w_kn, approximate)


def chosen() -> dict[tuple[Any, ...], str]:
    """The choices made so far in this process, by (input shape, ``[k, n]`` weight shape, its
    strides, dtype, bias dtype, device, GELU's form or ``None``)."""
    with _lock:
        return dict(_chosen)


def measured() -> dict[tuple[Any, ...], dict[str, float]]:
    """The device µs each candidate took, for the same keys as :func:`chosen`."""
    with _lock:
        return {k: dict(v) for k, v in _measured.items()}
