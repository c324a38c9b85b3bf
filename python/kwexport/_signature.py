"""The signature and constants as the file records them: JSON, and back to Python.

Imports no torch: the command line uses it too.
"""

from __future__ import annotations

import inspect
import math
import sys
from typing import Any

from kwexport._rt import ArtifactError

_I64 = (-(2**63), 2**63 - 1)


# The weight a tensor default is saved as: a name no module attribute path can have.
DEFAULT_WEIGHT_PREFIX = "<default>."


def signature_json(name: str, sig: inspect.Signature, tensors: dict[str, Any] | None = None) -> dict[str, Any]:
    """The saved form of ``sig``; an unsaveable default fails here, before tracing. A tensor
    default goes into ``tensors`` (saved as a weight) where it is given."""
    params = []
    for p in sig.parameters.values():
        entry: dict[str, Any] = {"name": p.name, "kind": p.kind.name.lower()}
        if p.default is not inspect.Parameter.empty:
            if tensors is not None and _is_tensor(p.default):
                entry["default_weight"] = DEFAULT_WEIGHT_PREFIX + p.name
                tensors[entry["default_weight"]] = p.default
            else:
                entry["default"] = constant_json(p.default, f"default of parameter {p.name!r}")
        params.append(entry)
    return {"name": name, "params": params}


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # imported wherever a tensor exists
    return torch is not None and isinstance(x, torch.Tensor)


def signature_from_json(sig: dict[str, Any], tensors: dict[str, Any] | None = None) -> inspect.Signature:
    """The signature a header records; ``tensors`` holds its tensor defaults by weight name."""

    def default(p: dict[str, Any]) -> dict[str, Any]:
        if "default" in p:
            return {"default": constant_value(p["default"])}
        if "default_weight" in p:
            return {"default": (tensors or {}).get(p["default_weight"])}
        return {}

    return inspect.Signature(
        [
            inspect.Parameter(p["name"], getattr(inspect.Parameter, p["kind"].upper()), **default(p))
            for p in sig["params"]
        ]
    )


def constant_json(x: Any, where: str, allow_containers: bool = True) -> dict[str, Any]:
    """A Python value JSON can carry: None, bool, int (64-bit), float (inf and nan as
    strings), str, and tuples and lists of those."""
    if x is None:
        return {"none": None}
    if isinstance(x, bool):
        return {"bool": x}
    if isinstance(x, int):
        if not _I64[0] <= x <= _I64[1]:
            raise ArtifactError(f"{where}: integer {x} does not fit in 64 bits")
        return {"int": x}
    if isinstance(x, float):
        if math.isnan(x):
            return {"float": "nan"}
        if math.isinf(x):
            return {"float": "inf" if x > 0 else "-inf"}
        return {"float": x}
    if isinstance(x, str):
        return {"str": x}
    if allow_containers and type(x) in (tuple, list):
        return {type(x).__name__: [constant_json(i, where) for i in x]}
    raise ArtifactError(f"{where}: can't save a value of type {type(x).__name__} without pickle")


def constant_value(c: dict[str, Any]) -> Any:
    """The Python value of a JSON constant (the inverse of ``constant_json``)."""
    ((kind, v),) = c.items()
    if kind == "float" and isinstance(v, str):
        return float(v)
    if kind in ("tuple", "list"):
        items = [constant_value(i) for i in v]
        return tuple(items) if kind == "tuple" else items
    return v
