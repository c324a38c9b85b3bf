"""Optimization levels: `exact` is eager's bits; `fast` changes kernels and layouts within the
tolerance docs/optimize.md states (convolution weights held channels-last)."""

import json
import os
import pathlib
import pickle
import subprocess
import sys

import pytest
import torch
from conftest import assert_same, with_each_kernel
from torch import nn

import kwexport
import kwexport._cli

torchvision = pytest.importorskip("torchvision")


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def kwexport_bf16_gemm() -> bool:
    """Whether kwexport's bfloat16 GEMM runs here (AVX512-BF16, with the AVX-512 family)."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    avx512 = kwexport.kernel_info()["isa"] == "avx512"
    return avx512 and cpuinfo.exists() and "avx512_bf16" in cpuinfo.read_text()


def own_kernels() -> bool:
    """Whether kwexport's own kernels run here, on any instruction set (else torch's do, and
    results are eager's or oneDNN's)."""
    return kwexport.kernel_info()["isa"] is not None


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_fast_conv_nets_stay_within_tolerance(name, tmp_path):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    assert (exact.optimize, fast.optimize) == ("exact", "fast")
    with torch.no_grad():
        want = model(x)
    assert_same(exact(x), want, bitwise=True)
    got = fast(x)
    assert rel_err(got, want) < 1e-4
    assert not torch.equal(got, want)  # other kernels ran: the level is not a no-op


class ConvView(nn.Module):
    """A `view` of a convolution's output: impossible on a channels-last tensor."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        h = self.conv(x).relu()
        return self.fc(h.view(h.shape[0], -1))


def test_fast_runs_views_of_channels_last_tensors(tmp_path):
    torch.manual_seed(0)
    m, x = ConvView().eval(), torch.randn(2, 3, 6, 6)
    path = tmp_path / "cv.kwx"
    kwexport.save(kwexport.export(m, (x,)), path)
    with torch.no_grad():
        want = m(x)
        cl = m.to(memory_format=torch.channels_last)
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            cl(x)  # what running the graph as exported on channels-last weights would do
    fast = kwexport.load(path, optimize="fast")
    assert rel_err(fast(x), want) < 1e-4
    assert "aten::view.default" not in {o["op"] for o in fast.profile(x)}


def test_the_level_is_checked_and_travels_with_pickles(tmp_path):
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(nn.Linear(2, 2), (torch.randn(1, 2),)), path)
    with pytest.raises(ValueError, match=r"^optimize must be 'exact' or 'fast', not 'fastest'$"):
        kwexport.load(path, optimize="fastest")
    assert pickle.loads(pickle.dumps(kwexport.load(path, optimize="fast"))).optimize == "fast"
    assert pickle.loads(pickle.dumps(kwexport.load(path))).optimize == "exact"


class RMSNorm(nn.Module):
    """Llama's RMSNorm, as transformers writes it."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.rand(n) + 0.5), eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class LlamaRMSNorm(RMSNorm):
    """transformers' LlamaRMSNorm: the norm in float32 between two casts."""

    def forward(self, x):
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + self.eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_fuses_a_reduced_precision_rms_norm_between_its_casts(tmp_path, dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64).to(dtype)
    x = torch.randn(2, 7, 64, dtype=dtype) * 3
    path = tmp_path / "norm.kwx"
    kwexport.save(kwexport.export(norm, (x,)), path)
    fast = kwexport.load(path, optimize="fast")
    ran = [n["op"] for n in fast.profile(x)]
    assert ran.count("aten::rms_norm.default") == 1 and "aten::rsqrt.default" not in ran, ran
    with torch.no_grad():
        want = norm(x)
    got = fast(x)
    # torch's rms_norm rounds once where the module rounds before the weight, then after it.
    assert got.dtype == dtype and rel_err(got, want) < 1e-2
    # A float32 input to the same module (a bfloat16 weight): not the pattern, run as exported.
    xf = x.float()
    path32 = tmp_path / "norm32.kwx"
    kwexport.save(kwexport.export(norm, (xf,)), path32)
    with torch.no_grad():
        assert_same(kwexport.load(path32, optimize="fast")(xf), norm(xf), bitwise=True)


def test_fast_fuses_rms_norm_into_one_kernel(tmp_path):
    torch.manual_seed(0)
    norm = RMSNorm(80)

    def f(x, y):
        return norm(x), norm(y.transpose(0, 1)), norm(x.double())

    x, y = torch.randn(3, 5, 80) * 4, torch.randn(5, 3, 80)
    path = tmp_path / "norm.kwx"
    kwexport.save(kwexport.export(f, (x, y)), path)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    with torch.no_grad():
        want = f(x, y)
    assert_same(exact(x, y), want, bitwise=True)
    ran = [n["op"] for n in fast.profile(x, y)]
    # Each norm is one node: kwexport's kernel for the contiguous float32 one, torch's
    # rms_norm for the transposed and the float64 ones.
    assert ran.count("aten::rms_norm.default") == 3 and "aten::rsqrt.default" not in ran
    with torch.profiler.profile() as prof:
        fast(x, y)
    assert [e.name for e in prof.events()].count("aten::rms_norm") == 2  # kwexport's kernel is not torch's
    for got, w in zip(fast(x, y), want):
        assert got.dtype == w.dtype and got.shape == w.shape
        assert rel_err(got, w) < 1e-6
    for dispatch in ("python", "abi"):
        for got, w in zip(kwexport.load(path, optimize="fast", dispatch=dispatch)(x, y), want):
            assert rel_err(got, w) < 1e-6


class NormedConvNet(nn.Module):
    """A conv chain and an RMS norm: both of fast's rewrites."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
        self.norm = RMSNorm(8)

    def forward(self, x):
        h = self.conv(x).mean((2, 3))
        return self.norm(h)


def test_offline_optimized_files_run_fast_with_a_plain_load(tmp_path):
    import subprocess
    import sys

    torch.manual_seed(0)
    model = NormedConvNet().eval()
    x = torch.randn(2, 3, 16, 16)
    ex = kwexport.export(model, (x,))
    plain, saved, converted = tmp_path / "plain.kwx", tmp_path / "saved.kwx", tmp_path / "converted.kwx"
    kwexport.save(ex, plain, extra_files={"notes.txt": "hi"})
    kwexport.save(ex, saved, optimize="fast", extra_files={"notes.txt": "hi"})
    out = subprocess.run(
        [sys.executable, "-m", "kwexport", "optimize", str(plain), str(converted)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{converted}: optimized exact -> fast"
    online_prog = kwexport.load(plain, optimize="fast")
    online, online_ops = online_prog(x), [n["op"] for n in online_prog.profile(x)]
    with torch.no_grad():
        want = model(x)
    for path in (saved, converted):
        info = json.loads(kwexport._rt.describe(str(path))["description"])
        assert info["optimized"] == "fast"
        assert "aten::rms_norm.default" in info["methods"]["forward"]["ops"]
        # The conv weights are stored channels-last: a plain load runs at fast, and asking
        # for exact can't undo what the file holds.
        header = json.loads(kwexport._rt.describe(str(path))["header"])
        w = header["weights"]["tensors"]["conv.0.weight"]
        assert w["strides"] == [27, 1, 9, 3]
        for prog in (kwexport.load(path), kwexport.load(path, optimize="exact")):
            assert prog.optimize == "fast" and prog.extra_files == {"notes.txt": "hi"}
            got = prog(x)
            # The same rewrites as at load; kernels chosen by measuring may round otherwise.
            assert [n["op"] for n in prog.profile(x)] == online_ops
            assert rel_err(got, online) < 1e-6 and rel_err(got, want) < 1e-5
    # A second optimize is a no-op rewrite.
    again = tmp_path / "again.kwx"
    assert kwexport._cli.optimize(str(saved), str(again))["from"] == "fast"
    with pytest.raises(FileExistsError, match="exists; pass --force"):
        kwexport._cli.optimize(str(saved), str(again))


def test_fast_linear_on_few_rows_stays_within_tolerance(tmp_path):
    """At fast, a linear on a float32 matrix runs kwexport's kernel or torch's, whichever
    measured faster for that many rows; either stays within tolerance, with and without a
    bias, for 2-D and folded 3-D inputs, from one row to a hundred."""
    torch.manual_seed(0)

    class Conv1D(nn.Module):  # GPT-2's: addmm with a [k, n] weight
        def __init__(self, k, n):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(k, n) * 0.1), nn.Parameter(torch.randn(n))

        def forward(self, x):
            return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)

    model = nn.Sequential(nn.Linear(96, 200), nn.GELU(), nn.Linear(200, 50, bias=False), Conv1D(50, 30)).eval()
    path = tmp_path / "mlp.kwx"
    kwexport.save(kwexport.export(model, (torch.randn(2, 5, 96),), dynamic=True), path)
    fast = kwexport.load(path, optimize="fast")
    for shape in [(1, 1, 96), (2, 5, 96), (3, 3, 96), (1, 100, 96), (1, 7, 96)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            want = model(x)
        for _ in range(2):  # the first call for a shape measures, the second runs the choice
            got = fast(x)
            assert got.shape == want.shape and rel_err(got, want) < 1e-5, shape


def test_both_linear_kernels_run_in_place_of_each_other(tmp_path):
    """KWEXPORT_LINEAR_KERNEL forces the choice fast measures: torch's kernel gives eager's
    bits, kwexport's differs by rounding only, for few rows and for an encoder's many."""

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32, bias=False)).eval()
    x = torch.randn(2, 197, 64)
    path = tmp_path / "mlp.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch, kwexport\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"out = kwexport.load({str(path)!r}, optimize='fast')(x)\n"
        "torch.save(out, sys.argv[1])\n"
    )
    outs = with_each_kernel(tmp_path, script)
    with torch.no_grad():
        want = model(x)
    assert torch.equal(outs["torch"], want)
    assert rel_err(outs["kwexport"], want) < 1e-6
    if own_kernels():
        assert not torch.equal(outs["kwexport"], want)  # it did run: other rounding


def test_a_large_weights_kernels_take_turns_over_the_first_calls(tmp_path):
    """A linear whose weight a core's L2 doesn't hold (1 MiB or more) is measured in the model:
    its first ten calls run kwexport's GEMM and torch's in turn, each call's result the kernel
    that ran it (torch's: eager's bits), then the choice runs."""
    torch.manual_seed(0)
    model = nn.Linear(512, 1024).eval()  # 2 MiB
    x = torch.randn(8, 512)
    path = tmp_path / "wide.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    prog = kwexport.load(path, optimize="fast")
    with torch.no_grad():
        want = model(x)
    got = [prog(x) for _ in range(12)]
    assert all(rel_err(g, want) < 1e-5 for g in got)
    if own_kernels():
        bits = [torch.equal(g, want) for g in got[:10]]
        assert bits[1::2] == [True] * 5, "torch's turns give eager's bits"
        assert bits[0::2] == [False] * 5, "kwexport's turns round otherwise"
        assert torch.equal(got[10], got[11]), "then one kernel runs"


class ConvBlocks(nn.Module):
    """What `fast` folds and lowers, beside what it must leave alone: a 3×3 conv + BN + ReLU,
    a 1×1 conv with a bias + BN (no affine) + hardswish, a depthwise 5×5 conv + BN, two convs
    sharing one weight before batch norms (a fold would change the other), and a strided conv
    whose output is also returned."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.b = nn.Sequential(nn.Conv2d(16, 24, 1), nn.BatchNorm2d(24, affine=False), nn.Hardswish())
        self.c = nn.Sequential(nn.Conv2d(24, 24, 5, padding=2, groups=24, bias=False), nn.BatchNorm2d(24))
        self.shared = nn.Conv2d(24, 24, 3, padding=1, bias=False)
        self.bn1, self.bn2 = nn.BatchNorm2d(24), nn.BatchNorm2d(24)
        self.strided = nn.Conv2d(24, 8, 3, stride=2, dilation=2, padding=2)
        for bn in [self.a[1], self.b[1], self.c[1], self.bn1, self.bn2]:
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            if bn.affine:
                nn.init.uniform_(bn.weight, 0.5, 1.5)
                nn.init.uniform_(bn.bias, -0.5, 0.5)

    def forward(self, x):
        h = self.c(self.b(self.a(x)))
        h = self.bn1(self.shared(h)) + self.bn2(self.shared(h.relu()))
        s = self.strided(h)
        return s.sigmoid(), s


def conv_blocks(tmp_path):
    torch.manual_seed(0)
    model = ConvBlocks().eval()
    x = torch.randn(2, 3, 20, 20)
    path = tmp_path / "blocks.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    with torch.no_grad():
        want = model(x)
    return model, x, path, want


def test_fast_folds_batch_norms_and_lowers_convolutions(tmp_path):
    _, x, path, want = conv_blocks(tmp_path)
    fast = kwexport.load(path, optimize="fast")
    for got, w in zip(fast(x), want):
        assert rel_err(got, w) < 1e-5
    ran = [n["op"] for n in fast.profile(x)]
    onednn = torch.backends.mkldnn.is_available()
    # Three of five batch norms fold: the shared weight's two stay.
    assert ran.count("aten::batch_norm.default") == 2
    if onednn:
        # Every spatial kernel runs on oneDNN (the first with its ReLU as a post-op), the
        # shared weight's two unfolded; the 1×1 too where kwexport's GEMM can run it.
        lowered = 6 if own_kernels() else 5
        assert ran.count("mkldnn::_convolution_pointwise.default") == lowered
        assert ran.count("aten::conv2d.default") == 6 - lowered
        assert "aten::relu_.default" not in ran
    assert fast.dispatch["python"] == 0
    # Offline, the folds are written (the batch norms' tensors with them) and the graph keeps
    # torch's convolutions, which any torch loads.
    saved = tmp_path / "saved.kwx"
    kwexport._cli.optimize(str(path), str(saved))
    header = json.loads(kwexport._rt.describe(str(saved))["header"])
    ops = [o["name"] for o in header["methods"]["forward"]["ops"]]
    assert not any(o.startswith("mkldnn::") for o in ops)
    tensors = header["weights"]["tensors"]
    assert "a.1.running_mean" not in tensors and "bn1.running_mean" in tensors
    assert tensors["a.1.bias"]["shape"] == [16]  # holds the folded bias now
    for got, w in zip(kwexport.load(saved)(x), want):
        assert rel_err(got, w) < 1e-5


def test_fast_convolutions_pack_their_weights_once_across_threads(tmp_path):
    import threading

    _, x, path, want = conv_blocks(tmp_path)
    fast = kwexport.load(path, optimize="fast")
    results, barrier = [None] * 4, threading.Barrier(4)

    def call(i):
        barrier.wait()  # every thread's first call races to pack the weights
        results[i] = fast(x)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        assert all(torch.equal(g, r) for g, r in zip(got, results[0]))
        assert all(rel_err(g, w) < 1e-5 for g, w in zip(got, want))


def test_fast_convolutions_under_autograd_run_the_python_op(tmp_path):
    _, x, path, want = conv_blocks(tmp_path)
    fast = kwexport.load(path, optimize="fast")
    with torch.enable_grad():
        got = fast(x.clone().requires_grad_())
    for g, w in zip(got, want):
        assert rel_err(g.detach(), w) < 1e-5


@pytest.mark.skipif(not kwexport._rt.stable_abi_available(), reason="needs torch's stable C ABI")
def test_without_the_onednn_shim_fast_keeps_torchs_convolutions(tmp_path):
    import subprocess
    import sys

    _, x, path, want = conv_blocks(tmp_path)
    torch.save((x, want), tmp_path / "io.pt")
    code = f"""
import torch, kwexport
x, want = torch.load({str(tmp_path / "io.pt")!r})
fast = kwexport.load({str(path)!r}, optimize="fast")
ran = [n["op"] for n in fast.profile(x)]
assert "mkldnn::_convolution_pointwise.default" not in ran and ran.count("aten::conv2d.default") == 6, ran
for g, w in zip(fast(x), want):
    assert ((g - w).abs().max() / w.abs().max()).item() < 1e-5
"""
    env = dict(os.environ, KWEXPORT_HIDE_SYMBOLS="aoti_torch_cpu_mkldnn__convolution_pointwise")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


class MobileBlocks(nn.Module):
    """What kwexport's convolution kernels take at `fast`, beside what they leave to oneDNN: a
    1×1 convolution on the NCHW input (not channels-last: oneDNN's), 1×1 convolutions with
    each post-op they absorb and none, depthwise 3×3 and 5×5 ones with strides 1 and 2 on
    channel counts that aren't multiples of 16, a squeeze-excite block (1×1 convolutions on a
    pooled 1×1 image), a strided 1×1 convolution and a 3×3 one (gathered into the GEMM), a
    7×7 stem over three channels, grouped convolutions (RegNet's with more outputs than
    inputs per group and a stride; ResNeXt's groups of 4 with a residual add), and a dilated
    convolution (oneDNN's)."""

    def __init__(self):
        super().__init__()
        acts = [nn.ReLU(), nn.Hardswish(), nn.Hardsigmoid(), nn.SiLU(), nn.Sigmoid(), nn.Identity()]
        self.stem = nn.Conv2d(3, 20, 1)
        self.pointwise = nn.ModuleList(nn.Sequential(nn.Conv2d(20, 20, 1), a) for a in acts)
        self.dw3 = nn.Sequential(nn.Conv2d(20, 20, 3, padding=1, groups=20), nn.ReLU())
        self.dw5 = nn.Sequential(nn.Conv2d(20, 20, 5, stride=2, padding=2, groups=20), nn.Hardswish())
        self.dw3s2 = nn.Conv2d(20, 20, 3, stride=2, padding=1, groups=20, bias=False)
        self.se = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(20, 8, 1), nn.ReLU(), nn.Conv2d(8, 20, 1), nn.Hardsigmoid()
        )
        self.down = nn.Conv2d(20, 36, 1, stride=2)
        self.full = nn.Sequential(nn.Conv2d(36, 70, 3, padding=1), nn.SiLU())
        self.stem7 = nn.Sequential(nn.Conv2d(3, 20, 7, stride=2, padding=3), nn.ReLU())
        self.grouped = nn.Sequential(nn.Conv2d(70, 140, 3, stride=2, padding=1, groups=7), nn.ReLU())
        self.resnext = nn.Conv2d(140, 140, 3, padding=1, groups=35)
        self.dilated = nn.Conv2d(140, 8, 3, padding=2, dilation=2)

    def forward(self, x):
        h = self.stem(x) + nn.functional.interpolate(self.stem7(x), size=x.shape[-2:])
        for block in self.pointwise:
            h = block(h) + h
        h = self.dw3s2(self.dw5(self.dw3(h)))
        h = h * self.se(h)
        h = self.grouped(self.full(self.down(h)))
        return self.dilated(self.resnext(h) + h)


def test_fast_runs_convolutions_on_kwexports_kernels(tmp_path):
    """KWEXPORT_LINEAR_KERNEL forces the choice between kwexport's convolution kernels and
    oneDNN's, as for linears: each within tolerance of eager, and different from the other
    where kwexport's ran (on a CPU with AVX-512)."""

    torch.manual_seed(0)
    model = MobileBlocks().eval()
    x = torch.randn(2, 3, 19, 21)
    path = tmp_path / "blocks.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch, kwexport\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"prog = kwexport.load({str(path)!r}, optimize='fast')\n"
        "out = prog(x)\n"
        "assert prog.dispatch['python'] == 0, prog.dispatch\n"
        "assert torch.equal(prog(x), out)  # the same kernels on the next call\n"
        "torch.save((out, [n['op'] for n in prog.profile(x)]), sys.argv[1])\n"
    )
    outs = with_each_kernel(tmp_path, script)
    with torch.no_grad():
        want = model(x)
    for kernel, (got, _) in outs.items():
        assert got.shape == want.shape and rel_err(got, want) < 1e-5, kernel
        assert got.is_contiguous(memory_format=torch.channels_last), kernel
    ran = outs["kwexport"][1]
    if torch.backends.mkldnn.is_available() and own_kernels():
        # Every convolution is lowered, with its activation absorbed, and the two without one
        # that an add reads (the stem's, the Identity block's) with the add.
        assert ran.count("mkldnn::_convolution_pointwise.default") == 15, ran
        assert ran.count("mkldnn::_convolution_pointwise.binary") == 3, ran
        assert ran.count("aten::conv2d.default") == 0, ran
        assert not {"aten::relu.default", "aten::hardsigmoid.default", "aten::silu.default"} & set(ran), ran
        assert not torch.equal(outs["kwexport"][0], outs["torch"][0])  # kwexport's kernels ran
    # Under autograd the graph's own ops run, with gradients.
    fast = kwexport.load(path, optimize="fast")
    xg = x.clone().requires_grad_()
    fast(xg).sum().backward()
    xe = x.clone().requires_grad_()
    model(xe).sum().backward()
    assert rel_err(xg.grad, xe.grad) < 1e-5


class GlobalPool(nn.Module):
    def forward(self, x):
        return (
            nn.functional.adaptive_avg_pool2d(x, 1),
            nn.functional.adaptive_avg_pool2d(x, (1, 1)).flatten(1),
            x.mean((2, 3), keepdim=True),  # a squeeze-excite block's (GhostNet's)
            x.mean((-2, -1)),
            x.mean((1, 2), keepdim=True),  # not over the pixels: torch's
        )


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
def test_fast_global_pooling_matches_eager_in_either_layout(layout, tmp_path):
    """kwexport's pooling of channels-last images differs from torch's mean by the order of
    its sums only; other layouts run torch's kernel. Both keep eager's strides."""
    x = torch.randn(2, 20, 7, 5).contiguous(memory_format=layout)
    path = tmp_path / "pool.kwx"
    kwexport.save(kwexport.export(GlobalPool(), (x,)), path)
    with torch.profiler.profile() as prof:
        got = kwexport.load(path, optimize="fast")(x)
    want = GlobalPool()(x)
    for g, w in zip(got, want):
        assert g.stride() == w.stride() and rel_err(g, w) < 1e-6
    if own_kernels():
        # Channels-last: kwexport's kernel for all but the mean over (C, H). Contiguous:
        # torch's for all five (its adaptive pooling to 1×1 is a mean too).
        means = [e.name for e in prof.events()].count("aten::mean")
        assert means == (1 if layout == torch.channels_last else 5), means


class GeluMLP(nn.Module):
    """GELU three ways: torch's exact and tanh forms, and GPT-2's tanh form written out
    (transformers' NewGELUActivation)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = nn.functional.gelu(self.a(x))
        h = nn.functional.gelu(self.b(h), approximate="tanh")
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.c(h), h.t().contiguous().t()


def test_a_pass_can_be_skipped_to_measure_it(tmp_path, monkeypatch):
    # KWEXPORT_SKIP_PASSES, read at each load: the file loads as if the pass weren't there.
    torch.manual_seed(0)
    model, x = GeluMLP().eval(), torch.randn(5, 16)
    path = tmp_path / "gelu.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    monkeypatch.setenv("KWEXPORT_SKIP_PASSES", "gelu_tanh, linear_pointwise")
    without = kwexport.load(path, optimize="fast")
    assert "aten::tanh.default" in [n["op"] for n in without.profile(x)]
    with torch.no_grad():
        for got, want in zip(without(x), model(x)):
            assert rel_err(got, want) < 1e-6
    monkeypatch.setenv("KWEXPORT_SKIP_PASSES", "gelu_tanh,no_such_pass")
    with pytest.raises(
        ValueError, match=r'KWEXPORT_SKIP_PASSES: no pass is named "no_such_pass" \(passes: .*gelu_tanh'
    ):
        kwexport.load(path, optimize="fast")
    monkeypatch.delenv("KWEXPORT_SKIP_PASSES")
    assert "aten::tanh.default" not in [n["op"] for n in kwexport.load(path, optimize="fast").profile(x)]


def test_fast_runs_gelu_on_kwexports_kernel(tmp_path):
    torch.manual_seed(0)
    model, x = GeluMLP().eval(), torch.randn(5, 16) * 4
    path = tmp_path / "gelu.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    with torch.no_grad():
        want = model(x)
    assert_same(exact(x), want, bitwise=True)
    ran = [n["op"] for n in fast.profile(x)]
    # The written-out form is one node; all three run on kwexport's kernel, not torch's (the
    # two after a linear in its GEMM, where that fuses).
    fused = ran.count("mkldnn::_linear_pointwise.default")
    assert ran.count("aten::gelu.default") + fused == 3 and "aten::tanh.default" not in ran
    with torch.profiler.profile() as prof:
        fast(x)
    assert "aten::gelu" not in [e.name for e in prof.events()]
    for got, w in zip(fast(x), want):
        assert rel_err(got, w) < 1e-6
    # Under autograd, and with dispatch="python", torch's op runs: the same values.
    with torch.enable_grad():
        got = fast(x.clone().requires_grad_())
    assert rel_err(got[0].detach(), want[0]) < 1e-6
    assert rel_err(kwexport.load(path, optimize="fast", dispatch="python")(x)[0], want[0]) < 1e-6


class UnbatchedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Hardswish())

    def forward(self, x):
        return self.conv(x)


def test_lowered_convolutions_off_onednn_compute_what_the_graph_did(tmp_path):
    """Where oneDNN's kernel can't take a call (an unbatched input, float64, autograd), the
    lowered node runs the convolution and activation it replaced, as torch's ops."""
    torch.manual_seed(0)
    model = UnbatchedConv().eval()
    path = tmp_path / "unbatched.kwx"
    x = torch.randn(3, 10, 10)
    kwexport.save(kwexport.export(model, (x,)), path)
    fast = kwexport.load(path, optimize="fast")
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) < 1e-5
    batched = tmp_path / "batched.kwx"
    kwexport.save(kwexport.export(model, (x[None],)), batched)
    fast = kwexport.load(batched, optimize="fast")
    xg = x[None].clone().requires_grad_()
    got = fast(xg)
    got.sum().backward()
    xe = x[None].clone().requires_grad_()
    want = model(xe)
    want.sum().backward()
    assert rel_err(got.detach(), want.detach()) < 1e-5 and rel_err(xg.grad, xe.grad) < 1e-5


class Relu6Block(nn.Module):
    """MobileNetV2's inverted residual: 1×1 expand, depthwise 3×3, each with ReLU6, and a
    `hardtanh` with other bounds, which stays a node of its own."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Conv2d(16, 64, 1)
        self.depthwise = nn.Conv2d(64, 64, 3, padding=1, groups=64)
        self.project = nn.Conv2d(64, 16, 1)

    def forward(self, x):
        h = nn.functional.relu6(self.expand(x))
        h = nn.functional.relu6(self.depthwise(h))
        return nn.functional.hardtanh(self.project(h), -0.5, 0.5)


def test_fast_fuses_relu6_into_convolutions(tmp_path):
    """ReLU6 (`F.relu6`, which exports as `relu6(x)`; `nn.ReLU6` gives `hardtanh(x, 0, 6)`)
    becomes the lowered convolution's post-op, on oneDNN's kernel or kwexport's, and off them
    (autograd) the Python form applies the same bounds; a `hardtanh` with other bounds stays
    a node."""
    torch.manual_seed(0)
    model = Relu6Block().eval()
    x = (torch.randn(1, 16, 12, 12) * 8).contiguous(memory_format=torch.channels_last)
    path = tmp_path / "relu6.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    fast = kwexport.load(path, optimize="fast")
    with torch.no_grad():
        want = model(x)
    assert rel_err(fast(x), want) < 1e-5
    ran = [n["op"] for n in fast.profile(x)]
    assert "aten::relu6.default" not in ran and ran.count("aten::hardtanh.default") == 1, ran
    if torch.backends.mkldnn.is_available():
        assert "mkldnn::_convolution_pointwise.default" in ran
    xg = x.clone().requires_grad_()
    got = fast(xg)
    got.sum().backward()
    xe = x.clone().requires_grad_()
    model(xe).sum().backward()
    assert rel_err(got.detach(), want) < 1e-5 and rel_err(xg.grad, xe.grad) < 1e-5


class InvertedResiduals(nn.Module):
    """Two inverted residual heads over an image whose expansion is over 1 MB (kwexport runs
    each 1×1 expansion and its depthwise convolution as one kernel over bands of rows): ReLU6
    then a 3×3 at stride 1, Hardswish then a 5×5 at stride 2 without a bias; and a third whose
    expanded image is also returned, which must stay apart."""

    def __init__(self):
        super().__init__()
        self.expand1, self.dw1 = nn.Conv2d(16, 72, 1), nn.Conv2d(72, 72, 3, padding=1, groups=72)
        self.project1 = nn.Conv2d(72, 16, 1)
        self.expand2 = nn.Conv2d(16, 80, 1)
        self.dw2 = nn.Conv2d(80, 80, 5, stride=2, padding=2, groups=80, bias=False)
        self.expand3, self.dw3 = nn.Conv2d(80, 96, 1), nn.Conv2d(96, 96, 3, padding=1, groups=96)
        self.relu6 = nn.ReLU6()  # `hardtanh(x, 0, 6)`, the form the passes fuse

    def forward(self, x):
        h = self.relu6(self.dw1(self.relu6(self.expand1(x))))
        h = self.project1(h) + x
        h = nn.functional.hardswish(self.dw2(nn.functional.hardswish(self.expand2(h))))
        e = nn.functional.relu(self.expand3(h))
        return nn.functional.relu(self.dw3(e)), e


def test_fast_runs_an_expansion_with_its_depthwise_convolution(tmp_path):
    """An expansion and the depthwise convolution that alone reads it run as one step (the
    profile shows one node for the pair) on each kernel family, within tolerance of eager,
    with eager's NaN and infinities; an expansion whose output is also returned runs apart."""
    torch.manual_seed(0)
    model = InvertedResiduals().eval()
    x = torch.randn(2, 16, 64, 60).contiguous(memory_format=torch.channels_last)
    bad = x.clone()
    bad[0, 3, 10, 20], bad[1, :, 40, 7], bad[1, 5, 63, 0] = float("nan"), float("inf"), -float("inf")
    path = tmp_path / "heads.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    torch.save((x, bad), tmp_path / "x.pt")
    script = (
        "import sys, torch, kwexport\n"
        f"x, bad = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"prog = kwexport.load({str(path)!r}, optimize='fast')\n"
        "ran = [n['op'] for n in prog.profile(x)]\n"
        "torch.save((prog(x), prog(bad), ran), sys.argv[1])\n"
    )
    with torch.no_grad():
        want, want_bad = model(x), model(bad)
    for isa in kwexport.kernel_info()["supported"]:
        env = dict(os.environ, KWEXPORT_ISA=isa, KWEXPORT_LINEAR_KERNEL="kwexport")
        dst = tmp_path / f"{isa}.pt"
        r = subprocess.run([sys.executable, "-c", script, str(dst)], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        got, got_bad, ran = torch.load(dst)
        for g, w in zip(got, want):
            assert rel_err(g, w) < 1e-5, isa
        for g, w in zip(got_bad, want_bad):
            assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.isinf(), w.isinf()), isa
            finite = w.isfinite()
            assert rel_err(g[finite], w[finite]) < 1e-5, isa
        convs = sum(op.startswith("mkldnn::_convolution_pointwise") for op in ran)
        # Seven convolutions, two pairs of them one step each, on kwexport's kernels.
        assert convs == (5 if own_kernels() else 7), (isa, ran)


class GeluConvs(nn.Module):
    """ConvNeXt's pointwise MLP (1×1 convolution, GELU, 1×1 convolution) with the tanh GELU
    after a 3×3 convolution in front."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1, self.fc2 = nn.Conv2d(16, 64, 1), nn.Conv2d(64, 16, 1)

    def forward(self, x):
        y = nn.functional.gelu(self.conv(x), approximate="tanh")
        return self.fc2(nn.functional.gelu(self.fc1(y)))


def fast_with_each_kernel(model, x, tmp_path) -> dict:
    """`model` exported on `x`, loaded at `fast` in a child process per forced kernel choice
    (`with_each_kernel`) and called on `x`: `(result, ops the profile ran)` by choice."""
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    torch.save(x, tmp_path / "x.pt")
    script = f"""
import sys, torch, kwexport
fast = kwexport.load({str(path)!r}, optimize="fast")
x = torch.load({str(tmp_path / "x.pt")!r})
torch.save((fast(x), [n["op"] for n in fast.profile(x)]), sys.argv[1])
"""
    return with_each_kernel(tmp_path, script)


def test_fast_fuses_gelu_into_convolutions(tmp_path):
    """GELU (either approximation) after a convolution becomes its post-op: on kwexport's
    GEMM or oneDNN's 1×1 convolution (each forced), and oneDNN's 3×3 one, within tolerance."""
    torch.manual_seed(0)
    model = GeluConvs().eval()
    x = (torch.randn(2, 8, 14, 14) * 3).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want = model(x)
    for kernel, (got, ran) in fast_with_each_kernel(model, x, tmp_path).items():
        assert rel_err(got, want) < 1e-5, kernel
        if torch.backends.mkldnn.is_available():
            assert "aten::gelu.default" not in ran, (kernel, ran)


class PatchEmbeddings(nn.Module):
    """Vision transformers' stems: 16×16 patches at stride 16 (with GELU after one), and a
    4×4 one over 3 channels, too few values a patch for the GEMM (the direct kernel keeps it)."""

    def __init__(self):
        super().__init__()
        self.vit = nn.Conv2d(3, 40, 16, stride=16)
        self.gelu = nn.Sequential(nn.Conv2d(3, 24, 16, stride=16, bias=False), nn.GELU())
        self.small = nn.Conv2d(3, 8, 4, stride=4)

    def forward(self, x):
        return self.vit(x), self.gelu(x), self.small(x)


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_fast_runs_patch_embeddings_as_a_gemm(layout, tmp_path):
    """A convolution whose kernel tiles the image (ViT's patch embedding) runs as the GEMM over
    each patch gathered into a row, from an image in either layout: within tolerance of eager
    with each kernel forced, and differing from oneDNN's where kwexport's ran."""
    torch.manual_seed(0)
    model = PatchEmbeddings().eval()
    x = torch.randn(2, 3, 48, 64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want = model(x)
    outs = fast_with_each_kernel(model, x, tmp_path)
    for kernel, (got, ran) in outs.items():
        for g, w in zip(got, want):
            assert g.shape == w.shape and rel_err(g, w) < 1e-5, kernel
        if torch.backends.mkldnn.is_available():
            assert "aten::gelu.default" not in ran, (kernel, ran)
    if torch.backends.mkldnn.is_available() and own_kernels():
        for ours, theirs in zip(outs["kwexport"][0], outs["torch"][0]):
            assert not torch.equal(ours, theirs)  # kwexport's kernels ran


class MaskedAttention(nn.Module):
    """What transformers build from the traced sizes on every call: a causal mask from
    `arange`s and a rotary table in a no-grad region, read by the layer."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)

    @torch.no_grad()
    def rotary(self, pos):
        with torch.autocast("cpu", enabled=False):
            angles = (self.inv_freq[:, None] @ pos[None, :].float()).t()
            return torch.cat([angles, angles], dim=-1)

    def forward(self, x):
        pos = torch.arange(x.shape[1])
        mask = (pos[None, :] <= pos[:, None]).cumsum(-1) > 0
        table = self.rotary(pos)
        q = self.proj(x) * table.cos() + x * table.sin()
        attn = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return attn, pos * 2, torch.rand_like(table) < 2


def test_fast_folds_what_reads_only_constants(tmp_path):
    torch.manual_seed(0)
    model, x = MaskedAttention().eval(), torch.randn(2, 6, 8)
    path = tmp_path / "fold.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    with torch.no_grad():
        want = model(x)
    ran = [n["op"] for n in fast.profile(x)]
    # The mask and the table are made once, at load; the returned `pos * 2` and the random
    # draw are made on each call.
    for folded in ("aten::cumsum.default", "aten::cos.default", "higher_order::wrap_with_set_grad_enabled"):
        assert folded in [n["op"] for n in exact.profile(x)] and folded not in ran
    assert {"aten::mul.Tensor", "aten::rand_like.default"} <= set(ran)
    for prog in (fast, kwexport.load(path, optimize="fast", dispatch="python")):
        got = prog(x)
        assert rel_err(got[0], want[0]) < 1e-6 and torch.equal(got[1], want[1]) and got[2].all()
    # A returned value is new on each call: writing to it changes no later call.
    first = fast(x)[1]
    first.add_(100)
    assert torch.equal(fast(x)[1], want[1])
    # Under autograd the folded values are constants, as in eager.
    xg = x.clone().requires_grad_()
    fast(xg)[0].sum().backward()
    xe = x.clone().requires_grad_()
    model(xe)[0].sum().backward()
    assert rel_err(xg.grad, xe.grad) < 1e-5


class Steps(nn.Module):
    """A value read from state, which each call writes: never a constant."""

    def __init__(self):
        super().__init__()
        self.register_buffer("step", torch.zeros(3))

    def forward(self, x):
        self.step.add_(1)
        return x * torch.arange(3.0).exp() + self.step.cos()


def test_fast_never_folds_what_reads_state(tmp_path):
    x = torch.randn(3)
    path = tmp_path / "steps.kwx"
    kwexport.save(kwexport.export(Steps(), (x,)), path)
    fast, model = kwexport.load(path, optimize="fast"), Steps()
    assert "aten::exp.default" not in [n["op"] for n in fast.profile(x)]
    fast.reset()
    for _ in range(3):
        assert rel_err(fast(x), model(x)) < 1e-6


class Attentions(nn.Module):
    """Attention as models call it: causal, a padding mask given by the caller, an additive
    float mask, none, a scale of its own, more keys than queries, and values narrower than
    keys."""

    def __init__(self):
        super().__init__()
        self.qkv, self.kv = nn.Linear(16, 48), nn.Linear(16, 32)

    def forward(self, x, memory, keep, bias):
        sdpa = nn.functional.scaled_dot_product_attention
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        mk, mv = (t.view(b, -1, 2, 8).transpose(1, 2) for t in self.kv(memory).split(16, dim=-1))
        return (
            sdpa(q, k, v, is_causal=True),
            sdpa(q, k, v, attn_mask=keep[:, None, None, :]),
            sdpa(q, k, v, attn_mask=bias, scale=0.3),
            sdpa(q, mk, mv),
            sdpa(q, k, v[..., :5]),
        )


def test_fast_runs_attention_on_kwexports_kernel(tmp_path):
    torch.manual_seed(0)
    model = Attentions().eval()
    x, memory = torch.randn(2, 7, 16), torch.randn(2, 19, 16)
    keep = torch.rand(2, 7) > 0.3
    keep[:, 0] = True
    bias = torch.randn(7, 7).masked_fill(torch.rand(7, 7) > 0.8, float("-inf"))
    bias[:, 0] = 0
    path = tmp_path / "attention.kwx"
    kwexport.save(kwexport.export(model, (x, memory, keep, bias)), path)
    fast = kwexport.load(path, optimize="fast")
    with torch.no_grad():
        want = model(x, memory, keep, bias)
    with torch.profiler.profile() as prof:
        got = fast(x, memory, keep, bias)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride() and rel_err(g, w) < 1e-5
    if own_kernels():
        # All but the narrower values, where torch's math kernel (and its layout) stays.
        assert [e.name for e in prof.events()].count("aten::scaled_dot_product_attention") == 1
    # A query with no key to attend is torch's to decide (its flash kernel gives zeros), as
    # are calls under autograd.
    keep[1] = False
    with torch.no_grad():
        none_kept = model(x, memory, keep, bias)[1]
    got = fast(x, memory, keep, bias)[1]
    assert torch.equal(got[1], none_kept[1]) and rel_err(got, none_kept) < 1e-5
    xg = x.clone().requires_grad_()
    fast(xg, memory, keep, bias)[0].sum().backward()
    xe = x.clone().requires_grad_()
    model(xe, memory, keep, bias)[0].sum().backward()
    assert rel_err(xg.grad, xe.grad) < 1e-5


class Rotary(nn.Module):
    """transformers' `apply_rotary_pos_emb`: the query and key transposed into heads, the
    tables broadcast over heads (`[b, 1, p, d]`) and over the batch (`[p, d]`), the halves
    split at the middle and, for the key, elsewhere."""

    def forward(self, x, y, cos, sin):
        cos2, sin2 = cos[0, 0], sin[0, 0]
        q, k = x.transpose(1, 2), y.transpose(1, 2)

        def rotate(t, split):
            return torch.cat((-t[..., split:], t[..., :split]), dim=-1)

        return q * cos + rotate(q, 4) * sin, (k * cos2) + (rotate(k, 3) * sin2)


def test_fast_runs_the_rotary_embedding_as_one_kernel(tmp_path):
    torch.manual_seed(0)
    x, y, cos, sin = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    model, path = Rotary(), tmp_path / "rotary.kwx"
    kwexport.save(kwexport.export(model, (x, y, cos, sin)), path)
    fast = kwexport.load(path, optimize="fast")
    ran = [n["op"] for n in fast.profile(x, y, cos, sin)]
    assert ran.count("kwexport::rotary_embedding.default") == (2 if own_kernels() else 0)
    # Eager's bits and layout (the query's), NaN and infinities where eager has them, from
    # kwexport's kernel: torch runs none of the ops it replaced.
    x[0, 1, 2, 3], cos[1, 0, 2, 5], sin[0, 0, 4, 1] = float("nan"), float("inf"), float("-inf")
    with torch.profiler.profile() as prof:
        got = fast(x, y, cos, sin)
    assert_same(got, model(x, y, cos, sin), bitwise=True)
    assert "aten::cat" not in [e.name for e in prof.events()] or not own_kernels()
    # Under autograd the node runs its composite form: eager's gradients.
    grads = []
    for run in (fast, model):
        xg = x.nan_to_num().requires_grad_()
        sum(t.sum() for t in run(xg, y, cos.nan_to_num(), sin.nan_to_num())).backward()
        grads.append(xg.grad)
    assert torch.equal(*grads)


class ActivatedLinears(nn.Module):
    """Linears and the activation after each, as MLPs write them: BERT's GELU, GPT-2's tanh
    GELU, Llama's SiLU without a bias, a ReLU; and one whose output is read twice."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 48), nn.Linear(48, 40), nn.Linear(40, 24, bias=False)
        self.d, self.e = nn.Linear(24, 24), nn.Linear(24, 8)

    def forward(self, x):
        h = nn.functional.gelu(self.a(x))
        h = nn.functional.gelu(self.b(h), approximate="tanh")
        h = nn.functional.silu(self.c(h))
        h = torch.relu(self.d(h))
        shared = self.e(h)
        return torch.relu(shared) + shared


@pytest.mark.parametrize("rows", [5, 100])
def test_fast_fuses_linears_with_their_activation(rows, tmp_path):
    """Few rows run kwexport's GEMM, which applies the activation as it stores (or torch's
    GEMM, then kwexport's activation, where that measured faster); many rows run torch's."""
    torch.manual_seed(0)
    model, x = ActivatedLinears().eval(), torch.randn(2, rows, 16) * 3
    path = tmp_path / "mlp.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    torch.save(x, tmp_path / "x.pt")
    fast = kwexport.load(path, optimize="fast")
    ran = [n["op"] for n in fast.profile(x)]
    if own_kernels() and torch.backends.mkldnn.is_available():
        assert ran.count("mkldnn::_linear_pointwise.default") == 4
        assert {"aten::gelu.default", "aten::silu.default"}.isdisjoint(ran) and ran.count("aten::relu.default") == 1
    with torch.no_grad():
        want = model(x)
    script = (
        "import sys, torch, kwexport\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"prog = kwexport.load({str(path)!r}, optimize='fast')\n"
        "torch.save([prog(x), prog(x)], sys.argv[1])\n"
    )
    for kernel, outs in with_each_kernel(tmp_path, script).items():
        for got in outs:
            assert got.shape == want.shape and rel_err(got, want) < 1e-5, kernel
    # Under autograd the fused node runs the linear and its activation as torch's ops.
    xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    fast(xg).sum().backward()
    model(xe).sum().backward()
    assert rel_err(xg.grad, xe.grad) < 1e-5


class Norms(nn.Module):
    """Layer norms as transformers use them (after a residual add), one without an affine
    part, one over a transposed (non-contiguous) input, and one in float64."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.LayerNorm(48), nn.LayerNorm(48, elementwise_affine=False)
        self.c = nn.LayerNorm(48).double()

    def forward(self, x, y):
        return self.a(x + y), self.b(x), self.a(x.transpose(0, 1)), self.c(x.double()).float()


def test_fast_runs_layer_norm_on_kwexports_kernel(tmp_path):
    torch.manual_seed(0)
    model = Norms().eval()
    with torch.no_grad():
        model.a.weight.uniform_(0.5, 1.5)
        model.a.bias.uniform_(-1, 1)
    x, y = torch.randn(5, 5, 48) * 3 + 20, torch.randn(5, 5, 48)
    path = tmp_path / "norms.kwx"
    kwexport.save(kwexport.export(model, (x, y)), path)
    fast = kwexport.load(path, optimize="fast")
    with torch.no_grad():
        want = model(x, y)
    with torch.profiler.profile() as prof:
        got = fast(x, y)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-6
    if kwexport._rt.stable_abi_available():
        # Only the first runs kwexport's kernel: the others lack an affine part, a contiguous
        # input or float32.
        assert [e.name for e in prof.events()].count("aten::layer_norm") == 3


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)  # channels-last at `fast`
        return (
            nn.functional.max_pool2d(y, 3, 2, 1),
            nn.functional.max_pool2d(y, (2, 3), (1, 2), (0, 1)),
            nn.functional.max_pool2d(y, 2),
            nn.functional.max_pool2d(y, 3, 2, 1, ceil_mode=True),
            nn.functional.max_pool2d(y, 3, 2, ceil_mode=True),
            nn.functional.max_pool2d(y, 2, 2, 1, ceil_mode=True),
            nn.functional.max_pool2d(x, 3, 2, 1),
        )


def test_fast_max_pooling_matches_eager(tmp_path):
    torch.manual_seed(0)
    model, x = Pools().eval(), torch.randn(2, 3, 11, 10)
    x[0, 1, 4, 4] = float("nan")
    path = tmp_path / "pools.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    fast = kwexport.load(path, optimize="fast")
    with torch.no_grad():
        want = model(x)
    with torch.profiler.profile() as prof:
        got = fast(x)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert torch.equal(g.isnan(), w.isnan()) and rel_err(g.nan_to_num(), w.nan_to_num()) < 1e-6
    if own_kernels() and torch.backends.mkldnn.is_available():
        # kwexport's loop on the channels-last convolution outputs, ceil mode included
        # (windows hanging past the input); torch's op for the NCHW input.
        assert [e.name for e in prof.events()].count("aten::max_pool2d") == 1


class WideNet(nn.Module):
    """What `precision="bf16"` computes on kwexport's bfloat16 GEMM (the linears, the 3×3
    and 1×1 convolutions), beside what stays float32 (the stem's few input channels, the
    depthwise convolution)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.conv = nn.Conv2d(32, 32, 3, padding=1)
        self.depthwise = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.pointwise = nn.Conv2d(32, 32, 1)
        self.wide = nn.Linear(32, 1024)
        self.fc = nn.Linear(1024, 1024)
        self.out = nn.Linear(1024, 10)

    def forward(self, x):
        h = self.conv(self.stem(x).relu()).relu()
        h = self.pointwise(self.depthwise(h)) + h
        return self.out(self.fc(self.wide(h.mean((2, 3))).relu()))


def test_bf16_computes_products_in_bfloat16_within_tolerance(tmp_path):
    torch.manual_seed(0)
    model, x = WideNet().eval(), torch.randn(2, 3, 16, 16)
    path = tmp_path / "wide.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    with torch.no_grad():
        want = model(x)
    prog = kwexport.load(path, precision="bf16")
    assert (prog.optimize, prog.precision) == ("fast", "bf16")
    got = prog(x)
    assert got.dtype == torch.float32
    # bfloat16's rounding, and no more (a CPU without AVX512-BF16 runs float32 kernels).
    assert rel_err(got, want) < 2e-2 and (rel_err(got, want) > 1e-5 or not kwexport_bf16_gemm())
    # The kernels take float32 in and out: no cast runs around them.
    assert "aten::_to_copy.default" not in {n["op"] for n in prog.profile(x)}
    # The file keeps float32 weights: a plain load computes what eager does.
    assert_same(kwexport.load(path)(x), want, bitwise=True)
    fast = kwexport.load(path, optimize="fast")
    assert (fast.precision, rel_err(fast(x), want) < 1e-5) == ("float32", True)


@pytest.mark.parametrize("rows", [3, 100])
def test_bf16_linears_run_on_kwexports_bfloat16_gemm(rows, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 130), nn.GELU(), nn.Linear(130, 33), nn.ReLU(), nn.Linear(33, 7)).eval()
    x = torch.randn(rows, 48)
    path = tmp_path / "mlp.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    with torch.no_grad():
        want = model(x)
    bf16 = kwexport.load(path, precision="bf16")
    got = bf16(x)
    assert rel_err(got, want) < 2e-2 and got.dtype == torch.float32
    assert "aten::_to_copy.default" not in {n["op"] for n in bf16.profile(x)}
    # Whichever kernel a node measured faster: torch's float32 one gives eager's values,
    # kwexport's bfloat16 GEMM differs by bfloat16's rounding.
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch, kwexport\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"torch.save(kwexport.load({str(path)!r}, precision='bf16')(x), sys.argv[1])\n"
    )
    outs = with_each_kernel(tmp_path, script)
    assert rel_err(outs["torch"], want) < 1e-6
    if kwexport_bf16_gemm():
        assert 1e-5 < rel_err(outs["kwexport"], want) < 2e-2
    # Under autograd, torch's ops run.
    x.requires_grad_(True)
    bf16(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_the_precision_is_checked_and_travels_with_pickles(tmp_path):
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(nn.Linear(2, 2), (torch.randn(1, 2),)), path)
    with pytest.raises(ValueError, match=r"^precision must be 'float32' or 'bf16', not 'fp16'$"):
        kwexport.load(path, precision="fp16")
    # Off the CPU, no kernel would compute in bfloat16: refused, not silently float32.
    with pytest.raises(ValueError, match=r"^precision='bf16' runs kwexport's CPU kernels; this program runs on meta$"):
        kwexport.load(path, precision="bf16", device="meta")
    prog = pickle.loads(pickle.dumps(kwexport.load(path, precision="bf16")))
    assert (prog.optimize, prog.precision) == ("fast", "bf16")
    method = pickle.loads(pickle.dumps(kwexport.load(path, precision="bf16").methods["forward"]))
    assert method(torch.ones(1, 2)).shape == (1, 2)
    assert kwexport.load(path).precision == "float32"


class ResBlocks(nn.Module):
    """Two ResNet basic blocks (the second downsamples, so its residual is a convolution's
    output), and a convolution plus a per-channel tensor the add broadcasts."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.b = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.down = nn.Conv2d(8, 16, 1, stride=2)
        self.c = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x, shift):
        h = self.a(x)
        h += x
        h = h.relu()
        y = (self.b(h) + self.down(h)).relu()
        return self.c(y) + shift


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_fast_adds_residuals_in_the_convolutions(precision, tmp_path):
    torch.manual_seed(0)
    model = ResBlocks().eval()
    x, shift = torch.randn(2, 8, 12, 12), torch.randn(1, 16, 1, 1)
    path = tmp_path / "res.kwx"
    kwexport.save(kwexport.export(model, (x, shift)), path)
    with torch.no_grad():
        want = model(x, shift)
    prog = kwexport.load(path, optimize="fast", precision=precision)
    for _ in range(2):  # the first call measures each kernel, the second runs the choice
        assert rel_err(prog(x, shift), want) < (2e-2 if precision == "bf16" else 1e-5)
    ran = [n["op"] for n in prog.profile(x, shift)]
    if torch.backends.mkldnn.is_available():
        # The two blocks' adds and ReLUs, and the broadcast add (which runs torch's ops: oneDNN
        # and kwexport's kernels add a residual of the output's shape only).
        assert ran.count("mkldnn::_convolution_pointwise.binary") == 3
        assert not {"aten::add_.Tensor", "aten::add.Tensor", "aten::relu.default"} & set(ran)
    # Under autograd, torch's ops: the same values, and gradients.
    xg = x.clone().requires_grad_(True)
    got = prog(xg, shift)
    assert rel_err(got.detach(), want) < (2e-2 if precision == "bf16" else 1e-5)
    got.sum().backward()
    assert xg.grad is not None and xg.grad.abs().sum() > 0


@pytest.mark.parametrize("padding", [0, 1, 2])
def test_fast_runs_3x3_convolutions_by_winograd(padding, tmp_path):
    """A 3×3 convolution at stride 1 over 16 output pixels or more runs kwexport's
    Winograd kernel where kwexport's kernel is chosen: within 1e-5 of eager, and not
    eager's bits (it ran); odd sizes leave blocks half outside the image."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(24, 40, 3, padding=padding), nn.ReLU(), nn.Conv2d(40, 8, 3, padding=padding)).eval()
    x = torch.randn(2, 24, 11, 9)
    path = tmp_path / "w.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch, kwexport\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"torch.save(kwexport.load({str(path)!r}, optimize='fast')(x), sys.argv[1])\n"
    )
    outs = with_each_kernel(tmp_path, script)
    with torch.no_grad():
        want = model(x)
    for kernel, got in outs.items():
        assert rel_err(got, want) < 1e-5, kernel
    if torch.backends.mkldnn.is_available() and own_kernels():
        assert not torch.equal(outs["kwexport"], outs["torch"])


class ArangeMaskAttention(nn.Module):
    """Attention over a mask built from `arange` alone (as vision transformers' is): all
    true where `keep` is None, else true below `keep` keys."""

    def __init__(self, keep=None, additive=False):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.keep, self.additive = keep, additive

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        n = x.shape[1]
        mask = torch.arange(n) < (n if self.keep is None else self.keep)
        mask = mask[None, None, None, :].expand(1, 1, n, n)
        if self.additive:
            mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class LongAttentions(nn.Module):
    """Attention over 128 tokens: causal, and with a padding mask."""

    def forward(self, q, k, v, keep):
        sdpa = nn.functional.scaled_dot_product_attention
        return sdpa(q, k, v, is_causal=True), sdpa(q, k, v, attn_mask=keep[:, None, None, :])


def test_fast_measures_attention_past_the_keys_its_kernel_takes_unmeasured(tmp_path):
    """Past the keys kwexport's attention kernel takes without measuring (64 on AVX2 and the
    portable family, 512 on AVX-512), its kernel and torch's take turns over a node's first
    calls, and the faster one runs after: every call gives eager's results."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 32) for _ in range(3))
    keep = torch.rand(2, 128) > 0.2
    keep[:, 0] = True
    path = tmp_path / "long_attention.kwx"
    kwexport.save(kwexport.export(LongAttentions(), (q, k, v, keep)), path)
    fast = kwexport.load(path, optimize="fast")
    want = LongAttentions()(q, k, v, keep)
    torch_ran = []
    for _ in range(14):
        with torch.profiler.profile() as prof:
            got = fast(q, k, v, keep)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.stride() == w.stride() and rel_err(g, w) < 1e-5
        torch_ran.append([e.name for e in prof.events()].count("aten::scaled_dot_product_attention"))
    if kwexport.kernel_info()["isa"] in ("avx2", "portable"):
        # kwexport's kernel first, then torch's, for each of the two nodes.
        assert torch_ran[:2] == [0, 2]
        # Chosen after five runs each: one kernel per node from then on.
        assert len(set(torch_ran[10:])) == 1


class ThreeHeads(nn.Module):
    """Three heads of 16 from one projection-shaped input, plain and causal."""

    def forward(self, x):
        q, k, v = x.view(1, 64, 3, 3, 16).permute(2, 0, 3, 1, 4)
        sdpa = nn.functional.scaled_dot_product_attention
        return sdpa(q, k, v), sdpa(q, k, v, is_causal=True)


def test_fast_splits_attention_heads_in_parts_of_queries_across_threads(tmp_path):
    """Three heads don't share out evenly over two threads: each head's queries split in
    parts (equal rows, or a causal head's equal shares of scores), each thread's units
    written by it alone, every call as eager's."""
    torch.manual_seed(0)
    x = torch.randn(1, 64, 144)
    path = tmp_path / "three_heads.kwx"
    kwexport.save(kwexport.export(ThreeHeads(), (x,)), path)
    fast = kwexport.load(path, optimize="fast")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = ThreeHeads()(x)
        for _ in range(3):
            with torch.profiler.profile() as prof:
                got = fast(x)
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.stride() == w.stride() and rel_err(g, w) < 1e-5
            if kwexport.kernel_info()["isa"] is not None:
                names = [e.name for e in prof.events()]
                assert "aten::scaled_dot_product_attention" not in names
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("keep, additive", [(None, False), (None, True), (6, False), (6, True)])
def test_fast_drops_attention_masks_that_mask_nothing(tmp_path, keep, additive):
    torch.manual_seed(0)
    m, x = ArangeMaskAttention(keep, additive).eval(), torch.randn(1, 10, 16)
    path = tmp_path / "a.kwx"
    kwexport.save(kwexport.export(m, (x,)), path)
    masks = {}
    for level in ("exact", "fast"):
        prog = kwexport.load(path, optimize=level, dispatch="python")
        with torch.profiler.profile(record_shapes=True) as prof:
            out = prog(x)
        torch.testing.assert_close(out, m(x), rtol=0, atol=1e-6)
        masks[level] = [e.input_shapes[3] for e in prof.events() if e.name == "aten::scaled_dot_product_attention"]
    assert masks["exact"] == [[1, 1, 10, 10]]
    # Dropped where it masks nothing; a mask that hides keys stays.
    assert masks["fast"] == ([[]] if keep is None else [[1, 1, 10, 10]])


class CausalMaskAttention(nn.Module):
    """Attention over a causal mask built from `arange` (as decoders' is), boolean or
    additive (the dtype's least value, as transformers fills it, or -inf), or one that lets
    each query see one key ahead (`ahead`), which is no causal mask."""

    def __init__(self, kind, ahead=0):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.kind, self.ahead = kind, ahead

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        pos = torch.arange(x.shape[1])
        mask = (pos[None, :] <= pos[:, None] + self.ahead)[None, None]
        if self.kind != "bool":
            least = torch.finfo(torch.float32).min if self.kind == "min" else float("-inf")
            mask = torch.zeros(mask.shape).masked_fill(~mask, least)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "min", "-inf"])
@pytest.mark.parametrize("ahead", [0, 1], ids=["causal", "one-ahead"])
def test_fast_runs_a_folded_causal_mask_as_is_causal(tmp_path, kind, ahead):
    torch.manual_seed(0)
    m, x = CausalMaskAttention(kind, ahead).eval(), torch.randn(1, 10, 16)
    path = tmp_path / "a.kwx"
    kwexport.save(kwexport.export(m, (x,)), path)
    for level, dispatch in [("exact", "python"), ("fast", "python"), ("fast", "auto")]:
        prog = kwexport.load(path, optimize=level, dispatch=dispatch)
        with torch.profiler.profile(record_shapes=True) as prof:
            out = prog(x)
        torch.testing.assert_close(out, m(x), rtol=0, atol=1e-6)
        masks = [e.input_shapes[3] for e in prof.events() if e.name == "aten::scaled_dot_product_attention"]
        if dispatch == "python":
            # The causal mask gone at `fast` (then `is_causal`: unmasked, the results would
            # differ); the one-ahead mask kept.
            gone = level == "fast" and ahead == 0
            assert masks == ([[]] if gone else [[1, 1, 10, 10]]), (level, masks)


class Shuffled(nn.Module):
    """ShuffleNet's channel shuffle (torchvision's function) between convolutions."""

    def __init__(self, groups):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 12, 3, padding=1), nn.Conv2d(12, 12, 1)
        self.groups = groups

    def forward(self, x):
        from torchvision.models.shufflenetv2 import channel_shuffle

        s = channel_shuffle(self.a(x), self.groups)
        return s, self.b(s)


@pytest.mark.parametrize("groups", [2, 3])
def test_fast_shuffles_channels_without_leaving_channels_last(tmp_path, groups):
    pytest.importorskip("torchvision")
    torch.manual_seed(0)
    m, x = Shuffled(groups).eval(), torch.randn(2, 3, 10, 10)
    path = tmp_path / "s.kwx"
    kwexport.save(kwexport.export(m, (x,)), path)
    with torch.no_grad():
        want = m(x)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    got = fast(x)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5
    # The shuffle's values exactly as exported, in the convolution's channels-last layout.
    assert torch.equal(got[0], fast(x)[0]) and got[0].is_contiguous(memory_format=torch.channels_last)
    assert exact(x)[0].is_contiguous()
    # Plain aten ops: autograd runs through them.
    xg = x.clone().requires_grad_()
    fast(xg)[1].sum().backward()
    assert xg.grad is not None and xg.grad.shape == x.shape


class Dropped(nn.Module):
    """Dropouts in eval mode: around a linear, one returned as is, one of the user's input."""

    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(8, 8), nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(self.lin(self.drop(x)))
        return {"h": torch.relu(h), "same": self.drop(h), "input": self.drop(x)}


def test_fast_reads_eval_mode_dropouts_as_their_input(tmp_path):
    torch.manual_seed(0)
    m = Dropped().eval()
    x = torch.randn(3, 8)
    path = tmp_path / "dropped.kwx"
    kwexport.save(kwexport.export(m, (x,)), path)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    assert "aten::dropout.default" in {r["op"] for r in exact.profile(x)}
    assert "aten::dropout.default" not in {r["op"] for r in fast.profile(x)}
    with torch.no_grad():
        want = m(x)
    got = fast(x)
    # A dropout in eval mode returns its input: the same values (the linear on `fast`'s GEMM),
    # the same tensor.
    assert all(rel_err(got[k], want[k]) < 1e-6 for k in want)
    assert got["input"] is x


class Cats(nn.Module):
    """Concatenations along each dimension, of inputs laid out either way."""

    def forward(self, a, b, t, u):
        return (
            torch.cat([a, b, a], 1),
            torch.cat([a, b], -3),
            torch.cat([a, b], 2),
            torch.cat([a, b], 0),
            torch.cat([t, u], -1),
            torch.cat([t, t.flip(1)], 1),
            torch.cat([a, b.contiguous()], 1),
            # A slice of channels beside whole tensors: strided rows when channels-last.
            torch.cat([b.chunk(2, 1)[1], a, b.chunk(2, 1)[0]], 1),
            torch.cat([b.chunk(2, 1)[1], a.chunk(2, 1)[0]], 2),
        )


class ChunkedConv(nn.Module):
    """ShuffleNet's branch: a 1×1 convolution on half of a tensor's channels (`chunk`)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(20, 24, 1), nn.ReLU())

    def forward(self, x):
        kept, branch = x.chunk(2, 1)
        return torch.cat([kept, self.conv(branch)], 1)


def test_fast_convolves_a_slice_of_channels_in_place(tmp_path):
    """The 1×1 convolution reads the channels-last slice where it lies (its pixels 40
    floats apart): kwexport's kernel ran (its result differs from oneDNN's in rounding),
    within tolerance of eager."""
    torch.manual_seed(0)
    model, x = ChunkedConv().eval(), torch.randn(2, 40, 9, 11).to(memory_format=torch.channels_last)
    path = tmp_path / "chunked.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch, kwexport\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"prog = kwexport.load({str(path)!r}, optimize='fast')\n"
        "torch.save(prog(x), sys.argv[1])\n"
    )
    outs = with_each_kernel(tmp_path, script)
    with torch.no_grad():
        want = model(x)
    for got in outs.values():
        assert got.shape == want.shape and rel_err(got, want) < 1e-5
        assert torch.equal(got[:, :20], x[:, :20])
    if own_kernels():
        assert not torch.equal(outs["kwexport"], outs["torch"])


class Swaps(nn.Module):
    """`contiguous` after a swap of two axes: an attention head's, a channel shuffle's, and
    views that aren't one swap."""

    def forward(self, h, x):
        b, c, rows, cols = x.shape
        shuffled = x.reshape(b, 2, c // 2, rows, cols).transpose(1, 2).contiguous()
        pixels = x.permute(0, 2, 3, 1).reshape(b, rows, cols, 3, c // 3).transpose(3, 4).contiguous()
        return (
            h.transpose(1, 2).contiguous(),
            shuffled,
            pixels,
            x.permute(0, 3, 1, 2).contiguous(),  # [2, 12·5, 7] swapped to [2, 7, 12·5]
            x.permute(0, 3, 2, 1).contiguous(),
            x[:, ::2].transpose(2, 3).contiguous(),
            h.contiguous(),
        )


def test_fast_copies_swapped_axes_as_eager_does(tmp_path):
    torch.manual_seed(0)
    h, x = torch.randn(2, 4, 10, 8), torch.randn(2, 12, 5, 7)
    x[1, 2, 3, 4] = float("nan")
    path = tmp_path / "swaps.kwx"
    kwexport.save(kwexport.export(Swaps(), (h, x)), path)
    fast = kwexport.load(path, optimize="fast")
    want = Swaps()(h, x)
    with torch.profiler.profile() as prof:
        got = fast(h, x)
    for g, w in zip(got, want):
        assert torch.equal(g.nan_to_num(), w.nan_to_num()) and torch.equal(g.isnan(), w.isnan())
        assert g.stride() == w.stride()
    if own_kernels():
        # The first four on kwexport's kernel; torch's copies the reversal of three axes and
        # the strided slice, and returns the contiguous tensor as it is.
        copies = [e.name for e in prof.events()].count("aten::contiguous")
        assert copies == 3, copies


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_fast_concatenates_as_eager_does(layout, tmp_path):
    torch.manual_seed(0)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    a = torch.randn(2, 16, 30, 40).to(memory_format=fmt)
    b = torch.randn(2, 24, 30, 40).to(memory_format=fmt)
    b[1, 3, 4, 5] = float("nan")
    b[0, 2, 0, 0] = float("-inf")
    t, u = torch.randn(3, 70, 64), torch.randn(3, 70, 32)
    args = (a, b[:, :16].contiguous(memory_format=fmt), t, u)
    path = tmp_path / "cats.kwx"
    kwexport.save(kwexport.export(Cats(), args), path)
    fast = kwexport.load(path, optimize="fast")
    want = Cats()(*args)
    with torch.profiler.profile() as prof:
        got = fast(*args)
    first = [g.clone() for g in got]
    again = fast(*args)
    for g, w, f, r in zip(got, want, first, again):
        assert torch.equal(g.nan_to_num(), w.nan_to_num()) and torch.equal(g.isnan(), w.isnan())
        assert g.stride() == w.stride(), (g.shape, g.stride(), w.stride())
        # A later call's outputs are new tensors: this call's keep their values.
        assert torch.equal(g.nan_to_num(), f.nan_to_num()) and g.data_ptr() != r.data_ptr()
    if own_kernels():
        # Torch's op for the channel slices joined along H (rows with gaps between images),
        # and either where layouts mix when `a` is channels-last (a contiguous output) or
        # for the channel slices of contiguous tensors (gaps between images too).
        mixed = 2
        assert [e.name for e in prof.events()].count("aten::cat") == mixed


def test_outputs_in_the_arena_outlive_the_program_and_match_without_it(tmp_path):
    """kwexport's kernels write into its arena: an output stays the caller's after the
    program is gone and other calls reuse the memory around it, what a call returns comes
    from torch's allocator (resizable, as eager's outputs are), and a process with the arena
    off (`KWEXPORT_ARENA_MB=0`) computes the same bits."""
    chunked = ChunkedConv().eval()
    y = torch.randn(2, 40, 32, 32).to(memory_format=torch.channels_last)  # outputs over 64 KiB
    kwexport.save(kwexport.export(chunked, (y,)), tmp_path / "chunked.kwx")
    returned = kwexport.load(tmp_path / "chunked.kwx", optimize="fast")(y)  # kwexport's `cat`
    returned.resize_(2 * returned.numel())
    torch.manual_seed(0)
    model, x = MobileBlocks().eval(), torch.randn(2, 3, 19, 21)
    path = tmp_path / "blocks.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    fast = kwexport.load(path, optimize="fast")
    kept = fast(x)
    copy = kept.clone()
    del fast
    again = kwexport.load(path, optimize="fast")
    for _ in range(3):
        again(x * 2)
    assert torch.equal(kept, copy)
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch, kwexport\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"torch.save(kwexport.load({str(path)!r}, optimize='fast')(x), sys.argv[1])\n"
    )
    outs = []
    for arena in ("0", "4096"):
        # The same kernels in both (a measured choice could differ between processes).
        env = dict(os.environ, KWEXPORT_ARENA_MB=arena, KWEXPORT_LINEAR_KERNEL="kwexport")
        dst = tmp_path / f"arena{arena}.pt"
        r = subprocess.run([sys.executable, "-c", script, str(dst)], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs.append(torch.load(dst))
    assert torch.equal(outs[0], outs[1])


class ConcatenatedConvolutions(nn.Module):
    """Concatenations of convolutions' outputs: GhostNet's module (a 1×1, then a depthwise
    3×3 of its output, joined; the join then added to in place), SqueezeNet's fire (a 1×1
    and a 3×3 of one input, joined), and a GhostNet module whose first part is read again
    after the join was changed in place, which must see its own values."""

    def __init__(self):
        super().__init__()

        def conv(cin, cout, k, groups=1):
            return nn.Sequential(
                nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
            )

        self.primary, self.cheap = conv(24, 12, 1), conv(12, 12, 3, groups=12)
        self.squeeze, self.expand1, self.expand3 = conv(24, 8, 1), conv(8, 16, 1), conv(8, 16, 3)
        self.primary2, self.cheap2 = conv(32, 20, 1), conv(20, 20, 3, groups=20)

    def forward(self, x):
        x1 = self.primary(x)
        ghost = torch.cat([x1, self.cheap(x1)], 1)
        ghost += x
        s = self.squeeze(ghost)
        fire = torch.cat([self.expand1(s), self.expand3(s)], 1)
        y1 = self.primary2(fire)
        again = torch.cat([y1, self.cheap2(y1)], 1)
        again *= 2
        return again, y1 + 1


def test_fast_writes_convolutions_into_their_concatenation(tmp_path):
    """`plan::concat`: the convolutions write their parts of the `cat` (kwexport's kernels,
    forced), or the `cat` copies what oneDNN made into them (torch's, forced); either way
    eager's values, and a part read after the join was changed keeps its own."""
    torch.manual_seed(0)
    model = ConcatenatedConvolutions().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 24, 13, 17)
    path = tmp_path / "concat.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch, kwexport\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"prog = kwexport.load({str(path)!r}, optimize='fast')\n"
        "first = prog(x)\n"
        "torch.set_num_threads(2)\n"
        "torch.save((first, prog(x)), sys.argv[1])\n"
    )
    outs = with_each_kernel(tmp_path, script)
    with torch.no_grad():
        want = model(x)
    for kernel, calls in outs.items():
        for got in calls:
            for g, w in zip(got, want):
                assert g.shape == w.shape and rel_err(g, w) < 1e-5, kernel
