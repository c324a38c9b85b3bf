"""Files on disk: a killed save leaves nothing behind, and `mmap=False` programs are immune to
what happens to their file afterwards."""

import inspect
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import torch
from torch import nn

import kwexport
from kwexport import _write


def test_a_killed_save_leaves_no_file_behind(tmp_path):
    # A save of ~200 MB takes long enough that each kill below lands inside it.
    code = f"""
        import sys, torch, kwexport
        m = torch.nn.Linear(7000, 7000)
        ex = kwexport.export(m, (torch.randn(1, 7000),))
        print("saving", flush=True)
        while True:
            kwexport.save(ex, {str(tmp_path / "big.kwx")!r})
    """
    for delay in (0.0, 0.05, 0.3):
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "saving"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        assert [n for n in os.listdir(tmp_path) if n != "big.kwx"] == []


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_save_removes_what_a_dead_save_left(tmp_path):
    # Where O_TMPFILE is missing, a save writes a named temporary file first; a killed one
    # leaves it, and the next save of that name into the folder removes it.
    orphan = tmp_path / f".m.kwx.{dead_pid()}.0123456789ab.tmp"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        in_progress = tmp_path / f".m.kwx.{alive.pid}.0123456789ab.tmp"
        other = tmp_path / f".other.kwx.{dead_pid()}.0123456789ab.tmp"
        for p in (orphan, in_progress, other):
            p.write_bytes(b"partial")
        kwexport.save(kwexport.export(nn.Linear(2, 2), (torch.randn(1, 2),)), tmp_path / "m.kwx")
        assert sorted(os.listdir(tmp_path)) == sorted(["m.kwx", in_progress.name, other.name])
    finally:
        alive.kill()
        alive.wait()


def test_the_named_fallback_writes_the_same_file(tmp_path, monkeypatch):
    m = nn.Linear(3, 2)
    ex = kwexport.export(m, (torch.randn(1, 3),))
    kwexport.save(ex, tmp_path / "unnamed.kwx")
    monkeypatch.delattr(os, "O_TMPFILE")
    kwexport.save(ex, tmp_path / "named.kwx")
    assert (tmp_path / "unnamed.kwx").read_bytes() == (tmp_path / "named.kwx").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["named.kwx", "unnamed.kwx"]
    assert _write._file_mode(str(tmp_path / "named.kwx")) == os.stat(tmp_path / "unnamed.kwx").st_mode & 0o777


def test_mmap_false_reads_the_file_once(tmp_path):
    torch.manual_seed(0)
    m = nn.Linear(64, 64)
    x = torch.randn(2, 64)
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(m, (x,)), path)
    want = m(x).detach()
    # In a child: a mapped program whose file is truncated dies of SIGBUS, as with any map.
    code = f"""
        import os, torch, kwexport
        prog = kwexport.load({str(path)!r}, mmap=False)
        size = os.path.getsize({str(path)!r})
        with open({str(path)!r}, "r+b") as f:  # overwritten in place, then truncated
            f.seek(size - 4096)
            f.write(b"\\xff" * 4096)
            f.truncate(1024)
        torch.save(prog(torch.load({str(tmp_path / "x.pt")!r})), {str(tmp_path / "out.pt")!r})
    """
    torch.save(x, tmp_path / "x.pt")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), want)


def test_mmap_false_travels_with_pickles(tmp_path):
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(nn.Linear(2, 2), (torch.randn(1, 2),)), path)

    def pickled_mmap(prog):
        loader, args = prog.__reduce__()
        return dict(zip(inspect.signature(loader).parameters, args))["mmap"]

    assert pickled_mmap(pickle.loads(pickle.dumps(kwexport.load(path, mmap=False)))) is False
    assert pickled_mmap(kwexport.load(path)) is True
