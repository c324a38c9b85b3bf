"""Where a GPU call's time goes: the CUDA kernels of kwexport (`fast`, launched node by node)
beside those of `torch.compile` (default mode, the same kernels reduce-overhead replays), per
call, from torch's profiler.

    python benches/gpu_profile.py [--models bert,gpt2] [--dtype float32] [--graphs] [--top N] [--out FILE]

`--graphs` loads with CUDA graphs' passes (`fast` with `cuda_graphs`) but never captures (a
warm-up longer than the profile), so the kernels a replay would run show one by one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu  # noqa: E402

import kwexport  # noqa: E402


def kernels(f, calls=5):
    """(kernel name, CUDA µs per call, launches per call), most time first."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            f()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((e.key, us / calls, e.count / calls))
    return sorted(rows, key=lambda r: -r[1])


def profile(name, dtype, graphs=False, top=14):
    """The report's lines for one model at batch 1."""
    f, args, kwargs = gpu.build(name, 1, dtype)
    with torch.no_grad():
        ex = kwexport.export(f, args, kwargs)
    path = os.path.join(tempfile.mkdtemp(), "m.kwx")
    kwexport.save(ex, path)
    dargs, dkwargs = gpu.move(args, "cuda"), gpu.move(kwargs, "cuda")
    model = f.to("cuda")
    options = {"cuda_graphs": kwexport.CudaGraphs(warmup=10**6)} if graphs else {}
    prog = kwexport.load(path, device="cuda", optimize="fast", **options)
    compiled = torch.compile(model)
    with torch.no_grad():
        runs = {
            f"kwexport fast{' (graphs passes)' if graphs else ''}": kernels(lambda: prog(*dargs, **dkwargs)),
            "compile default": kernels(lambda: compiled(*dargs, **dkwargs)),
        }
    lines = []
    for label, rows in runs.items():
        total, launches = sum(r[1] for r in rows), sum(r[2] for r in rows)
        lines.append(f"## {name} {str(dtype)[6:]} batch 1, {label}: {total:.0f} µs of kernels, {launches:.0f} launches")
        for key, us, n in rows[:top]:
            lines.append(f"{us:8.1f} µs {n:5.0f}x  {key[:150]}")
        lines.append("")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--graphs", action="store_true", help="with CUDA graphs' passes, uncaptured")
    parser.add_argument("--top", type=int, default=14, help="kernels listed per run")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    dtype = getattr(torch, opts.dtype)
    lines = []
    for name in opts.models.split(","):
        new = profile(name, dtype, graphs=opts.graphs, top=opts.top)
        lines += new
        print("\n".join(new), flush=True)
    if opts.out:
        with open(opts.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
