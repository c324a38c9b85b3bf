"""kwexport on a GPU beside eager and torch.export, on the same workloads, in one run.

    python benches/gpu.py [--device cuda] [--out FILE]

Exports each workload on the CPU, loads it with `kwexport.load(path, device=...)` and times
calls (CUDA-synchronized), interleaved with eager on the device and `ep.module()` moved there.
Prints a markdown table with the machine and versions.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import workloads  # noqa: E402

import kwexport  # noqa: E402


def timed(f, sync, n=50, rounds=5):
    best = float("inf")
    for _ in range(3):
        f()
    sync()
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            f()
        sync()
        best = min(best, (time.perf_counter() - t) / n)
    return best


class _Wrap(torch.nn.Module):
    """A function as a module, for torch.export versions that take modules only."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, *args, **kwargs):
        return self.f(*args, **kwargs)


def move(tree, device):
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", nargs="*", default=None)
    opts = parser.parse_args()
    dev = torch.device(opts.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    tmp = tempfile.mkdtemp()
    for name in opts.only or ["two_op", "kwargs_mlp", "transformer", "convnet", "deep_mlp", "resnet18", "gpt2"]:
        try:
            f, args, kwargs = workloads.build(name)
        except ImportError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
        path = os.path.join(tmp, f"{name}.kwx")
        kwexport.save(kwexport.export(f, args, kwargs), path)
        module = f if isinstance(f, torch.nn.Module) else _Wrap(f)
        ep = torch.export.export(module, args, kwargs)
        t = time.perf_counter()
        prog = kwexport.load(path, device=dev)
        load_s = time.perf_counter() - t
        dargs, dkwargs = move(args, dev), move(kwargs, dev)
        f = f.to(dev) if isinstance(f, torch.nn.Module) else f
        epm = ep.module().to(dev)
        with torch.no_grad():
            calls = {"eager": f, "kwexport": prog, "torch.export": epm}
            got = {}
            for k, c in calls.items():
                try:
                    got[k] = timed(lambda c=c: c(*dargs, **dkwargs), sync)  # noqa: B023
                except RuntimeError as e:  # torch.export's module can't run some CPU exports on CUDA
                    got[k] = None
                    print(f"{name}: {k} fails on {dev}: {str(e).splitlines()[0]}", file=sys.stderr)
        d = prog.dispatch
        rows.append((name, d["stable_abi"], d["stable_abi"] + d["python"], load_s, got))
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    lines = [
        f"Device: {gpu}; torch {torch.__version__}; Python {platform.python_version()}; "
        f"batch sizes as in the CPU tables; times are the best of five rounds of 50 synchronized calls.",
        "",
        "| workload | nodes on C ABI | load on the device | eager | kwexport | torch.export | kwexport / eager | kwexport / torch.export |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def us(t):
        return "fails" if t is None else f"{t * 1e6:.1f} µs"

    def ratio(a, b):
        return "n/a" if a is None or b is None else f"{a / b:.2f}"

    for name, n_c, n, load_s, got in rows:
        e, k, te = got["eager"], got["kwexport"], got["torch.export"]
        lines.append(
            f"| {name} | {n_c} of {n} | {load_s * 1e3:.1f} ms | {us(e)} | {us(k)} | {us(te)} | "
            f"{ratio(k, e)} | {ratio(k, te)} |"
        )
    text = "\n".join(lines)
    print(text)
    if opts.out:
        with open(opts.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
