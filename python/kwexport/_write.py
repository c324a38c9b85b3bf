"""Writing files: the header and data section laid out as the format says, written
atomically. The container's layout comes from ``kwexport._rt`` (one source of truth).

Imports no torch: ``kwexport upgrade`` rewrites files with it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from typing import Any

from kwexport._rt import ALIGN, check_extra_name, container_head


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
    """Temp file in the same folder, fsync, rename: readers see the old file or the new one.
    ``head`` ends where the data section starts."""
    data_start = len(head)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            for offset, buf in chunks:
                f.write(b"\0" * (data_start + offset - f.tell()))
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _file_mode(path))  # mkstemp makes 0600; give what open() would
        os.replace(tmp, path)
    except BaseException:
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


def save(ex: Any, path: str | os.PathLike[str], *, extra_files: dict[str, str | bytes] | None = None) -> None:
    """Writes an exported program (``kwexport.export``'s result, or a
    ``torch.export.ExportedProgram``): its header with each storage's offset filled in, the
    storages, then the extra files, each on an aligned offset of the data section."""
    from kwexport._trace import Exported, from_exported_program

    if not isinstance(ex, Exported):
        import torch

        if not isinstance(ex, torch.export.ExportedProgram):
            raise TypeError(
                f"save() takes the result of kwexport.export or a torch.export.ExportedProgram, got {type(ex).__name__}"
            )
        ex = from_exported_program(ex)
    header = json.loads(json.dumps(ex._header))  # a copy we can fill in
    chunks: list[tuple[int, Any]] = []
    cursor = 0
    for entry, data in zip(header["weights"]["storages"], ex._storages):
        entry["offset"] = cursor
        chunks.append((cursor, memoryview(data.numpy())))
        cursor = align(cursor + entry["nbytes"])
    header["extra_files"], extra_chunks = extra_file_entries(extra_files, cursor)
    write_file(path, header, chunks + extra_chunks)
