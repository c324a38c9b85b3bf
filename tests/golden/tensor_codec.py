"""Nested Python values with tensors, to and from JSON, without pickle."""

import base64
import dataclasses

import torch


def encode(v):
    if isinstance(v, torch.Tensor):
        t = v.detach().contiguous().cpu()
        return {
            "tensor": {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "data": base64.b64encode(t.numpy().tobytes()).decode(),
            }
        }
    if isinstance(v, dict):
        return {"dict": [[k, encode(x)] for k, x in v.items()]}
    if dataclasses.is_dataclass(v):
        items = [[f.name, encode(getattr(v, f.name))] for f in dataclasses.fields(v)]
        return {"record": {"class": f"{type(v).__module__}.{type(v).__qualname__}", "items": items}}
    if isinstance(v, (tuple, list)):
        return {type(v).__name__: [encode(x) for x in v]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return {"value": v}
    raise TypeError(f"can't encode {type(v).__name__}")


def decode(v):
    ((kind, x),) = v.items()
    if kind == "tensor":
        dtype = getattr(torch, x["dtype"])
        raw = bytearray(base64.b64decode(x["data"]))
        return (
            torch.frombuffer(raw, dtype=dtype).reshape(x["shape"]).clone()
            if raw
            else torch.empty(x["shape"], dtype=dtype)
        )
    if kind == "dict":
        return {k: decode(i) for k, i in x}
    if kind == "record":  # what kwexport gives back for a class it doesn't import
        from kwexport import StandIn

        items = [(k, decode(i)) for k, i in x["items"]]
        return StandIn(x["class"], tuple(k for k, _ in items), tuple(v for _, v in items))
    if kind in ("tuple", "list"):
        items = [decode(i) for i in x]
        return tuple(items) if kind == "tuple" else items
    return x
