"""``kwexport bench FILE``: where a program's time goes, on inputs made from the file alone.

Inputs come from what the file records: each tensor leaf's dtype and shape (a symbolic
dimension takes ``--dim NAME=N``, else 8 clamped to the symbol's range; ``--shape PATH=2x3``
sets a leaf's whole shape), floating tensors random, integer and bool tensors ones (valid
token ids and masks), specialized constants as recorded. The call is rebuilt from the file's
input treespec and made as a user makes it, ``prog(*args, **kwargs)``.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import threading
import time
from typing import Any

import torch

import kwexport
from kwexport import _rt
from kwexport._signature import constant_value


def method_name(methods: Any, method: str | None) -> str:
    """The method a bench runs: the one named, else the one ``prog(...)`` calls."""
    names = list(methods)
    if method is None:
        if len(names) == 1 or "forward" in names:
            return names[0] if len(names) == 1 else "forward"
        raise ValueError(f"the file holds methods {', '.join(names)}: name one (--method)")
    if method not in names:
        raise ValueError(f"--method {method}: the file holds {', '.join(names)}")
    return method


def example_call(
    path: str | os.PathLike[str],
    dims: dict[str, int] | None = None,
    shapes: dict[str, list[int]] | None = None,
    method: str | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for a call of one of the file's methods (by default the one
    ``prog(...)`` calls), from its recorded inputs."""
    d = _rt.describe(os.fspath(path))
    doc, described = json.loads(d["header"]), json.loads(d["description"])
    name = method_name(doc["methods"], method)
    header, info = doc["methods"][name], described["methods"][name]
    dims, shapes = dims or {}, shapes or {}
    ranges = {s["name"]: (s["min"], s["max"]) for s in header["symbols"]}
    unknown = set(dims) - set(ranges)
    if unknown:
        raise ValueError(f"--dim names {sorted(unknown)}; the file's symbols are {sorted(ranges) or 'none'}")
    value = {name: dims.get(name, _default_size(lo, hi)) for name, (lo, hi) in ranges.items()}
    g = torch.Generator().manual_seed(0)
    leaves = []
    for leaf, described in zip(header["inputs"]["leaves"], info["inputs"]):
        if "constant" in leaf:
            leaves.append(constant_value(leaf["constant"]))
            continue
        t = leaf["tensor"]
        shape = shapes.get(described["path"]) or [_size(dim, value) for dim in t["shape"]]
        dtype = getattr(torch, t["dtype"])
        if dtype.is_floating_point or dtype.is_complex:
            leaves.append(torch.randn(shape, generator=g, dtype=dtype).to(t["device"]))
        else:
            leaves.append(torch.ones(shape, dtype=dtype, device=t["device"]))
    args, kwargs = _unflatten(header["inputs"]["spec"], iter(leaves))
    return tuple(args), dict(kwargs)


def _default_size(lo: int, hi: int | None) -> int:
    return max(lo, min(8, hi if hi is not None else 8))


def _size(dim: dict[str, Any], value: dict[str, int]) -> int:
    if "static" in dim:
        return dim["static"]
    s = dim["symbolic"]
    return s["coeff"] * value[s["symbol"]] + s["offset"]


def _unflatten(spec: dict[str, Any], leaves) -> Any:
    kind = spec["type"]
    if kind == "leaf":
        return next(leaves)
    if kind == "none":
        return None
    if kind in ("tuple", "list"):
        items = [_unflatten(c, leaves) for c in spec["children"]]
        return tuple(items) if kind == "tuple" else items
    if kind in ("dict", "ordered_dict", "defaultdict"):
        return {next(iter(e["key"].values())): _unflatten(e["value"], leaves) for e in spec["entries"]}
    raise ValueError(f"kwexport bench can't build inputs held in a {kind} yet; pass the program's own call instead")


def _per_call(fn, seconds: float = 0.5) -> float:
    """Median seconds per call of ``fn``, over repeats of enough calls to take ``seconds / 5``."""
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds / 25 or n < 3:
        fn()
        n += 1
    per = max(1, int(n * 5))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(per):
            fn()
        times.append((time.perf_counter() - t) / per)
    return statistics.median(times)


def _throughput(progs: list, args, kwargs, seconds: float) -> float:
    """Calls per second of ``len(progs)`` threads, each calling its own program."""
    counts = [0] * len(progs)
    stop = threading.Event()

    def work(i):
        while not stop.is_set():
            progs[i](*args, **kwargs)
            counts[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(progs))]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def bench(
    path: str | os.PathLike[str],
    *,
    dims: dict[str, int] | None = None,
    shapes: dict[str, list[int]] | None = None,
    levels: tuple[str, ...] = ("exact",),
    threads: int = 2,
    seconds: float = 1.0,
    top: int = 10,
    method: str | None = None,
) -> dict[str, Any]:
    """Per optimization level: load, first-call and steady-call times, throughput on 1 and
    ``threads`` threads, and the ops that took the most of a profiled call, for one method
    (by default the one ``prog(...)`` calls). A level is ``exact``, ``fast``, or ``bf16``
    (``precision="bf16"``)."""
    args, kwargs = example_call(path, dims, shapes, method)
    method = method_name(json.loads(_rt.describe(os.fspath(path))["description"])["methods"], method)
    report: dict[str, Any] = {
        "file": os.fspath(path),
        "method": method,
        "torch": torch.__version__,
        "threads_torch": torch.get_num_threads(),
        "levels": {},
    }
    for level in levels:  # a level the runtime doesn't know fails here, before any timing
        kwexport.load(path, **_load_options(level))
    for level in levels:
        prog, entry = _bench_level(
            path, level, method, args=args, kwargs=kwargs, threads=threads, seconds=seconds, top=top
        )
        report["levels"][level] = entry
    report["inputs"] = {k: list(v.shape) if isinstance(v, torch.Tensor) else v for k, v in _named(prog, args, kwargs)}
    return report


def _load_options(level: str) -> dict[str, str]:
    """``kwexport.load``'s options for a level of ``bench``."""
    return {"precision": "bf16"} if level == "bf16" else {"optimize": level}


def _bench_level(path, level, method, *, args, kwargs, threads, seconds, top) -> tuple[Any, dict[str, Any]]:
    options = _load_options(level)
    loads = []
    for _ in range(20):
        t = time.perf_counter()
        kwexport.load(path, **options)
        loads.append(time.perf_counter() - t)
    file = kwexport.load(path, **options)
    prog = file[method]
    # The first call after a fresh load, timed alone: subtracting the loads' median from a
    # load and call timed together went negative where one load ran slow.
    t = time.perf_counter()
    try:
        prog(*args, **kwargs)
    except Exception as e:
        raise ValueError(
            f"the program fails on inputs made from its recorded shapes ({type(e).__name__}: {e}); "
            "its graph checks their values (made up here: random floats, integers and bools of 1)"
        ) from e
    first = time.perf_counter() - t
    steady = _per_call(lambda: prog(*args, **kwargs), seconds)
    one = _throughput([prog], args, kwargs, seconds)
    # A stateful program serializes its calls: each thread gets its own copy, as a server would.
    many = _throughput([prog] + [copy.copy(file)[method] for _ in range(threads - 1)], args, kwargs, seconds)
    prog.profile(*args, **kwargs)  # warm
    by_op: dict[str, list[float]] = {}
    nodes = prog.profile(*args, **kwargs)
    for n in nodes:
        label = n["op"] if n["node"] is not None else f"({n['op']})"
        by_op.setdefault(f"{label} [{n['path']}]", []).append(n["us"])
    total = sum(n["us"] for n in nodes)
    ops = sorted(((op, len(v), sum(v)) for op, v in by_op.items()), key=lambda r: -r[2])
    return prog, {
        "load_ms": statistics.median(loads) * 1e3,
        "first_call_ms": first * 1e3,
        "call_us": steady * 1e6,
        "calls_per_s": {"1": one, str(threads): many},
        "scaling": many / one,
        "dispatch": {k: v for k, v in prog.dispatch.items() if k != "on_python"},
        "profile_us": total,
        "top_ops": [{"op": op, "nodes": n, "us": us, "share": us / total if total else 0.0} for op, n, us in ops[:top]],
    }


def _named(prog, args, kwargs):
    names = list(prog.__signature__.parameters)
    return list(zip(names, args)) + list(kwargs.items())


def print_report(r: dict[str, Any]) -> None:
    print(f"file:         {r['file']}")
    print(f"torch:        {r['torch']}, {r['threads_torch']} intra-op thread(s)")
    shown = ", ".join(f"{k}={v}" for k, v in r["inputs"].items())
    print(f"inputs:       {shown}")
    for level, e in r["levels"].items():
        print("precision=bf16:" if level == "bf16" else f"optimize={level}:")
        d = e["dispatch"]
        print(f"  nodes:        {d['stable_abi']} on the C path, {d['python']} through Python")
        print(f"  load:         {e['load_ms']:.2f} ms (warm page cache, median of 20)")
        print(f"  first call:   {e['first_call_ms']:.2f} ms (after a fresh load)")
        print(f"  steady call:  {e['call_us']:.1f} us")
        cps = e["calls_per_s"]
        (n, many), one = list(cps.items())[-1], cps["1"]
        print(f"  throughput:   {one:,.0f} calls/s on 1 thread, {many:,.0f} on {n} ({e['scaling']:.2f}x)")
        print(f"  profile:      {e['profile_us']:.1f} us in a profiled call; the ops that took most:")
        for o in e["top_ops"]:
            print(f"    {o['us']:9.1f} us {o['share']:6.1%}  {o['nodes']:4}x  {o['op']}")
