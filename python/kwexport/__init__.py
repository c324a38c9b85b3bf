"""kwexport: export a PyTorch function or module to one safe file, load it fast, and call
it exactly like the original.

    ex = kwexport.export(f, args, kwargs)
    kwexport.save(ex, "model.kwx")
    prog = kwexport.load("model.kwx")
    out = prog(*args, **kwargs)

Loading and calling live in the Rust extension (``kwexport._rt``). Exporting
(``kwexport._trace``, with ``_graph``, ``_signature`` and ``_weights``) imports torch.export
only when used; saving is ``kwexport._write``; the command line is ``kwexport._cli``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kwexport._rt import (
    FORMAT_VERSION,
    OLDEST_FORMAT_VERSION,
    ArtifactError,
    InputError,
    KwexportError,
    Method,
    Program,
    SignatureError,
    VersionError,
    kernel_info,
)
from kwexport._rt import load as _load
from kwexport._standin import StandIn

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from kwexport._cuda_graphs import CudaGraphs
    from kwexport._trace import Exported

__version__ = "0.1.0"

__all__ = [
    "ArtifactError",
    "CudaGraphs",
    "Exported",
    "FORMAT_VERSION",
    "InputError",
    "KwexportError",
    "Method",
    "OLDEST_FORMAT_VERSION",
    "Program",
    "SignatureError",
    "StandIn",
    "VersionError",
    "export",
    "kernel_info",
    "load",
    "quantize",
    "save",
]


def load(
    path: str | os.PathLike[str],
    *,
    allow_ops: Iterable[str] = (),
    dispatch: str = "auto",
    device: str | torch.device | None = None,
    mmap: bool = True,
    optimize: str = "exact",
    precision: str = "float32",
    cuda_graphs: bool | CudaGraphs = False,
) -> Program:
    """Load a kwexport file. Parses and validates everything before returning; never
    unpickles, evaluates or imports anything named in the file.

    Only ops of torch's built-in namespaces (aten, prims) load by default; ``allow_ops``
    admits custom ones, e.g. ``["mylib::*"]`` or ``["mylib::scale.default"]``, which must
    already be registered (kwexport never loads libraries for a file).

    ``dispatch="auto"`` runs each node through torch's stable C ABI where it covers the
    node and saves more than converting values around it costs (no Python; long stretches
    release the GIL), and through torch's Python op objects otherwise; ``"abi"`` uses the
    C ABI for every node it covers; ``"python"`` uses the Python op objects throughout.
    Results are identical; ``Program.dispatch`` counts the nodes on each path and says
    why each op that stays on Python does.

    ``device`` places the program (``"cuda:1"``, ``torch.device("meta")``, ...); by default it
    runs where it was exported. Its weights are moved there once (on the CPU they stay views
    of the mapped file), device literals in the graph (``arange(..., device=...)``, ``to``)
    follow it, and calls must pass their tensors on it.

    ``mmap=False`` reads the file into memory instead of mapping it: for files that may be
    changed in place or truncated while the program runs, or that live on network
    filesystems. A mapped file must only be replaced by rename (as ``kwexport.save`` does).

    ``optimize="exact"`` runs the graph as exported, bitwise as eager does. ``"fast"`` lets
    kwexport change kernels and layouts for speed, within the tolerance ``docs/optimize.md``
    states per pass (convolution weights are held channels-last).

    ``precision="bf16"`` runs the matrix products and convolutions that read float32 weights
    in bfloat16, on torch's kernels (oneDNN's; fast where the CPU has AVX512-BF16 or AMX),
    with weights cast once at load and everything else in float32, as torch's CPU autocast
    does; it implies ``optimize="fast"``. The file's weights stay float32.

    ``cuda_graphs=True`` (a CUDA ``device`` only) captures each method's calls in a CUDA graph,
    once per input signature (shapes, dtypes, non-tensor values) after a first call that runs
    as usual, and replays it: one launch instead of one per node. Inputs are copied into the
    graph's buffers and outputs handed out as copies; the state is updated in place.
    ``kwexport.CudaGraphs(max_graphs=, warmup=, reuse_outputs=)`` sets how many graphs a
    program keeps (least recently used dropped), the calls before a capture, and whether
    outputs are the graph's own buffers (valid until the program's next call). A method that
    can't be captured (it reads a tensor's value on the host, say) runs as usual;
    ``Program.dispatch["cuda_graphs"]`` says why.
    """
    graphs = None
    if cuda_graphs is not False:
        from kwexport._cuda_graphs import options

        graphs = options(cuda_graphs)
    return _load(
        os.fspath(path),
        allow_ops=list(allow_ops),
        dispatch=dispatch,
        device=device,
        mmap=mmap,
        optimize=optimize,
        precision=precision,
        cuda_graphs=graphs,
    )


def export(
    f: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    dynamic: bool = False,
) -> Exported:
    """Trace ``f`` (an ``nn.Module`` or a function) with torch.export, keeping its signature.

    ``dynamic_shapes`` is torch.export's, by parameter name or in parameter order; the names
    of its ``Dim``s name the dimensions in errors and ``kwexport inspect``. ``dynamic=True``
    makes every dimension of every tensor input dynamic (torch's ``Dim.AUTO``: torch keeps
    static what the model needs static): export once, call with any batch and length.
    """
    from kwexport._trace import export as _export

    return _export(f, args, kwargs, dynamic_shapes=dynamic_shapes, dynamic=dynamic)


def quantize(
    f: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    calibration: list[tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
    activations: str = "static",
    reduce_range: bool = False,
    dynamic_shapes: Any = None,
    dynamic: bool = False,
) -> Exported:
    """Trace ``f`` as :func:`export` does, then quantize it to int8 with torch's pt2e flow
    (torchao's x86 quantizer: per-channel int8 weights, int8 activations), keeping its
    signature; ``kwexport.save`` writes it like any program, and ``kwexport.load`` runs it
    without torchao.

    ``activations="static"`` (the default) takes the activations' scales from calling the
    prepared program on ``(args, kwargs)`` and on each ``(args, kwargs)`` of ``calibration``
    (give inputs like the ones it will serve); ``"dynamic"`` computes them from each call's
    values instead (transformers' linears). ``reduce_range=True`` quantizes activations to
    128 levels instead of 256 (the x86 quantizer's option of that name): on a CPU without VNNI
    the int8 kernels then multiply bytes exactly with ``vpmaddubsw``, 1.2–1.25× faster, for
    one bit less of each activation. ``dynamic_shapes`` and ``dynamic`` are
    :func:`export`'s, for the inputs' shapes. Needs torchao (``kwexport[quantize]``).
    """
    from kwexport._quantize import quantize as _quantize

    return _quantize(
        f,
        args,
        kwargs,
        calibration=calibration,
        activations=activations,
        reduce_range=reduce_range,
        dynamic_shapes=dynamic_shapes,
        dynamic=dynamic,
    )


def save(
    ex: Exported | Any | dict[str, Exported | Any],
    path: str | os.PathLike[str],
    *,
    extra_files: dict[str, str | bytes] | None = None,
    optimize: str = "exact",
) -> None:
    """Write ``ex`` (``kwexport.export``'s result, or a ``torch.export.ExportedProgram``) to
    ``path`` as one file, atomically.

    A dict of them by name saves one file of several methods (``{"encode": a, "decode":
    b}``; names are identifiers not starting with ``_``): ``kwexport.load(path).encode(...)``,
    ``prog["decode"](...)``. Their weights are stored once: a tensor several methods read
    (the same memory, as methods of one module share their parameters) is one weight, and a
    buffer one method writes is state that every method reading it sees.

    ``optimize="fast"`` writes the graphs rewritten as ``kwexport.load(..., optimize="fast")``
    rewrites them (docs/optimize.md), with convolution weights stored channels-last: a plain
    ``kwexport.load`` of the file then runs at ``fast`` and loads as quickly as any file."""
    from kwexport._write import save as _save

    _save(ex, path, extra_files=extra_files, optimize=optimize)


def __getattr__(name: str) -> Any:
    if name == "Exported":
        from kwexport._trace import Exported

        return Exported
    if name == "CudaGraphs":
        from kwexport._cuda_graphs import CudaGraphs

        return CudaGraphs
    raise AttributeError(f"module 'kwexport' has no attribute {name!r}")
