"""kwexport beside torch.export and TorchScript, on the same workloads, in one run.

    python benches/compare.py [--quick] [--out BENCHMARKS.md]

For each workload: load in a fresh process (after `import torch`, until the first call
returns), warm load, call time, the call path's overhead above the floor (the same plan run
on flat inputs with no checks and no pytree work), and RSS growth on load. Ratios are
torch.export / kwexport: above 1 means kwexport is faster. One thread throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import workloads  # noqa: E402

import kwexport  # noqa: E402


def median_time(f, n, warmup=20):
    for _ in range(warmup):
        f()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


COLD = textwrap.dedent("""
    import sys, time, json, os
    import torch
    torch.set_num_threads(1)
    kind, path = sys.argv[1], sys.argv[2]
    args, kwargs = torch.load(path + ".inputs", weights_only=True)
    rss0 = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    t = time.perf_counter()
    if kind == "kwexport":
        import kwexport
        f = kwexport.load(path)
    elif kind == "torch.export":
        f = torch.export.load(path).module()
    else:
        f = torch.jit.load(path)
    loaded = time.perf_counter()
    with torch.no_grad():
        f(*args, **kwargs)
    done = time.perf_counter()
    rss1 = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print(json.dumps({"cold": done - t, "load_only": loaded - t, "rss": rss1 - rss0}))
""")


def cold(kind, path, repeats):
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", COLD, kind, path], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{kind} cold run failed: {out.stderr[-2000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


class _Fn(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, *args, **kwargs):
        return self.f(*args, **kwargs)


def bench(name, tmp, quick):
    f, args, kwargs = workloads.build(name)
    mod = f if isinstance(f, torch.nn.Module) else _Fn(f)
    n_calls = {"deep_mlp": 50, "transformer": 50, "convnet": 50}.get(name, 2000)
    n_loads = 5 if name in ("deep_mlp", "transformer") else 20
    if quick:
        n_calls, n_loads = max(10, n_calls // 10), 3
    row = {"workload": name}

    kw_path = os.path.join(tmp, f"{name}.kwx")
    te_path = os.path.join(tmp, f"{name}.pt2")
    js_path = os.path.join(tmp, f"{name}.ts")
    ex = kwexport.export(f, args, kwargs)
    kwexport.save(ex, kw_path)
    ep = torch.export.export(mod, args, kwargs)
    torch.export.save(ep, te_path)
    try:
        with torch.no_grad():
            traced = torch.jit.trace(mod, args, example_kwarg_inputs=kwargs or None) if kwargs else torch.jit.trace(mod, args)
        torch.jit.save(traced, js_path)
        has_ts = True
    except Exception:  # TorchScript can't trace keyword-only parameters and nested kwargs
        has_ts = False
    for p in (kw_path, te_path, js_path):
        torch.save((args, kwargs), p + ".inputs")
    row["nodes"] = len(ex._header["graph"]["nodes"])
    row["weight_mb"] = sum(s["nbytes"] for s in ex._header["weights"]["storages"]) / 2**20

    repeats = 1 if quick else 3
    row["cold_kw"] = cold("kwexport", kw_path, repeats)
    row["cold_te"] = cold("torch.export", te_path, repeats)
    row["cold_ts"] = cold("torchscript", js_path, repeats) if has_ts else None

    row["load_kw"] = median_time(lambda: kwexport.load(kw_path), n_loads, warmup=2)
    row["load_te"] = median_time(lambda: torch.export.load(te_path).module(), max(3, n_loads // 4), warmup=1)
    row["load_ts"] = median_time(lambda: torch.jit.load(js_path), n_loads, warmup=2) if has_ts else None

    prog = kwexport.load(kw_path)
    gm = torch.export.load(te_path).module()
    ts = torch.jit.load(js_path) if has_ts else None
    with torch.no_grad():
        leaves = prog._flatten(*args, **kwargs)
        row["call_eager"] = median_time(lambda: f(*args, **kwargs), n_calls)
        row["call_kw"] = median_time(lambda: prog(*args, **kwargs), n_calls)
        row["floor_kw"] = median_time(lambda: prog._run_flat(leaves), n_calls)
        row["call_te"] = median_time(lambda: gm(*args, **kwargs), n_calls)
        row["call_ts"] = median_time(lambda: ts(*args, **kwargs), n_calls) if has_ts else None
    row["bind_kw"] = median_time(lambda: prog._flatten(*args, **kwargs), n_calls)
    try:
        import optree

        row["optree_flatten"] = median_time(lambda: optree.tree_flatten((args, kwargs)), n_calls)
    except ImportError:
        row["optree_flatten"] = None
    return row


def fmt_ms(s):
    return "n/a" if s is None else (f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s")


def fmt_us(s):
    return "n/a" if s is None else (f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms")


def ratio(a, b):
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.1f}×"


def report(rows, quick):
    lines = []
    lines.append("# Benchmarks\n")
    lines.append(
        f"Produced by `python benches/compare.py` on {time.strftime('%Y-%m-%d')}"
        f"{' (--quick)' if quick else ''}. Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.processor() or platform.platform()}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"kwexport {kwexport.__version__}; one thread (`torch.set_num_threads(1)`), CPU.\n"
    )
    lines.append("Ratios are torch.export's time over kwexport's (higher is better for kwexport), from the same run.\n")
    lines.append("## Loading\n")
    lines.append("Fresh process: after `import torch`, until the first call returns. Warm: a further load in the same process "
                 "(torch.export: `torch.export.load(p).module()`).\n")
    lines.append("| workload | nodes | weights | fresh: kwexport | torch.export | TorchScript | ratio | warm: kwexport | torch.export | TorchScript | ratio |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ts_cold = r["cold_ts"]["cold"] if r["cold_ts"] else None
        lines.append(
            f"| {r['workload']} | {r['nodes']} | {r['weight_mb']:.1f} MB | {fmt_ms(r['cold_kw']['cold'])} | {fmt_ms(r['cold_te']['cold'])} "
            f"| {fmt_ms(ts_cold)} | {ratio(r['cold_te']['cold'], r['cold_kw']['cold'])} | {fmt_ms(r['load_kw'])} "
            f"| {fmt_ms(r['load_te'])} | {fmt_ms(r['load_ts'])} | {ratio(r['load_te'], r['load_kw'])} |"
        )
    lines.append("\n## Calling\n")
    lines.append("Median call time. Overhead is the call minus the floor (the same plan run on flat leaves: no binding, "
                 "no checks, no pytree work); torch.export's overhead is its call minus the same floor.\n")
    lines.append("| workload | eager | kwexport | torch.export | TorchScript | kwexport / eager | kwexport overhead | torch.export overhead | overhead ratio |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        kw_over = r["call_kw"] - r["floor_kw"]
        te_over = r["call_te"] - r["floor_kw"]
        lines.append(
            f"| {r['workload']} | {fmt_us(r['call_eager'])} | {fmt_us(r['call_kw'])} | {fmt_us(r['call_te'])} | {fmt_us(r['call_ts'])} "
            f"| {r['call_kw'] / r['call_eager']:.2f} | {fmt_us(max(kw_over, 0))} | {fmt_us(te_over)} | {ratio(te_over, max(kw_over, 1e-7))} |"
        )
    lines.append("\n## Binding, flattening and checking\n")
    lines.append("`Program._flatten`: bind to the signature, flatten against the treespec and check every leaf, versus "
                 "optree's plain `tree_flatten((args, kwargs))`, which checks nothing.\n")
    lines.append("| workload | kwexport bind + flatten + check | optree.tree_flatten |")
    lines.append("| --- | ---: | ---: |")
    for r in rows:
        lines.append(f"| {r['workload']} | {fmt_us(r['bind_kw'])} | {fmt_us(r['optree_flatten'])} |")
    lines.append("\n## Memory\n")
    lines.append("RSS growth from before loading to after the first call, in a fresh process.\n")
    lines.append("| workload | weights | kwexport | torch.export |")
    lines.append("| --- | ---: | ---: | ---: |")
    for r in rows:
        lines.append(f"| {r['workload']} | {r['weight_mb']:.1f} MB | {r['cold_kw']['rss'] / 2**20:.1f} MB | {r['cold_te']['rss'] / 2**20:.1f} MB |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", default=None, help="write the markdown report here")
    parser.add_argument("--only", nargs="*", default=None, help="workload names")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.only or workloads.NAMES:
            print(f"… {name}", file=sys.stderr, flush=True)
            rows.append(bench(name, tmp, opts.quick))
    text = report(rows, opts.quick)
    print(text)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
