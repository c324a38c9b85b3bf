"""Writing files: the header and data section laid out as the format says, written
atomically. The container's layout comes from ``kwexport._rt`` (one source of truth).

Imports no torch: ``kwexport upgrade`` rewrites files with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from kwexport._rt import ALIGN, FORMAT_VERSION, check_extra_name, check_method_name, container_head


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_file(path: str | os.PathLike[str], header: dict[str, Any], chunks: Iterable[tuple[int, Any]]) -> None:
    """Writes ``header`` and the data ``chunks`` (``(offset in the data section, buffer)``)."""
    blob = json.dumps(header, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    write_atomic(os.fspath(path), container_head(blob), chunks)


def extra_file_entries(extra_files: dict[str, str | bytes] | None, cursor: int):
    """The ``extra_files`` table and its chunks, laid out from ``cursor`` on."""
    entries, chunks = {}, []
    for name, value in (extra_files or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"extra file names must be str, got {type(name).__name__}")
        check_extra_name(name)
        if isinstance(value, str):
            blob, encoding = value.encode("utf-8"), "utf8"
        elif isinstance(value, (bytes, bytearray, memoryview)):
            blob, encoding = bytes(value), "bytes"
        else:
            raise TypeError(f"extra_files[{name!r}] must be str or bytes, got {type(value).__name__}")
        entries[name] = {"offset": cursor, "nbytes": len(blob), "encoding": encoding}
        chunks.append((cursor, blob))
        cursor = align(cursor + len(blob))
    return entries, chunks


def _file_mode(path: str) -> int:
    try:
        return os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_atomic(path: str, head: bytes, chunks: Iterable[tuple[int, Any]]) -> None:
    """Writes the file under no name, then names it: readers see the old file or the new one,
    and a save killed midway leaves nothing behind. On Linux the file is made with
    ``O_TMPFILE`` (no name until complete), linked to a temporary name once written and
    renamed over ``path``; elsewhere it is a named temporary file, and whatever a killed save
    left is removed by the next save into the same folder. ``head`` ends where the data
    section starts."""
    folder = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    _remove_orphans(folder, base)
    fd, tmp = _open_unnamed(folder, base)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_body(f, head, chunks)
            os.fchmod(f.fileno(), _file_mode(path))  # what open() would give
            if tmp is None:  # name it now that it is whole
                tmp = _temp_name(folder, base)
                _link_unnamed(f.fileno(), tmp)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write_body(f, head: bytes, chunks: Iterable[tuple[int, Any]]) -> None:
    data_start = len(head)
    f.write(head)
    for offset, buf in chunks:
        f.write(b"\0" * (data_start + offset - f.tell()))
        f.write(buf)
    f.flush()
    os.fsync(f.fileno())


def _temp_name(folder: str, base: str) -> str:
    """A new temporary name that says which process made it: ``.<base>.<pid>.<random>.tmp``."""
    return os.path.join(folder, f".{base}.{os.getpid()}.{os.urandom(6).hex()}.tmp")


def _open_unnamed(folder: str, base: str) -> tuple[int, str | None]:
    """A file to write: unnamed (``O_TMPFILE``, name ``None``) where the filesystem allows it,
    else a named temporary file."""
    if hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
        try:
            return os.open(folder, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600), None
        except OSError:
            pass  # a filesystem without it: named below
    tmp = _temp_name(folder, base)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), tmp


def _link_unnamed(fd: int, name: str) -> None:
    """Gives the ``O_TMPFILE`` file ``fd`` a name. Through ``/proc/self/fd`` as a directory:
    with a ``src_dir_fd`` CPython calls ``linkat`` with ``AT_SYMLINK_FOLLOW``, without one
    ``link``, which doesn't follow the magic link."""
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(fd), name, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _remove_orphans(folder: str, base: str) -> None:
    """Removes temporary files of earlier saves of ``base`` whose process has died."""
    prefix = f".{base}."
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        parts = name[len(prefix) :].split(".")
        if not (name.startswith(prefix) and name.endswith(".tmp") and len(parts) == 3 and parts[0].isdigit()):
            continue
        pid = int(parts[0])
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def save(
    ex: Any,
    path: str | os.PathLike[str],
    *,
    extra_files: dict[str, str | bytes] | None = None,
    optimize: str = "exact",
) -> None:
    r"""Writes exported programs (``kwexport.export``'s results or
    ``torch.export.ExportedProgram``\ s; one, or a dict of them by method name), their graphs
    rewritten at ``optimize``'s level."""
    header, weights, mutable = document(methods_of(ex))
    write_document(path, *optimized(header, weights, mutable, optimize), extra_files)


def optimized(header: dict[str, Any], weights: dict[str, Any], mutable: set[str], level: str):
    """The header's graphs rewritten at ``level`` by the core's passes (as loading at that
    level rewrites them), with the weights a level stores channels-last repacked so: still
    plain strided tensors, which load as zero-copy views. Returns the header, its weight
    tables filled in, and the storages."""
    import torch

    from kwexport._rt import optimize_header
    from kwexport._weights import weight_tables

    storage_table, tensor_table, storages = weight_tables(weights, mutable)
    header = dict(header, weights={"storages": storage_table, "tensors": tensor_table})
    if level == "exact" and "optimized" not in header:
        return header, storages
    # Offsets are laid out when writing; the passes don't read them.
    probe = json.loads(json.dumps(header))
    for entry in probe["weights"]["storages"]:
        entry["offset"] = 0
    rewritten, channels_last, folds = optimize_header(json.dumps(probe), level)
    header = json.loads(rewritten)
    if channels_last or folds:
        from kwexport._passes import fold_batch_norms

        weights = dict(weights, **fold_batch_norms(weights, folds))
        for name in channels_last:
            weights[name] = weights[name].contiguous(memory_format=torch.channels_last)
        # A fold leaves the batch norms' own tensors unread: they aren't written.
        named = referenced_weights(header)
        weights = {name: w for name, w in weights.items() if name in named}
        storage_table, tensor_table, storages = weight_tables(weights, mutable)
        header["weights"] = {"storages": storage_table, "tensors": tensor_table}
    return header, storages


def referenced_weights(header: dict[str, Any]) -> set[str]:
    """The weights a header's methods name, every place ``_renamed`` renames: graph inputs,
    state writes and parameter defaults."""
    named = set()
    for m in header["methods"].values():
        named.update(i["source"]["weight"] for i in m["graph"]["inputs"] if "weight" in i["source"])
        named.update(w["target"]["weight"] for w in m["graph"].get("mutations", []) if "weight" in w["target"])
        named.update(p["default_weight"] for p in m["signature"]["params"] if p.get("default_weight"))
    return named


def write_document(
    path: str | os.PathLike[str],
    header: dict[str, Any],
    storages: list[Any],
    extra_files: dict[str, str | bytes] | None,
) -> None:
    """Writes the header with each storage's offset filled in, the storages, then the extra
    files, each on an aligned offset of the data section."""
    chunks: list[tuple[int, Any]] = []
    cursor = 0
    for entry, data in zip(header["weights"]["storages"], storages):
        entry["offset"] = cursor
        chunks.append((cursor, memoryview(data.numpy())))
        cursor = align(cursor + entry["nbytes"])
    header["extra_files"], extra_chunks = extra_file_entries(extra_files, cursor)
    write_file(path, header, chunks + extra_chunks)


def methods_of(ex: Any) -> dict[str, Any]:
    """``save``'s argument as ``{method name: Exported}``: one program is the method
    ``forward``."""
    from kwexport._trace import Exported, from_exported_program

    def one(value: Any, what: str) -> Exported:
        if isinstance(value, Exported):
            return value
        import torch

        if isinstance(value, torch.export.ExportedProgram):
            return from_exported_program(value)
        raise TypeError(
            f"save() takes the result of kwexport.export or a torch.export.ExportedProgram{what}, "
            f"got {type(value).__name__}"
        )

    if not isinstance(ex, dict):
        return {"forward": one(ex, ", or a dict of them by method name")}
    if not ex:
        raise ValueError("save() got no methods: pass at least one exported program")
    for name in ex:
        if not isinstance(name, str):
            raise TypeError(f"save(): method names are str, got {type(name).__name__}")
        check_method_name(name)
    return {name: one(value, f" for method {name!r}") for name, value in ex.items()}


def document(methods: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """The header (less its weight tables and extra files) of a file holding ``methods``,
    its weights by name, and the names of those written (state).
    Weights are merged across methods by identity: a tensor that several methods read, or
    that one reads under two names, is one weight in the file (state a method writes is then
    state every method that reads it sees); a name two methods give different tensors is
    kept by the first and prefixed with the method's name in the others."""
    import sys

    import torch

    import kwexport
    from kwexport._weights import identity

    weights: dict[str, Any] = {}
    mutable: set[str] = set()
    by_identity: dict[tuple, str] = {}
    entries = {}
    for method, ex in methods.items():
        rename = {}
        for name, t in ex._weights.items():
            key = identity(t) if t.untyped_storage().nbytes() else ("empty", method, name)
            if key not in by_identity:
                unique, n = name, 1
                while unique in weights:
                    unique, n = f"{method}.{name}" + (f".{n}" if n > 1 else ""), n + 1
                by_identity[key] = unique
                weights[unique] = t
            rename[name] = by_identity[key]
            if name in ex._mutable:
                mutable.add(rename[name])
        entries[method] = _renamed(ex._method, rename)
    header = {
        "format_version": {"major": FORMAT_VERSION[0], "minor": FORMAT_VERSION[1]},
        "producer": {
            "kwexport": kwexport.__version__,
            "torch": torch.__version__,
            "python": ".".join(map(str, sys.version_info[:3])),
        },
        "methods": entries,
    }
    return header, weights, mutable


def _renamed(method: dict[str, Any], rename: dict[str, str]) -> dict[str, Any]:
    """A copy of a method entry with its weight references renamed."""
    m = json.loads(json.dumps(method))
    for i in m["graph"]["inputs"]:
        if "weight" in i["source"]:
            i["source"]["weight"] = rename[i["source"]["weight"]]
    for w in m["graph"].get("mutations", []):
        if "weight" in w["target"]:
            w["target"]["weight"] = rename[w["target"]["weight"]]
    for p in m["signature"]["params"]:
        if "default_weight" in p:
            p["default_weight"] = rename[p["default_weight"]]
    return m
