"""CUDA graphs (`kwexport.load(..., cuda_graphs=True)`): calls captured per input signature
and replayed give what the program gives without them, after input, shape and state changes,
on other streams and from two threads; what can't be captured runs as usual and says why.
The options are checked everywhere; the rest needs CUDA."""

import pickle
import subprocess
import sys
import threading

import pytest
import torch
from conftest import cuda_decoder
from torch import nn

import kwexport

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA is not available")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x, *, scale: float = 1.0):
        h = torch.nn.functional.gelu(self.a(x))
        return {"y": self.b(h) * scale, "n": h.norm(dim=-1)}


class Counter(nn.Module):
    """State written every call, and an input mutated in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x, seen):
        self.total.add_(x.sum(0))
        seen.add_(1)
        return self.total * 2


def saved(tmp_path, m, args, name="m.kwx", **export_kwargs):
    torch.manual_seed(0)
    path = tmp_path / name
    f = m.eval() if isinstance(m, nn.Module) else m
    kwexport.save(kwexport.export(f, args, **export_kwargs), path)
    return path


def block(tmp_path):
    torch.manual_seed(0)
    m = Block()
    batch = torch.export.Dim("batch", min=1, max=64)
    return m, saved(tmp_path, m, (torch.randn(4, 16),), dynamic_shapes={"x": {0: batch}, "scale": None})


def test_options_are_checked(tmp_path):
    path = saved(tmp_path, Block(), (torch.randn(4, 16),))
    with pytest.raises(ValueError, match="^cuda_graphs=True needs a CUDA device; this program runs on cpu$"):
        kwexport.load(path, cuda_graphs=True)
    with pytest.raises(TypeError, match="^cuda_graphs must be a bool or a kwexport.CudaGraphs, not str$"):
        kwexport.load(path, cuda_graphs="yes")
    with pytest.raises(ValueError, match=r"^CudaGraphs.max_graphs must be an int of at least 1, not 0$"):
        kwexport.CudaGraphs(max_graphs=0)
    with pytest.raises(ValueError, match=r"^CudaGraphs.warmup must be an int of at least 1, not 0$"):
        kwexport.CudaGraphs(warmup=0)
    # Off is the default, and a CPU program's dispatch has no graphs entry.
    assert "cuda_graphs" not in kwexport.load(path, cuda_graphs=False).dispatch


def test_inspect_says_whether_calls_can_be_captured(tmp_path):
    def nonzero(x):
        return torch.nonzero(x).float().sum() + x.sum()

    paths = [saved(tmp_path, Block(), (torch.randn(4, 16),)), saved(tmp_path, nonzero, (torch.randn(8),), "nz.kwx")]
    lines = [
        next(line for line in out.splitlines() if line.startswith("cuda graphs:"))
        for out in (
            subprocess.run([sys.executable, "-m", "kwexport", "inspect", str(p)], capture_output=True, text=True).stdout
            for p in paths
        )
    ]
    assert lines == [
        "cuda graphs:  capturable (no op reads a value on the host)",
        "cuda graphs:  node by node: aten::nonzero.default reads a tensor's value on the host",
    ]


def same(a, b):
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


@needs_cuda
@pytest.mark.parametrize("optimize", ["exact", "fast"])
def test_replays_match_the_plain_program_as_inputs_and_shapes_change(tmp_path, optimize):
    _, path = block(tmp_path)
    plain = kwexport.load(path, device="cuda", optimize=optimize)
    graphed = kwexport.load(path, device="cuda", optimize=optimize, cuda_graphs=kwexport.CudaGraphs(max_graphs=2))
    outs = []
    for batch in [4, 4, 4, 5, 5, 7, 7, 4, 1]:
        x = torch.randn(batch, 16, device="cuda")
        got = graphed(x)
        if optimize == "exact":
            assert same(got, plain(x)), batch
        else:  # `linear_measured` may choose another GEMM with graphs: float rounding apart
            torch.testing.assert_close(got, plain(x), rtol=1e-5, atol=1e-5)
        outs.append((got, {k: v.clone() for k, v in got.items()}))
    # Outputs are copies: a later replay doesn't overwrite what an earlier call returned.
    assert all(same(got, want) for got, want in outs)
    info = graphed.dispatch["cuda_graphs"]
    # Batches 4, 5 and 7 each seen twice: three captures, two graphs kept (4 dropped first).
    assert info == {"graphs": 2, "captures": 3, "why_not": None}


def test_measured_linears_compute_the_exported_ops():
    # Off CUDA (and for what no choice covers) the forms run the exported op itself.
    from kwexport import _cuda_gemm, _passes

    _passes.define_ops()
    x, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(torch.ops.kwexport.linear_measured(x, w, b), nn.functional.linear(x, w, b))
    x2 = x.reshape(6, 8)
    assert torch.equal(torch.ops.kwexport.linear_measured.addmm(b, x2, w.t()), torch.addmm(b, x2, w.t()))
    # Each candidate the device may choose computes the same product and bias.
    for how in _cuda_gemm.CANDIDATES:
        torch.testing.assert_close(_cuda_gemm._run(how, b, x2, w.t()), torch.addmm(b, x2, w.t()))
    # With the GELU after it, in either form: the exported ops, bit for bit off CUDA.
    gelu = nn.functional.gelu
    for form in ("none", "tanh"):
        want = gelu(nn.functional.linear(x, w, b), approximate=form)
        assert torch.equal(torch.ops.kwexport.linear_measured.gelu(x, w, b, form), want)
        want = gelu(torch.addmm(b, x2, w.t()), approximate=form)
        assert torch.equal(torch.ops.kwexport.linear_measured.addmm_gelu(b, x2, w.t(), form), want)
        # Under autograd too, through the ops' own derivatives.
        xg = x2.clone().requires_grad_()
        torch.ops.kwexport.linear_measured.addmm_gelu(b, xg, w.t(), form).sum().backward()
        assert xg.grad is not None


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_device_every_gemm_candidate_computes_the_product(dtype):
    from kwexport import _cuda_gemm

    torch.manual_seed(0)
    x, w, b = (torch.randn(*s, device="cuda", dtype=dtype) for s in ((6, 64), (96, 64), (96,)))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for form in (None, "none", "tanh"):
        y = torch.addmm(b.float(), x.float(), w.t().float())
        want = y if form is None else nn.functional.gelu(y, approximate=form)
        for how in _cuda_gemm.candidates(form):
            got = _cuda_gemm._run(how, b, x, w.t(), form)
            torch.testing.assert_close(got.float(), want, **tol, msg=f"{how}, GELU {form}")


class Projections(nn.Module):
    """Three projections of one input (an attention block's), and a GELU MLP of another (a
    linear of the same input would join the three)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, 24), nn.Linear(32, 24), nn.Linear(32, 32)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = nn.functional.gelu(self.up(x.relu()), approximate="tanh")
        return self.down(h) + (q * k).sum(-1, keepdim=True) + v


@needs_cuda
def test_fast_with_graphs_joins_projections_and_their_gelus(tmp_path):
    # `linear_concat`: q, k and v as one GEMM and slices; `linear_measured`: the up projection
    # and its GELU as one node.
    m = Projections()
    path = saved(tmp_path, m, (torch.randn(5, 32),))
    prog = kwexport.load(path, device="cuda", optimize="fast", cuda_graphs=True)
    x = torch.randn(5, 32, device="cuda")
    first = prog(x)
    ran = [r["op"] for r in prog.profile(x)]
    assert ran.count("aten::slice.Tensor") == 3 and "aten::gelu.default" not in ran, ran
    assert ran.count("kwexport::linear_measured.default") == 2 and "kwexport::linear_measured.gelu" in ran, ran
    for _ in range(3):
        assert torch.equal(prog(x), first)
    with torch.no_grad():
        torch.testing.assert_close(first, m.cuda()(x), rtol=1e-5, atol=1e-5)


def test_measured_linears_load_from_a_file_and_run_anywhere(tmp_path):
    # The ops `linear_measured` inserts load from a file too (as every pass op does), and off
    # CUDA run what they replaced.
    import json

    import kwexport._cli

    class Conv1D(nn.Module):  # a linear, then GPT-2's Conv1D: addmm(bias, x, w), w as [k, n]
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.w, self.b = nn.Parameter(torch.randn(8, 5)), nn.Parameter(torch.randn(5))

        def forward(self, x):
            return torch.addmm(self.b, torch.relu(self.lin(x)), self.w)

    m = Conv1D().eval()
    x = torch.randn(3, 8)
    path = saved(tmp_path, m, (x,))
    d = kwexport._rt.describe(str(path))
    header = json.loads(d["header"])
    ops = header["methods"]["forward"]["ops"]
    renamed = {
        "aten::linear.default": "kwexport::linear_measured.default",
        "aten::addmm.default": "kwexport::linear_measured.addmm",
    }
    assert {o["name"] for o in ops} >= set(renamed)
    for o in ops:
        o["name"], o["schema"] = renamed.get(o["name"], o["name"]), None
    with open(path, "rb") as f:
        f.seek(d["data_offset"])
        data = f.read()
    out = tmp_path / "measured.kwx"
    kwexport._cli.write_atomic(str(out), kwexport._rt.container_head(json.dumps(header).encode()), [(0, data)])
    prog = kwexport.load(out)
    ran = {r["op"] for r in prog.profile(x)}
    assert {"kwexport::linear_measured.default", "kwexport::linear_measured.addmm"} <= ran, ran
    with torch.no_grad():
        assert torch.equal(prog(x), m(x))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_chooses_each_biased_linears_gemm_on_the_device(tmp_path, dtype):
    from kwexport import _cuda_gemm

    torch.manual_seed(0)
    m = Block().to(dtype)
    # Three rows: a shape no other test measures.
    path = saved(tmp_path, m, (torch.randn(3, 16, dtype=dtype),), name=f"{dtype}.kwx")
    prog = kwexport.load(path, device="cuda", optimize="fast", cuda_graphs=True)
    x = torch.randn(3, 16, device="cuda", dtype=dtype)
    first = prog(x)  # node by node: times both linears' GEMMs, then runs the fastest
    mine = {k: v for k, v in _cuda_gemm.chosen().items() if k[0] in [(3, 16), (3, 32)] and k[3] == dtype}
    assert len(mine) == 2 and set(mine.values()) <= set(_cuda_gemm.CANDIDATES), mine
    for _ in range(3):  # captured, then replayed: the same choices, the same bits
        assert same(prog(x), first)
    assert prog.dispatch["cuda_graphs"]["captures"] == 1
    with torch.no_grad():
        want = m.cuda()(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(first["y"], want["y"], rtol=tol, atol=tol)


@needs_cuda
def test_reused_outputs_are_the_graphs_own(tmp_path):
    _, path = block(tmp_path)
    prog = kwexport.load(path, device="cuda", cuda_graphs=kwexport.CudaGraphs(reuse_outputs=True))
    x1, x2 = torch.randn(4, 16, device="cuda"), torch.randn(4, 16, device="cuda")
    prog(x1)
    a = prog(x1)
    b = prog(x2)
    assert a["y"].data_ptr() == b["y"].data_ptr() and torch.equal(a["y"], b["y"])


@needs_cuda
def test_state_and_mutated_inputs_update_in_place(tmp_path):
    path = saved(tmp_path, Counter(), (torch.randn(3, 4), torch.zeros(2)))
    prog = kwexport.load(path, device="cuda", cuda_graphs=True)
    eager = Counter().cuda()
    seen, eager_seen = torch.zeros(2, device="cuda"), torch.zeros(2, device="cuda")
    for _ in range(6):
        x = torch.randn(3, 4, device="cuda")
        assert torch.equal(prog(x, seen), eager(x, eager_seen))
        assert torch.equal(seen, eager_seen)
    assert torch.equal(prog.state["total"], eager.total)
    assert prog.dispatch["cuda_graphs"]["captures"] == 1, prog.dispatch["cuda_graphs"]
    prog.reset()
    assert torch.equal(prog(torch.ones(3, 4, device="cuda"), seen), torch.full((4,), 6.0, device="cuda"))


@needs_cuda
def test_other_streams_and_two_threads_see_their_own_results(tmp_path):
    m, path = block(tmp_path)
    m = m.cuda()
    prog = kwexport.load(path, device="cuda", cuda_graphs=True)
    failures = []

    def worker(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(40):
                x = torch.randn(4, 16, device="cuda", generator=g)
                got, want = prog(x)["y"], m(x)["y"]
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    failures.append(seed)
        stream.synchronize()

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    info = prog.dispatch["cuda_graphs"]
    assert info["captures"] == 1, info


@needs_cuda
def test_what_cant_be_captured_runs_as_usual_and_says_why(tmp_path):
    def masked(x):
        return x[x > 0].sum() + x.mean()

    path = saved(tmp_path, masked, (torch.randn(8),))
    plain = kwexport.load(path, device="cuda")
    prog = kwexport.load(path, device="cuda", cuda_graphs=True)
    for _ in range(4):
        x = torch.randn(8, device="cuda")
        assert torch.equal(prog(x), plain(x))
    why = prog.dispatch["cuda_graphs"]["why_not"]
    assert why is not None and (why.startswith("capturing a call failed: ") or "reads a tensor's value" in why), why
    # The failed capture left the default generator usable, and the program too.
    torch.randn(3, device="cuda")
    assert torch.equal(prog(x), plain(x))

    def nonzero(x):
        return torch.nonzero(x).float().sum() + x.sum()

    path = saved(tmp_path, nonzero, (torch.randn(8),), name="nz.kwx")
    prog = kwexport.load(path, device="cuda", cuda_graphs=True)
    x = torch.randn(8, device="cuda")
    assert prog(x) == prog(x) == kwexport.load(path, device="cuda")(x)
    assert prog.dispatch["cuda_graphs"] == {
        "graphs": 0,
        "captures": 0,
        "why_not": "aten::nonzero.default reads a tensor's value on the host",
    }


@needs_cuda
def test_graph_options_travel_with_pickles(tmp_path):
    _, path = block(tmp_path)
    prog = kwexport.load(path, device="cuda", cuda_graphs=kwexport.CudaGraphs(max_graphs=3))
    again = pickle.loads(pickle.dumps(prog))
    x = torch.randn(4, 16, device="cuda")
    for _ in range(3):
        assert same(again(x), prog(x))
    assert again.dispatch["cuda_graphs"]["captures"] == 1, again.dispatch["cuda_graphs"]


@needs_cuda
def test_greedy_generation_replays_its_decode_step(tmp_path):
    path, prompt, want = cuda_decoder(tmp_path)
    plain = kwexport.load(path, device="cuda")
    prog = kwexport.load(path, device="cuda", cuda_graphs=True)
    got = prog.generate(prompt, max_new_tokens=24)
    assert got.tolist() == plain.generate(prompt, max_new_tokens=24).tolist() == want.tolist()
    assert prog.dispatch["cuda_graphs"]["captures"] == 1, prog.dispatch["cuda_graphs"]
    # Again from position 0 (the cache rewritten in place, the graph replayed), and sampled
    # with a seed as without graphs.
    assert prog.generate(prompt, max_new_tokens=24).tolist() == want.tolist()
    sampled = dict(do_sample=True, top_k=20, seed=3)
    assert prog.generate(prompt, 16, **sampled).tolist() == plain.generate(prompt, 16, **sampled).tolist()
