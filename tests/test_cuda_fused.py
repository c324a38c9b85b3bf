"""kwexport's fused elementwise ops for CUDA (``kwexport._cuda_fused``; the ``add_norm`` and
``rotary`` passes): what they compute off their kernels, on their kernels (Triton's
interpreter on the CPU, and on the device), and what a program loaded at ``fast`` with CUDA
graphs runs."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import causal_lm, cuda_decoder
from torch import nn

import kwexport
from kwexport import _cuda_fused, _passes

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA is not available")


def originals(x, r, w, b, q, cos, sin):  # noqa: PLR0917 (inputs()'s tuple)
    """What the passes replaced, op by op, as the graph held them."""
    s = x + r
    halves = [-q[..., 32:], q[..., :32]]
    return {
        "layer_norm": (torch.layer_norm(s, [96], w, b, 1e-5), s),
        "rms_norm": (torch.rms_norm(s, [96], w, 1e-6), s, s),
        "rotary": q * cos + torch.cat(halves, -1) * sin,
    }


def fused(x, r, w, b, q, cos, sin):  # noqa: PLR0917 (inputs()'s tuple)
    _passes.define_ops()
    ops = torch.ops.kwexport
    return {
        "layer_norm": ops.add_norm.layer_norm(x, r, [96], w, b, 1e-5),
        "rms_norm": ops.add_norm.rms_norm(x, r, [96], w, 1e-6, None),
        "rotary": ops.rotary_embedding(q, cos, sin, 3, -1, 32),
    }


def inputs(dtype, device="cpu"):
    torch.manual_seed(0)
    t = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)  # noqa: E731
    # The query transposed as attention's is: [batch, heads, positions, 64], strided.
    q = t(2, 7, 4, 64).transpose(1, 2)
    return t(3, 5, 96), t(3, 5, 96), t(96), t(96), q, t(2, 1, 7, 64), t(2, 1, 7, 64)


def test_off_their_kernels_the_ops_compute_what_they_replaced():
    # On a CPU tensor (no Triton interpreter asked for) each form runs the replaced ops.
    args = inputs(torch.float32)
    got, want = fused(*args), originals(*args)
    for name in ("layer_norm", "rms_norm"):
        assert all(torch.equal(g, w) for g, w in zip(got[name], want[name])), name
    assert torch.equal(got["rotary"], want["rotary"])
    # A cast between the add and the RMS norm (a reduced-precision Llama's) is kept.
    x, r, w = args[0], args[1], args[2].bfloat16()
    y, s, cast = torch.ops.kwexport.add_norm.rms_norm(x, r, [96], w, 1e-6, torch.bfloat16)
    assert torch.equal(y, torch.rms_norm((x + r).bfloat16(), [96], w, 1e-6)) and torch.equal(s, x + r)
    assert torch.equal(cast, (x + r).bfloat16())
    # Halves along another dimension than the cat's, or split anywhere: still the same ops.
    q, cos, sin = args[4:]
    other = torch.ops.kwexport.rotary_embedding(q, cos, sin, 3, -1, 24)
    assert torch.equal(other, q * cos + torch.cat([-q[..., 24:], q[..., :24]], -1) * sin)


def test_off_their_kernels_under_autograd(monkeypatch):
    # A tensor autograd records takes the replaced ops (the kernels have no backward), even
    # where the kernels would run (Triton's interpreter asked for, on the CPU).
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _passes.define_ops()
    x, r, w, b = (t.requires_grad_() for t in inputs(torch.float32)[:4])
    assert _cuda_fused._on_kernel(x.detach(), r.detach()) and not _cuda_fused._on_kernel(x.detach(), r)
    y, s = torch.ops.kwexport.add_norm.layer_norm(x, r, [96], w, b, 1e-5)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


INTERPRETED = """
import torch
from test_cuda_fused import fused, inputs, originals
# The interpreter's bfloat16 casts round toward zero (the device's to nearest): the sum may be
# a unit in the last place off the add's, and the norm of it by as much over its spread.
for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
    args = inputs(dtype)
    got, want = fused(*args), originals(*args)
    for name in ("layer_norm", "rms_norm"):
        torch.testing.assert_close(got[name][0], want[name][0], rtol=tol, atol=tol)
        torch.testing.assert_close(got[name][1], want[name][1], rtol=tol / 2, atol=0)
    torch.testing.assert_close(got["rotary"], want["rotary"], rtol=tol, atol=tol)
    assert got["rotary"].stride() == want["rotary"].stride()
    from kwexport._cuda_fused import bias_gelu_
    y, b = torch.randn(5, 300, dtype=dtype) * 3, torch.randn(300, dtype=dtype)
    for form in ("none", "tanh"):
        want = torch.nn.functional.gelu(y.float() + b.float(), approximate=form)
        torch.testing.assert_close(bias_gelu_(y.clone(), b, form).float(), want, rtol=tol, atol=tol)
print("ok")
"""


def test_the_triton_kernels_match_the_ops_they_replace():
    # Triton's interpreter runs the kernels on the CPU: their index arithmetic and numerics,
    # strided and broadcast inputs included. Within a unit in the last place of the dtype.
    pytest.importorskip("triton")
    path = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_device_the_kernels_match_the_ops(dtype):
    args = inputs(dtype, "cuda")
    got, want = fused(*args), originals(*args)
    for name in ("layer_norm", "rms_norm"):
        assert torch.equal(got[name][1], want[name][1]), "the sum is the add's, bit for bit"
    # The kernels compute in float32 and round once, where the ops rounded after each (in
    # bfloat16 the rotation's two products cancel, and the ops' result is the rougher): each
    # matches the ops computed in float32 from the same inputs, to the dtype's precision.
    precise = originals(*[a.float() for a in args])
    precise["layer_norm"] = (torch.layer_norm(want["layer_norm"][1].float(), [96], *[a.float() for a in args[2:4]]),)
    precise["rms_norm"] = (torch.rms_norm(want["rms_norm"][1].float(), [96], args[2].float(), 1e-6),)
    tol = {"rtol": 2e-6, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}
    for name in ("layer_norm", "rms_norm"):
        torch.testing.assert_close(got[name][0].float(), precise[name][0], **tol)
    torch.testing.assert_close(got["rotary"].float(), precise["rotary"], **tol)


class PreNorm(nn.Module):
    """A pre-norm block (GPT-2's, ViT's): the sum read again as the next residual."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        h = x + self.a(self.ln1(x))
        return h + self.b(self.ln2(h))


def ran_ops(prog, *args, **kwargs):
    return {r["op"] for r in prog.profile(*args, **kwargs)}


@needs_cuda
def test_fast_with_graphs_runs_the_fused_norms_and_replays_them(tmp_path):
    torch.manual_seed(0)
    m = PreNorm().eval()
    path = tmp_path / "prenorm.kwx"
    kwexport.save(kwexport.export(m, (torch.randn(4, 32),)), path)
    prog = kwexport.load(path, device="cuda", optimize="fast", cuda_graphs=True)
    x = torch.randn(4, 32, device="cuda")
    first = prog(x)
    assert "kwexport::add_norm.layer_norm" in ran_ops(prog, x)
    assert all(torch.equal(prog(x), first) for _ in range(3)), "replays equal the first call"
    with torch.no_grad():
        torch.testing.assert_close(first, m.cuda()(x), rtol=1e-5, atol=1e-5)
    # Without graphs the passes don't run (a kernel more or less costs host time there).
    plain = kwexport.load(path, device="cuda", optimize="fast")
    assert not any(op.startswith("kwexport::add_norm") for op in ran_ops(plain, x))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_at_fast_with_graphs_fuses_its_norms_and_rotary_embedding(tmp_path, dtype):
    pytest.importorskip("transformers")
    model = causal_lm("llama").to(dtype)
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    path = tmp_path / "llama.kwx"
    kwargs = {"input_ids": ids, "use_cache": False}
    kwexport.save(kwexport.export(model, (), kwargs), path)
    prog = kwexport.load(path, device="cuda", optimize="fast", cuda_graphs=True)
    dids = ids.cuda()
    first = prog(input_ids=dids, use_cache=False)
    ran = ran_ops(prog, input_ids=dids, use_cache=False)
    assert {"kwexport::add_norm.rms_norm", "kwexport::rotary_embedding.default"} <= ran, ran
    again = prog(input_ids=dids, use_cache=False)
    assert torch.equal(again["logits"], first["logits"])
    with torch.no_grad():
        want = model.cuda()(input_ids=dids, use_cache=False).logits
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(first["logits"], want, rtol=tol, atol=tol)


@needs_cuda
def test_greedy_generation_at_fast_with_graphs_matches_transformers(tmp_path):
    path, prompt, want = cuda_decoder(tmp_path)
    prog = kwexport.load(path, device="cuda", optimize="fast", cuda_graphs=True)
    assert prog.generate(prompt, max_new_tokens=24).tolist() == want.tolist()
