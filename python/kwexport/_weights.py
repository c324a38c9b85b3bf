"""Weights: each distinct storage once, every tensor as a view of one (shape, strides,
offset), so tied and sliced weights stay shared in the file and when mapped back."""

from __future__ import annotations

import sys
from typing import Any

import torch

from kwexport._graph import DTYPE_NAMES
from kwexport._rt import ArtifactError


def check_weight(name: str, weight: Any) -> None:
    """Raises ``ArtifactError`` unless ``weight`` is a tensor the format can hold."""
    where = f"weight {name!r}"
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):
        raise ArtifactError(f"{where}: tensor subclass {type(weight).__name__} can't be saved")
    if weight.layout != torch.strided or weight.is_quantized or weight.dtype not in DTYPE_NAMES:
        raise ArtifactError(f"{where}: unsupported tensor ({weight.layout}, {weight.dtype})")


def identity(t: torch.Tensor) -> tuple:
    """What makes two weights one: the same memory viewed the same way."""
    st = t.untyped_storage()
    return (st.data_ptr(), str(t.device), t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def weight_tables(
    weights: dict[str, torch.Tensor], mutable: set[str] = frozenset()
) -> tuple[list[dict[str, Any]], dict[str, Any], list[torch.Tensor]]:
    """The ``storages`` and ``tensors`` tables (storage offsets left for ``save`` to fill
    in) and the storages' bytes, as uint8 CPU tensors. ``mutable`` names the weights the
    program writes: they are marked so, and loading gives each its own memory."""
    if sys.byteorder != "little":
        raise ArtifactError("kwexport writes little-endian weights; saving on a big-endian machine is not supported")
    storage_table: list[dict[str, Any]] = []
    storages: list[torch.Tensor] = []
    by_storage: dict[Any, int] = {}
    tensors = {}
    for name, weight in weights.items():
        check_weight(name, weight)
        t = weight.detach()
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device), st.nbytes()) if st.nbytes() else ("empty", name)
        if key not in by_storage:
            data = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,)).cpu()
            by_storage[key] = len(storages)
            storages.append(data)
            storage_table.append({"offset": None, "nbytes": st.nbytes()})
        tensors[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "strides": list(t.stride()),
            "storage": by_storage[key],
            "storage_offset": t.storage_offset(),
        }
        if name in mutable:
            tensors[name]["mutable"] = True
    return storage_table, tensors, storages
