"""CUDA graphs for a loaded program (``kwexport.load(..., device="cuda", cuda_graphs=True)``).

A small-batch GPU call is launch-bound: the runtime launches every node, each costing a few
microseconds of host work, while each kernel takes less. A captured CUDA graph launches them
all at once. The runtime (``kwexport._rt``) hands :class:`GraphCache` each checked call's leaves;
it answers with the call's outputs, or ``None`` where the call runs as usual: a signature seen
fewer than ``warmup`` times, or a method that can't be captured (``why_not`` says why).

One cache per program: its graphs share one memory pool, so calls of the program replay one at
a time (a lock, and an event that orders the next call's stream after the last replay).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# Ops that read a tensor's value on the host: a synchronization a capture can't hold. Calls
# of a method that has one run as usual, without trying. Anything else that syncs (a `cond`
# on a tensor, an index by a boolean mask) fails its capture, and the method runs as usual
# from then on.
SYNCING_OPS = frozenset(
    {
        "aten::_local_scalar_dense.default",
        "aten::item.default",
        "aten::nonzero.default",
        "aten::masked_select.default",
        "aten::unique_consecutive.default",
        "aten::_unique2.default",
        "aten::unique_dim.default",
        "higher_order::while_loop",
    }
)


def why_not(ops: Iterable[str]) -> str | None:
    """Why calls of a method with these ops (``"aten::nonzero.default"``) can't be captured,
    as far as its ops tell; ``None`` where nothing says so."""
    syncing = sorted(SYNCING_OPS.intersection(ops))
    return f"{syncing[0]} reads a tensor's value on the host" if syncing else None


@dataclass(frozen=True)
class CudaGraphs:
    """How a CUDA program captures its calls: ``kwexport.load(path, device="cuda",
    cuda_graphs=kwexport.CudaGraphs(...))``; ``cuda_graphs=True`` takes the defaults.

    ``max_graphs``: graphs kept per program, one per input signature (each tensor's shape and
    dtype, each other input's value); the least recently used is dropped past it.
    ``warmup``: calls of a signature that run as usual in a thread before that thread
    captures it, so that lazy initialization (cuBLAS and cuDNN handles, per thread) happens
    outside a capture and a shape seen once (a prompt's prefill) costs no capture. At least 1.
    ``reuse_outputs``: hand out the graph's own output tensors, which the program's next call
    overwrites, instead of copies of them (saves a copy per output).
    """

    max_graphs: int = 16
    warmup: int = 1
    reuse_outputs: bool = False

    def __post_init__(self) -> None:
        for name, least in (("max_graphs", 1), ("warmup", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < least:
                raise ValueError(f"CudaGraphs.{name} must be an int of at least {least}, not {value!r}")
        if type(self.reuse_outputs) is not bool:
            raise ValueError(f"CudaGraphs.reuse_outputs must be a bool, not {self.reuse_outputs!r}")


def options(cuda_graphs: bool | CudaGraphs) -> tuple[int, int, bool] | None:
    """``kwexport.load``'s ``cuda_graphs`` as the runtime takes it: ``None`` for off."""
    if cuda_graphs is False:
        return None
    if cuda_graphs is True:
        cuda_graphs = CudaGraphs()
    if not isinstance(cuda_graphs, CudaGraphs):
        raise TypeError(f"cuda_graphs must be a bool or a kwexport.CudaGraphs, not {type(cuda_graphs).__name__}")
    return (cuda_graphs.max_graphs, cuda_graphs.warmup, cuda_graphs.reuse_outputs)


class _Method:
    """What the cache knows of one method."""

    __slots__ = ("mutated_inputs", "why_not", "captures")

    def __init__(self, mutated_inputs: list[int], why_not: str | None) -> None:
        self.mutated_inputs = mutated_inputs
        self.why_not = why_not
        self.captures = 0


class _Graph:
    """One captured call: the graph, the inputs it reads and the outputs it writes."""

    __slots__ = ("graph", "inputs", "outputs")

    def __init__(self, graph: Any, inputs: list[Any], outputs: list[Any]) -> None:
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs


class GraphCache:
    """A program's captured graphs, by method and input signature (made by the runtime at
    load; ``register`` once per method, then called with each checked call's leaves)."""

    def __init__(self, max_graphs: int, warmup: int, reuse_outputs: bool, device: str) -> None:
        import torch

        self._max_graphs = max_graphs
        self._warmup = warmup
        self._reuse_outputs = reuse_outputs
        self._device = torch.device(device)
        self._methods: dict[str, _Method] = {}
        self._graphs: OrderedDict[tuple[Any, ...], _Graph] = OrderedDict()
        # Per thread, the signatures on their way to a capture and the calls seen: a capture
        # happens in a thread that has run the call, so that its cuBLAS and cuDNN handles
        # (per thread, and created with calls a capture can't hold) exist.
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pool: Any = None
        self._stream: Any = None
        # Recorded after each replay's last copy: the next call's stream waits on it before
        # it writes the inputs the graphs read.
        self._done: Any = None

    def register(self, name: str, mutated_inputs: list[int], ops: list[str]) -> None:
        self._methods[name] = _Method(mutated_inputs, why_not(ops))

    def describe(self, name: str) -> dict[str, Any]:
        """``Program.dispatch``'s ``cuda_graphs`` entry for a method."""
        m = self._methods[name]
        with self._lock:
            held = sum(1 for key in self._graphs if key[0] == name)
        return {"graphs": held, "captures": m.captures, "why_not": m.why_not}

    def __call__(self, name: str, run: Callable[[list[Any]], list[Any]], leaves: list[Any]) -> list[Any] | None:
        import torch

        m = self._methods[name]
        if m.why_not is not None or torch.cuda.is_current_stream_capturing():
            return None
        key = self._signature(name, leaves)
        if key is None:
            return None
        with self._lock:
            entry = self._graphs.get(key)
            if entry is None:
                seen = getattr(self._local, "seen", None)
                if seen is None:
                    seen = self._local.seen = OrderedDict()
                calls = seen.pop(key, 0)
                if calls < self._warmup:
                    seen[key] = calls + 1
                    while len(seen) > 4 * self._max_graphs:
                        seen.popitem(last=False)
                    return None
                entry = self._capture(m, key, run, leaves)
                if entry is None:
                    return None
            else:
                self._graphs.move_to_end(key)
            return self._replay(m, entry, leaves)

    def _signature(self, name: str, leaves: list[Any]) -> tuple[Any, ...] | None:
        """The call's key: each tensor's shape and dtype, each other leaf's type and value;
        ``None`` where the call must not replay (a tensor that records autograd, or a
        subclass, or a value that can't be a key)."""
        import torch

        key: list[Any] = [name]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if type(leaf) is not torch.Tensor or leaf.requires_grad:
                    return None
                key.append((leaf.shape, leaf.dtype))
            else:
                key.append((type(leaf), leaf))
        try:
            hash(tuple(key))
        except TypeError:
            return None
        return tuple(key)

    def _capture(
        self, m: _Method, key: tuple[Any, ...], run: Callable[[list[Any]], list[Any]], leaves: list[Any]
    ) -> _Graph | None:
        """Captures `run` on copies of `leaves` (which it computes nothing for: the replay
        that follows does). On failure the method is marked and runs as usual from then on."""
        import torch

        current = torch.cuda.current_stream(self._device)
        if self._done is not None:
            current.wait_event(self._done)
        inputs = [
            torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device) if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves
        ]
        for s, leaf in zip(inputs, leaves):
            if isinstance(leaf, torch.Tensor):
                s.copy_(leaf)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self._device)
        graph = torch.cuda.CUDAGraph()
        error: BaseException | None = None
        # Captured on a stream of its own (a capture may not run on the default stream), with
        # the capture ended and the caller's stream restored whatever the call raised.
        self._stream.wait_stream(current)
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                outputs = run(inputs)
            except BaseException as e:  # noqa: BLE001 - any failure means: run as usual
                error = e
            try:
                graph.capture_end()
            except Exception as e:  # noqa: BLE001
                error = error or e
        current.wait_stream(self._stream)
        if error is not None:
            # A capture that ended in an error leaves the device's default generator in
            # capture mode (torch runs its epilogue only after a good capture): put a copy of
            # its state, which is not capturing, in its place.
            generator = torch.cuda.default_generators[self._device.index or 0]
            generator.graphsafe_set_state(generator.clone_state())
            if not isinstance(error, Exception):
                raise error  # KeyboardInterrupt and the like, once the capture is undone
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            m.why_not = f"capturing a call failed: {first}"
            return None
        elsewhere = next((o.device for o in outputs if isinstance(o, torch.Tensor) and o.device != self._device), None)
        if elsewhere is not None:
            m.why_not = f"an output is on {elsewhere}, which a CUDA graph doesn't compute"
            return None
        m.captures += 1
        entry = _Graph(graph, inputs, outputs)
        self._graphs[key] = entry
        while len(self._graphs) > self._max_graphs:
            self._graphs.popitem(last=False)
        return entry

    def _replay(self, m: _Method, entry: _Graph, leaves: list[Any]) -> list[Any]:
        """Copies the call's tensors in, replays, and hands out the outputs (copies unless
        `reuse_outputs`) after writing back the inputs the graph mutates."""
        import torch

        current = torch.cuda.current_stream(self._device)
        if self._done is not None:
            current.wait_event(self._done)
        for s, leaf in zip(entry.inputs, leaves):
            if isinstance(leaf, torch.Tensor):
                s.copy_(leaf)
        entry.graph.replay()
        for i in m.mutated_inputs:
            leaves[i].copy_(entry.inputs[i])
        outputs = entry.outputs
        if not self._reuse_outputs:
            outputs = [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs]
        if self._done is None:
            self._done = torch.cuda.Event()
        self._done.record(current)
        return outputs
