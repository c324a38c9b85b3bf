"""Serving a saved kwexport program on Ray Serve.

    python examples/ray_serve.py MODEL.kwx [--replicas 2] [--port 8000]

Each replica loads the same file: the weights are mapped, so every replica on a node shares
one copy of them in the page cache, and a replica starts in milliseconds. A request is a JSON
object of keyword arguments, e.g. `{"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]}`;
nested lists become tensors of the dtype the program expects for that input. The response
is the output as JSON (tensors as nested lists, ModelOutputs and dicts as objects).

A request that can't be turned into a call of the saved signature (a missing or unknown
argument, a wrong shape or dtype, a body that isn't JSON) gets a 4xx with kwexport's message
naming the argument; the replica stays up.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

import kwexport
from kwexport._rt import describe

_SUBSCRIPT = re.compile(r"\[('(?:[^'\\]|\\.)*'|\d+)\]")


def leaf_dtypes(path: str, method: str = "forward") -> dict[str, torch.dtype]:
    """The dtype of each tensor input of a method, by its argument path as kwexport names it
    (`input_ids`, `cfg['shift'][0]`)."""
    leaves = json.loads(describe(path)["description"])["methods"][method]["inputs"]
    return {leaf["path"]: getattr(torch, leaf["dtype"]) for leaf in leaves if leaf["kind"] == "tensor"}


def inputs_from_json(value: Any, path: str, dtypes: dict[str, torch.dtype]) -> Any:
    """A JSON value as the program's input at `path`: a tensor where it takes one, else the
    value itself (dicts and lists of inputs are walked)."""
    if path in dtypes:
        return torch.tensor(value, dtype=dtypes[path])
    if isinstance(value, dict):
        return {k: inputs_from_json(v, f"{path}[{k!r}]", dtypes) for k, v in value.items()}
    if isinstance(value, list):
        return [inputs_from_json(v, f"{path}[{i}]", dtypes) for i, v in enumerate(value)]
    return value


def outputs_to_json(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.tolist()
    if hasattr(out, "keys"):  # dicts, ModelOutputs, kwexport.StandIn
        return {k: outputs_to_json(out[k]) for k in out.keys()}
    if isinstance(out, (list, tuple)):
        return [outputs_to_json(v) for v in out]
    return out


@serve.deployment
class KwexportModel:
    def __init__(self, path: str, threads: int = 1):
        torch.set_num_threads(threads)
        self.program = kwexport.load(path)
        self.dtypes = leaf_dtypes(path)

    async def __call__(self, request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "the body must be a JSON object of keyword arguments"}, status_code=400)
        try:
            kwargs = {k: inputs_from_json(v, k, self.dtypes) for k, v in body.items()}
        except (TypeError, ValueError, RuntimeError) as e:  # ragged lists, bools for floats, ...
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=400)
        try:
            with torch.inference_mode():
                out = self.program(**kwargs)
        except (kwexport.InputError, kwexport.SignatureError) as e:
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=422)
        return JSONResponse(outputs_to_json(out))


def app(path: str, replicas: int = 2, threads: int = 1) -> serve.Application:
    return KwexportModel.options(num_replicas=replicas).bind(path, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=8000)
    opts = parser.parse_args()
    serve.start(http_options={"host": "127.0.0.1", "port": opts.port})
    serve.run(app(opts.path, opts.replicas), route_prefix="/", blocking=True)


if __name__ == "__main__":
    main()
