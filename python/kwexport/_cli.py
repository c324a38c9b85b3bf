"""The kwexport command line. Everything it reports comes from the Rust core, which opens
and validates a file without torch; only ``convert`` imports torch (to read the ``.pt2``).

    kwexport inspect PATH [--json]     what a file holds, validated, without running it
    kwexport upgrade OLD NEW [--force] rewrite a file at the current format version
    kwexport convert MODEL.pt2 NEW.kwx a torch.export file as a kwexport file (imports torch)
    kwexport quantize MODEL.pt2 NEW.kwx [--activations dynamic|static] [--calibrate CALLS.pt]
                                       the same, quantized to int8 by torch's pt2e flow (torchao)
    kwexport optimize OLD NEW [--level fast] [--force]
                                       the graphs rewritten at a level, written once (imports torch)
    kwexport bench PATH [--dim N=V] [--shape PATH=2x3] [--optimize exact,fast,bf16] [--json]
                                       load, first and steady call, threads, per-op profile
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kwexport import _rt
from kwexport._cuda_graphs import why_not
from kwexport._rt import FORMAT_VERSION, KwexportError
from kwexport._write import write_atomic


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain JSON-able data (validates the file first)."""
    return json.loads(_rt.describe(os.fspath(path))["description"])


def _print_text(info: dict[str, Any]) -> None:
    v = ".".join(map(str, info["format_version"]))
    cur = ".".join(map(str, info["current_format_version"]))
    upgrade = f" (needs upgrading to {cur}: {', '.join(info['upgraders'])})" if info["needs_upgrade"] else " (current)"
    print(f"format:       {v}{upgrade}")
    prod = info["producer"]
    print(f"written by:   kwexport {prod['kwexport']}, torch {prod['torch']}, python {prod.get('python') or '?'}")
    print(f"device:       {info['device']} (where it was exported; kwexport.load(..., device=...) moves it)")
    print(
        f"optimized:    {info['optimized']}"
        + (" (loads at this level or above)" if info["optimized"] != "exact" else "")
    )
    several = len(info["methods"]) > 1
    for name, m in info["methods"].items():
        indent = "  " if several else ""
        if several:
            print(f"method {name}:")
        print(f"{indent}signature:    {m['signature']}")
        print(f"{indent}inputs:")
        for i in m["inputs"]:
            if i["kind"] == "tensor":
                print(f"{indent}  {i['path']}: {i['dtype']}[{', '.join(map(str, i['shape']))}] on {i['device']}")
            else:
                print(f"{indent}  {i['path']}: constant {i['value']!r}")
        if m["writes"]:
            print(f"{indent}writes:       {', '.join(m['writes'])}")
        print(f"{indent}graph:        {m['nodes']} nodes, {len(m['ops'])} ops")
        for op, n in sorted(m["ops"].items(), key=lambda kv: -kv[1]):
            print(f"{indent}  {n:5}  {op}")
        why = why_not(m["ops"])
        graphs = f"node by node: {why}" if why else "capturable (no op reads a value on the host)"
        print(f"{indent}cuda graphs:  {graphs}")
    w = info["weights"]
    print(f"weights:      {w['tensors']} tensors, {w['bytes']:,} bytes")
    extras = ", ".join(f"{k} ({n} bytes)" for k, n in info["extra_files"].items()) or "none"
    print(f"extra files:  {extras}")


def upgrade(old: str, new: str, *, force: bool = False) -> dict[str, Any]:
    """Rewrites OLD at the current format: a new header, the data section byte for byte."""
    if os.path.exists(new) and not force:
        same = os.path.samefile(old, new)
        raise FileExistsError(f"{new} exists{' (it is the input file)' if same else ''}; pass --force to overwrite it")
    d = _rt.describe(os.fspath(old))
    with open(old, "rb") as f:
        f.seek(d["data_offset"])
        data = f.read()
    write_atomic(os.fspath(new), _rt.container_head(d["header"].encode("utf-8")), [(0, data)])
    return {"from": list(d["file_format_version"]), "to": list(FORMAT_VERSION), "upgraders": d["upgraders"]}


def optimize(old: str, new: str, *, level: str = "fast", force: bool = False) -> dict[str, Any]:
    """Rewrites OLD's graphs at ``level`` into NEW (as loading at that level would), with the
    weights that level stores channels-last repacked; extra files are carried over. A plain
    ``kwexport.load(NEW)`` then runs at that level without rewriting anything at load."""
    if os.path.exists(new) and not force:
        same = os.path.exists(old) and os.path.samefile(old, new)
        raise FileExistsError(f"{new} exists{' (it is the input file)' if same else ''}; pass --force to overwrite it")
    import torch

    from kwexport._write import optimized, write_document

    d = _rt.describe(os.fspath(old))
    header = json.loads(d["header"])
    with open(old, "rb") as f:
        f.seek(d["data_offset"])
        blob = f.read()
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    # Each storage as memory of its own, so tensors that shared one still share it.
    storages = [data[s["offset"] : s["offset"] + s["nbytes"]].clone() for s in header["weights"]["storages"]]
    weights, mutable = {}, set()
    for name, t in header["weights"]["tensors"].items():
        typed = storages[t["storage"]].view(getattr(torch, t["dtype"]))
        weights[name] = typed.as_strided(t["shape"], t["strides"], t.get("storage_offset", 0))
        if t.get("mutable"):
            mutable.add(name)
    extras = {}
    for name, e in header.get("extra_files", {}).items():
        blob = bytes(data[e["offset"] : e["offset"] + e["nbytes"]].numpy())
        extras[name] = blob.decode("utf-8") if e["encoding"] == "utf8" else blob
    header.pop("weights")
    header.pop("extra_files", None)
    write_document(os.fspath(new), *optimized(header, weights, mutable, level), extras)
    info = describe(new)
    return {"from": json.loads(d["description"])["optimized"], "to": info["optimized"], "file": os.fspath(new)}


def convert(pt2: str, new: str, *, force: bool = False) -> dict[str, Any]:
    """Reads a ``.pt2`` written by ``torch.export.save`` and saves it as a kwexport file."""
    if os.path.exists(new) and not force:
        raise FileExistsError(f"{new} exists; pass --force to overwrite it")
    import torch

    from kwexport._write import save

    save(torch.export.load(pt2), new)
    return describe(new)


def quantize(
    pt2: str,
    new: str,
    *,
    activations: str = "dynamic",
    calibrate: str | None = None,
    reduce_range: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Reads a ``.pt2`` written by ``torch.export.save`` and saves it quantized to int8 by
    :func:`kwexport.quantize`, traced on the program's example inputs. Static activations
    need calibration calls: ``calibrate`` names a file ``torch.save`` wrote holding a list of
    ``(args, kwargs)``, read with ``weights_only=True`` (tensors and containers, no code)."""
    if os.path.exists(new) and not force:
        raise FileExistsError(f"{new} exists; pass --force to overwrite it")
    if activations == "static" and calibrate is None:
        raise ValueError("static activations need calibration calls: pass --calibrate CALLS.pt")
    import torch

    from kwexport._quantize import quantize as _quantize
    from kwexport._write import save

    ep = torch.export.load(pt2)
    if ep.example_inputs is None:
        raise ValueError(f"{pt2} keeps no example inputs to trace the program on")
    calls = None
    if calibrate is not None:
        calls = torch.load(calibrate, weights_only=True)
        if not isinstance(calls, list) or not all(isinstance(c, tuple) and len(c) == 2 for c in calls):
            raise ValueError(f"{calibrate}: expected a list of (args, kwargs) pairs")
    args, kwargs = ep.example_inputs
    quantized = _quantize(
        ep.module(), args, kwargs, calibration=calls, activations=activations, reduce_range=reduce_range
    )
    save(quantized, new)
    return describe(new)


def _pair(arg: str, flag: str) -> tuple[str, str]:
    key, sep, value = arg.partition("=")
    if not sep or not key:
        raise ValueError(f"{flag} takes KEY=VALUE, got {arg!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kwexport", description="Inspect and upgrade kwexport files.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="describe a file without running it")
    p_inspect.add_argument("path")
    p_inspect.add_argument("--json", action="store_true", help="print JSON")
    p_upgrade = sub.add_parser("upgrade", help="rewrite a file at the current format version")
    p_upgrade.add_argument("old")
    p_upgrade.add_argument("new")
    p_upgrade.add_argument("--force", action="store_true", help="overwrite NEW, even if it is OLD")
    p_convert = sub.add_parser("convert", help="convert a torch.export .pt2 file (imports torch)")
    p_convert.add_argument("pt2")
    p_convert.add_argument("new")
    p_convert.add_argument("--force", action="store_true", help="overwrite NEW")
    p_quantize = sub.add_parser("quantize", help="convert a .pt2 file quantized to int8 (imports torch, torchao)")
    p_quantize.add_argument("pt2")
    p_quantize.add_argument("new")
    p_quantize.add_argument(
        "--activations",
        choices=["dynamic", "static"],
        default="dynamic",
        help="their scales per call (default) or calibrated",
    )
    p_quantize.add_argument("--calibrate", metavar="CALLS.pt", help="calibration calls: a list of (args, kwargs)")
    p_quantize.add_argument(
        "--reduce-range", action="store_true", help="activations of 128 levels: faster on CPUs without VNNI"
    )
    p_quantize.add_argument("--force", action="store_true", help="overwrite NEW")
    p_optimize = sub.add_parser("optimize", help="write a file's graphs rewritten at a level (imports torch)")
    p_optimize.add_argument("old")
    p_optimize.add_argument("new")
    p_optimize.add_argument("--level", default="fast", help="the optimization level (default fast)")
    p_optimize.add_argument("--force", action="store_true", help="overwrite NEW")
    p_bench = sub.add_parser("bench", help="time a program on inputs made from its recorded shapes (imports torch)")
    p_bench.add_argument("path")
    p_bench.add_argument("--dim", action="append", default=[], metavar="NAME=N", help="a symbolic dimension's size")
    p_bench.add_argument("--shape", action="append", default=[], metavar="PATH=2x3", help="an input's whole shape")
    p_bench.add_argument(
        "--optimize",
        default="exact",
        metavar="LEVELS",
        help="levels, comma-separated: exact, fast, bf16 (default exact)",
    )
    p_bench.add_argument("--threads", type=int, default=2, help="threads to compare with one (default 2)")
    p_bench.add_argument("--seconds", type=float, default=1.0, help="time per measurement (default 1)")
    p_bench.add_argument("--method", help="the method to time (default: the one prog(...) calls)")
    p_bench.add_argument("--json", action="store_true", help="print JSON")
    opts = parser.parse_args(argv)
    try:
        if opts.command == "inspect":
            info = describe(opts.path)
            if opts.json:
                print(json.dumps(info, indent=2))
            else:
                _print_text(info)
        elif opts.command == "bench":
            from kwexport import _bench

            report = _bench.bench(
                opts.path,
                dims={k: int(v) for k, v in (_pair(a, "--dim") for a in opts.dim)},
                shapes={k: [int(n) for n in v.split("x") if n] for k, v in (_pair(a, "--shape") for a in opts.shape)},
                levels=tuple(opts.optimize.split(",")),
                threads=opts.threads,
                seconds=opts.seconds,
                method=opts.method,
            )
            if opts.json:
                print(json.dumps(report, indent=2))
            else:
                _bench.print_report(report)
        elif opts.command == "optimize":
            r = optimize(opts.old, opts.new, level=opts.level, force=opts.force)
            print(f"{opts.new}: optimized {r['from']} -> {r['to']}")
        elif opts.command == "quantize":
            info = quantize(
                opts.pt2,
                opts.new,
                activations=opts.activations,
                calibrate=opts.calibrate,
                reduce_range=opts.reduce_range,
                force=opts.force,
            )
            m = info["methods"]["forward"]
            print(f"{opts.new}: {m['signature']}, int8 ({opts.activations} activations), {m['nodes']} nodes")
        elif opts.command == "convert":
            info = convert(opts.pt2, opts.new, force=opts.force)
            m = info["methods"]["forward"]
            print(f"{opts.new}: {m['signature']}, {m['nodes']} nodes, {info['weights']['tensors']} weights")
        else:
            r = upgrade(opts.old, opts.new, force=opts.force)
            steps = ", ".join(r["upgraders"]) or "nothing to do"
            print(f"{opts.new}: format {'.'.join(map(str, r['from']))} -> {'.'.join(map(str, r['to']))} ({steps})")
    except (KwexportError, OSError, ValueError, ImportError) as e:
        print(f"kwexport: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
