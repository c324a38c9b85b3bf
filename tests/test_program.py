"""What a loaded Program exposes, and what loading does not do."""

import inspect
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from conftest import assert_same, in_threads

import kwexport


def signature_zoo(a, b=2, /, c=3.5, *rest, d, e="x", f=None, **kw):
    return a * b + c


def test_signature_is_the_original(roundtrip):
    prog = roundtrip(signature_zoo, (torch.ones(2),), {"d": 1})
    assert inspect.signature(prog) == inspect.signature(signature_zoo)
    assert prog.__name__ == "signature_zoo"
    assert "signature_zoo(a, b=2, /, c=3.5, *rest, d, e='x', f=None, **kw)" in repr(prog)
    assert_same(prog(torch.full((2,), 3.0), d=1), signature_zoo(torch.full((2,), 3.0), d=1))


def test_extra_files_and_metadata(roundtrip):
    prog = roundtrip(lambda x: x + 1, (torch.ones(2),), extra_files={"README.txt": "héllo", "meta/blob": b"\x00\xff"})
    assert prog.extra_files == {"README.txt": "héllo", "meta/blob": b"\x00\xff"}
    assert prog.format_version == kwexport.FORMAT_VERSION
    assert prog.producer["torch"] == torch.__version__
    assert prog.producer["kwexport"] == kwexport.__version__


def test_save_replaces_atomically(tmp_path, monkeypatch):
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(lambda x: x + 1, (torch.ones(2),)), path)
    before = path.read_bytes()
    ex = kwexport.export(lambda x: x + 2, (torch.ones(2),))

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    try:
        kwexport.save(ex, path)
    except OSError as e:
        assert e.errno == 28
    else:
        raise AssertionError("save should have failed")
    assert path.read_bytes() == before  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["m.kwx"]  # no temp file left behind
    monkeypatch.undo()
    assert_same(kwexport.load(path)(torch.ones(2)), torch.full((2,), 2.0))


def test_fresh_process_loads_without_export_machinery_or_pickle(tmp_path):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, *, scale):
            return self.lin(x) * scale

    m = M()
    x = torch.randn(2, 4)
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(m, (x,), {"scale": 2.0}), path)
    torch.save((x, m(x, scale=2.0).detach()), tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import pickle, sys
        import torch
        x, want = torch.load({str(tmp_path / "io.pt")!r})
        def refuse(*a, **k):
            raise AssertionError("pickle used while loading")
        pickle.loads = pickle.load = refuse
        pickle.Unpickler = refuse
        import kwexport
        prog = kwexport.load({str(path)!r})
        assert torch.allclose(prog(x, scale=2.0), want)
        banned = [m for m in ("sympy", "torch._dynamo", "torch._export.serde", "torch._inductor")
                  if m in sys.modules]
        assert not banned, banned
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_threads_share_one_program(roundtrip):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    prog = roundtrip(m, (torch.randn(4, 16),))
    inputs = [torch.randn(4, 16) for _ in range(8)]
    want = [prog(x) for x in inputs]
    results = [None] * 8

    def work(i):
        for _ in range(50):
            results[i] = prog(inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, w in zip(results, want):
        assert torch.equal(got, w)


def test_loading_from_threads(tmp_path):
    path = tmp_path / "m.kwx"
    m = torch.nn.Linear(3, 3)
    kwexport.save(kwexport.export(m, (torch.ones(1, 3),)), path)
    progs = []
    in_threads(lambda: progs.append(kwexport.load(path)), 8)
    assert len(progs) == 8
    x = torch.randn(1, 3)
    for p in progs:
        assert torch.allclose(p(x), m(x))


def test_worker_threads_use_torchs_thread_count(tmp_path):
    # OpenMP's thread count is per thread: a thread Python starts has every core, whatever
    # torch.set_num_threads said, until torch initialises it; a Program does that first.
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(torch.nn.Linear(32, 32), (torch.ones(4, 32),)), path)
    script = textwrap.dedent("""
        import ctypes, os, sys, threading
        import torch, kwexport
        torch.set_num_threads(1)
        gomp = [l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l]
        if not gomp or os.cpu_count() < 2:
            print("skip"); sys.exit()
        omp_threads = ctypes.CDLL(gomp[0]).omp_get_max_threads
        prog = kwexport.load(sys.argv[1])
        seen = {}
        def work(key, call):
            if call:
                prog(torch.ones(4, 32))
            seen[key] = omp_threads()
        for key, call in (("plain", False), ("program", True)):
            t = threading.Thread(target=work, args=(key, call)); t.start(); t.join()
        print(seen["plain"], seen["program"])
    """)
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "skip":
        pytest.skip("needs torch's libgomp and two cores")
    plain, program = map(int, out.stdout.split())
    assert plain == os.cpu_count()  # what the fix is for: the thread's default
    assert program == 1


def test_pickles_by_reference(tmp_path):
    import pickle

    m = torch.nn.Linear(256, 256)  # 256 KB of weights
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(m, (torch.ones(1, 256),)), path)
    prog = kwexport.load(path)
    blob = pickle.dumps(prog)
    assert len(blob) < 1000  # the path and a hash, not the weights
    again = pickle.loads(blob)
    x = torch.randn(1, 256)
    assert torch.equal(again(x), prog(x))
    # A file that changed since: refused on arrival.
    kwexport.save(kwexport.export(torch.nn.Linear(256, 256), (torch.ones(1, 256),)), path)
    with pytest.raises(kwexport.ArtifactError, match=r"changed since the program was pickled"):
        pickle.loads(blob)


def test_spawn_pool_workers_map_the_same_file(tmp_path):
    import multiprocessing

    import pool_worker

    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(m, (torch.ones(2, 8),)), path)
    prog = kwexport.load(path)
    inputs = [torch.randn(2, 8) for _ in range(8)]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.map(pool_worker.call, [(prog, x) for x in inputs])
    assert len({pid for pid, _ in results}) > 1
    for (_, got), x in zip(results, inputs):
        assert torch.allclose(got, m(x))
