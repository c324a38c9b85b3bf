"""Writes golden artifacts for the current format version into tests/golden/<major.minor>/.

Run once per released format version, with the kwexport that writes it, and commit the
output: `python tests/golden/make_golden.py`. Existing versions are never rewritten.
Each case is `<name>.kwx` plus `<name>.json` holding calls and their expected outputs,
encoded without pickle (see `tensor_codec.py`).
"""

import collections
import json
import pathlib
import sys

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from golden_types import Pair  # noqa: E402
from tensor_codec import encode  # noqa: E402

import kwexport  # noqa: E402


def nested_kwargs(x, y, *, cfg, scale=2.0, **extra):
    return {"out": x * scale + cfg["shift"][0] - extra["bias"], "pair": (y.sum(-1), x.shape[0])}


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.norm = nn.LayerNorm(8)

    def forward(self, x, *, mask=None):
        h = torch.relu(self.norm(self.fc1(x)))
        return self.fc2(h) if mask is None else self.fc2(h) * mask


def dynamic(x, y):
    return torch.cat([x, y], dim=0).softmax(-1)


def containers(pair, *, table):
    return {"pair": Pair(left=pair.left * table["w"][0], right=pair.right), "total": pair.left.sum()}


def branches(x, *, limit=0.0):
    with torch.no_grad():
        scale = x.abs().mean()
    return torch.cond(x.sum() > limit, lambda x, s: x.sin() * s, lambda x, s: x.cos() - s, (x, scale))


def tensor_default(x, y=torch.arange(3.0)):  # noqa: B008 - the default under test
    return x * y


class Accumulator(nn.Module):
    """Two methods over one set of weights and one buffer of state."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        return self.proj(x).relu()

    def accumulate(self, h, *, scale=1.0):
        self.total.add_(h.sum(0) * scale)
        return self.proj(self.total)


class NormedConv(nn.Module):
    """A conv and an RMS norm: the golden file of a graph written at `fast`."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.weight = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        h = self.conv(x).mean((2, 3))
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def fast_cases():
    """(name, module, args) saved with optimize="fast"; their calls match eager within 1e-5."""
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    yield "fast_norm_conv", NormedConv().eval(), (torch.randn(2, 3, 8, 8, generator=g),)


def method_cases():
    """(name, module, {method: (args, kwargs)} to export, [(method, args, kwargs)] to call in order)."""
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    torch.manual_seed(1)
    acc = Accumulator().eval()
    yield (
        "methods",
        acc,
        {"forward": ((r(2, 3),), {}), "accumulate": ((r(2, 3),), {"scale": 2.0})},
        [
            ("forward", (r(2, 3),), {}),
            ("accumulate", (r(2, 3),), {"scale": 2.0}),
            ("accumulate", (r(2, 3),), {"scale": 2.0}),
        ],
    )


def cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    torch.manual_seed(0)
    mlp = TinyMLP().eval()
    d = torch.export.Dim("d", min=2, max=16)
    yield (
        "nested_kwargs",
        nested_kwargs,
        (r(2, 3), r(2, 4)),
        {"cfg": {"shift": [r(3)]}, "bias": r(3)},
        None,
        [
            ((r(2, 3), r(2, 4)), {"bias": r(3), "cfg": {"shift": [r(3)]}}),
        ],
    )
    yield "tiny_mlp", mlp, (r(4, 6),), {"mask": r(3)}, None, [((r(4, 6),), {"mask": r(3)})]
    yield (
        "dynamic",
        dynamic,
        (r(3, 5), r(3, 5)),
        {},
        {"x": {0: d}, "y": {0: d}},
        [
            ((r(2, 5), r(2, 5)), {}),
            ((r(9, 5), r(9, 5)), {}),
        ],
    )
    yield "branches", branches, (r(3, 4),), {}, None, [((r(3, 4),), {}), ((-r(3, 4).abs(),), {})]
    torch.manual_seed(0)
    bn = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).train()
    yield "bn_state", bn, (r(4, 3),), {}, None, [((r(4, 3),), {}), ((r(4, 3) * 2,), {})]
    yield "tensor_default", tensor_default, (r(2, 3),), {}, None, [((r(2, 3),), {}), ((r(2, 3),), {"y": r(3)})]
    table = lambda: collections.defaultdict(list, {"w": [r(3)]})  # noqa: E731
    yield (
        "containers",
        containers,
        (Pair(r(3), r(3)),),
        {"table": table()},
        None,
        [((Pair(r(3), r(3)),), {"table": table()})],
    )


def main():
    major, minor = kwexport.FORMAT_VERSION
    out = pathlib.Path(__file__).parent / f"{major}.{minor}"
    if out.exists():
        sys.exit(f"{out} exists: golden files of a released version are never rewritten")
    out.mkdir()
    for name, f, args, kwargs, dyn, calls in cases():
        kwexport.save(
            kwexport.export(f, args, kwargs, dynamic_shapes=dyn),
            out / f"{name}.kwx",
            extra_files={"golden.txt": f"{name} at format {major}.{minor}"},
        )
        with torch.no_grad():
            record = [{"args": encode(a), "kwargs": encode(k), "expected": encode(f(*a, **k))} for a, k in calls]
        (out / f"{name}.json").write_text(json.dumps({"calls": record}, indent=1) + "\n")
        print("wrote", out / name)
    for name, module, args in fast_cases():
        kwexport.save(
            kwexport.export(module, args),
            out / f"{name}.kwx",
            extra_files={"golden.txt": f"{name} at format {major}.{minor}"},
            optimize="fast",
        )
        with torch.no_grad():
            record = [{"args": encode(args), "kwargs": encode({}), "expected": encode(module(*args)), "rtol": 1e-5}]
        (out / f"{name}.json").write_text(json.dumps({"calls": record}, indent=1) + "\n")
        print("wrote", out / name)
    for name, module, exports, calls in method_cases():
        state = {k: v.clone() for k, v in module.state_dict().items()}
        methods = {m: kwexport.export(getattr(module, m), a, k) for m, (a, k) in exports.items()}
        module.load_state_dict(state)  # the export's traces ran on it
        kwexport.save(methods, out / f"{name}.kwx", extra_files={"golden.txt": f"{name} at format {major}.{minor}"})
        with torch.no_grad():
            record = [
                {"method": m, "args": encode(a), "kwargs": encode(k), "expected": encode(getattr(module, m)(*a, **k))}
                for m, a, k in calls
            ]
        (out / f"{name}.json").write_text(json.dumps({"calls": record}, indent=1) + "\n")
        print("wrote", out / name)


if __name__ == "__main__":
    main()
