"""The kwexport command line.

    kwexport inspect PATH [--json]     what a file holds, validated, without running it
    kwexport upgrade OLD NEW [--force] rewrite a file at the current format version
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

from kwexport import _rt
from kwexport._rt import FORMAT_VERSION, KwexportError


def describe(path: str) -> dict:
    """Everything `inspect` shows, as plain JSON-able data."""
    d = _rt.describe(os.fspath(path))
    header = json.loads(d["header"])
    symbols = {s["name"]: s for s in header.get("symbols", [])}
    file_version = list(d["file_format_version"])
    inputs = []
    for path_, leaf in zip(d["leaf_paths"], header["inputs"]["leaves"]):
        if "tensor" in leaf:
            t = leaf["tensor"]
            inputs.append({"path": path_, "kind": "tensor", "dtype": t["dtype"], "device": t["device"],
                           "shape": [_dim(dim, symbols) for dim in t["shape"]]})
        else:
            inputs.append({"path": path_, "kind": "constant", "value": _constant(leaf["constant"])})
    op_counts = [0] * len(header["ops"])
    for node in header["graph"]["nodes"]:
        op_counts[node["op"]] += 1
    return {
        "format_version": file_version,
        "current_format_version": list(FORMAT_VERSION),
        "needs_upgrade": file_version != list(FORMAT_VERSION),
        "upgraders": d["upgraders"],
        "producer": header["producer"],
        "signature": _signature_text(header["signature"]),
        "inputs": inputs,
        "symbols": [{"name": s["name"], "min": s["min"], "max": s["max"]} for s in header.get("symbols", [])],
        "ops": {op["name"]: n for op, n in zip(header["ops"], op_counts)},
        "nodes": len(header["graph"]["nodes"]),
        "weights": {"tensors": len(header["weights"]["tensors"]),
                    "bytes": sum(s["nbytes"] for s in header["weights"]["storages"])},
        "extra_files": {name: f["nbytes"] for name, f in header.get("extra_files", {}).items()},
    }


def _dim(dim, symbols) -> str | int:
    if "static" in dim:
        return dim["static"]
    s = dim["symbolic"]
    name, coeff, offset = s["symbol"], s["coeff"], s["offset"]
    text = name if coeff == 1 else f"{coeff}*{name}"
    if offset:
        text += f" + {offset}" if offset > 0 else f" - {-offset}"
    sym = symbols.get(name, {})
    upper = "inf" if sym.get("max") is None else sym["max"]
    return f"{text} ({name} in [{sym.get('min')}, {upper}])"


def _constant(c):
    from kwexport._export import _constant_value  # noqa: PLC0415 - only for constants

    return _constant_value(c)


def _signature_text(sig) -> str:
    parts, star_done, slash_pending = [], False, False
    for p in sig["params"]:
        kind = p["kind"]
        if kind != "positional_only" and slash_pending:
            parts.append("/")
            slash_pending = False
        if kind == "positional_only":
            slash_pending = True
        if kind == "keyword_only" and not star_done:
            parts.append("*")
        star_done = star_done or kind in ("var_positional", "keyword_only")
        text = {"var_positional": "*", "var_keyword": "**"}.get(kind, "") + p["name"]
        if "default" in p:
            text += f"={_constant(p['default'])!r}"
        parts.append(text)
    if slash_pending:
        parts.append("/")
    return f"{sig['name']}({', '.join(parts)})"


def _print_text(info: dict) -> None:
    v = ".".join(map(str, info["format_version"]))
    cur = ".".join(map(str, info["current_format_version"]))
    print(f"format:       {v}" + (f" (needs upgrading to {cur}: {', '.join(info['upgraders'])})" if info["needs_upgrade"] else " (current)"))
    prod = info["producer"]
    print(f"written by:   kwexport {prod['kwexport']}, torch {prod['torch']}, python {prod.get('python') or '?'}")
    print(f"signature:    {info['signature']}")
    print("inputs:")
    for i in info["inputs"]:
        if i["kind"] == "tensor":
            print(f"  {i['path']}: {i['dtype']}[{', '.join(map(str, i['shape']))}] on {i['device']}")
        else:
            print(f"  {i['path']}: constant {i['value']!r}")
    print(f"graph:        {info['nodes']} nodes, {len(info['ops'])} ops")
    for op, n in sorted(info["ops"].items(), key=lambda kv: -kv[1]):
        print(f"  {n:5}  {op}")
    w = info["weights"]
    print(f"weights:      {w['tensors']} tensors, {w['bytes']:,} bytes")
    extras = ", ".join(f"{k} ({n} bytes)" for k, n in info["extra_files"].items()) or "none"
    print(f"extra files:  {extras}")


def upgrade(old: str, new: str, *, force: bool = False) -> dict:
    """Rewrites OLD at the current format: a new header, the data section byte for byte."""
    from kwexport._export import ALIGN, MAGIC, _write_atomic  # noqa: PLC0415

    if os.path.exists(new) and not force:
        same = os.path.samefile(old, new)
        raise FileExistsError(f"{new} exists{' (it is the input file)' if same else ''}; pass --force to overwrite it")
    d = _rt.describe(os.fspath(old))
    with open(old, "rb") as f:
        f.seek(d["data_offset"])
        data = f.read()
    blob = d["header"].encode("utf-8")
    prefix = MAGIC + struct.pack("<Q", len(blob)) + blob
    data_start = (len(prefix) + ALIGN - 1) // ALIGN * ALIGN
    _write_atomic(os.fspath(new), prefix, data_start, [(0, data)])
    return {"from": list(d["file_format_version"]), "to": list(FORMAT_VERSION), "upgraders": d["upgraders"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kwexport", description="Inspect and upgrade kwexport files.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="describe a file without running it")
    p_inspect.add_argument("path")
    p_inspect.add_argument("--json", action="store_true", help="print JSON")
    p_upgrade = sub.add_parser("upgrade", help="rewrite a file at the current format version")
    p_upgrade.add_argument("old")
    p_upgrade.add_argument("new")
    p_upgrade.add_argument("--force", action="store_true", help="overwrite NEW, even if it is OLD")
    opts = parser.parse_args(argv)
    try:
        if opts.command == "inspect":
            info = describe(opts.path)
            if opts.json:
                print(json.dumps(info, indent=2))
            else:
                _print_text(info)
        else:
            r = upgrade(opts.old, opts.new, force=opts.force)
            steps = ", ".join(r["upgraders"]) or "nothing to do"
            print(f"{opts.new}: format {'.'.join(map(str, r['from']))} -> {'.'.join(map(str, r['to']))} ({steps})")
    except (KwexportError, OSError) as e:
        print(f"kwexport: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
