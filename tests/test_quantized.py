"""Quantized programs: what torch's pt2e flow writes (torchao's ``prepare_pt2e`` /
``convert_pt2e`` with the x86 quantizer, static and dynamic) loads without flags and computes
what the quantized reference graph computes: bit for bit at ``exact`` (the
``quantized_decomposed`` ops run as the aten arithmetic torch defines them with); at ``fast``,
a quantized linear runs on kwexport's int8 kernel (the same quantized values, the sums exact),
within float32 rounding of the reference where every quantized input agrees, and the other
weights' dequantization is folded at load."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import kwexport

torchao = pytest.importorskip("torchao")
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e  # noqa: E402
from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq  # noqa: E402


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(16, 8, 3, stride=2), nn.ReLU())
        self.head = nn.Linear(8 * 7 * 7, 10)

    def forward(self, x):
        return self.head(self.b(self.a(x)).flatten(1))


def quantized(model, x, dynamic):
    """The model as pt2e's x86 flow quantizes it, calibrated on ``x``."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = torch.export.export(model.eval(), (x,)).module()
        q = xiq.X86InductorQuantizer()
        q.set_global(xiq.get_default_x86_inductor_quantization_config(is_dynamic=dynamic))
        prepared = prepare_pt2e(graph, q)
        prepared(x)
        return convert_pt2e(prepared)


def saved(tmp_path, program, x):
    path = tmp_path / "q.kwx"
    kwexport.save(kwexport.export(program, (x,)), path)
    return path


def ops_of(program) -> set[str]:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_pt2e_linear_program_loads_without_flags_and_gives_the_references_bits(tmp_path, dynamic):
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    q = quantized(MLP(), x, dynamic)
    assert any("quantized_decomposed" in op for op in ops_of(q))
    if dynamic:
        assert any("choose_qparams" in op for op in ops_of(q))
    path = saved(tmp_path, q, x)
    for inputs in [x, torch.randn(4, 64) * 3]:
        want = q(inputs)
        exact = kwexport.load(path)
        assert torch.equal(exact(inputs), want)
        # Every node on the C path: no Python op per quantize or dequantize.
        assert exact.dispatch["python"] == 0, exact.dispatch
        got = kwexport.load(path, optimize="fast")(inputs)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


class OneLinear(nn.Module):
    def __init__(self, k=96, n=40):
        super().__init__()
        self.linear = nn.Linear(k, n)

    def forward(self, x):
        return self.linear(x)


# The second shape is large enough for AMX's tiles where the CPU has them (`int8_tiles`):
# at least 64 rows a thread and 384 channels, each ending inside a tile.
@pytest.mark.parametrize("shape", [(2, 5, 96, 40), (2, 100, 400, 130)], ids=["small", "tiles"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_fast_runs_quantized_linears_on_the_int8_kernel(tmp_path, dynamic, shape):
    torch.manual_seed(0)
    *rows, k, n = shape
    x = torch.randn(*rows, k)
    q = quantized(OneLinear(k, n), x, dynamic)
    path = saved(tmp_path, q, x)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    overload = "dynamic" if dynamic else "default"
    # One node: the quantize, dequantizes (and dynamic's choose_qparams) went into it.
    assert [n["op"] for n in fast.profile(x) if "::" in n["op"]] == [f"kwexport::linear_int8.{overload}"]
    with torch.profiler.profile() as prof:
        fast(x)
    assert not any("linear" in e.name for e in prof.events()), "torch ran the op, not kwexport's kernel"
    for inputs in [x, torch.randn(*rows, k) * 4, torch.zeros(*rows, k)]:
        want = q(inputs)
        got = fast(inputs)
        assert got.shape == want.shape
        # The same quantized input and products: float32 rounding of the sums apart.
        assert ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item() < 1e-5
        # Off the kernel (autograd, dispatch="python"), the op's Python form: the reference's
        # ops, so its bits.
        with torch.enable_grad():
            assert torch.equal(fast(inputs.clone().requires_grad_()).detach(), exact(inputs))
        assert torch.equal(kwexport.load(path, optimize="fast", dispatch="python")(inputs), exact(inputs))


def test_an_int8_mlp_at_fast_is_within_a_quantization_step_of_the_reference(tmp_path):
    """Through layers, a value within float32 rounding of a quantization boundary may land one
    step away in the next layer's input: the documented tolerance (docs/optimize.md)."""
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    for dynamic in (False, True):
        q = quantized(MLP(), x, dynamic)
        path = saved(tmp_path, q, x)
        exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
        ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
        # Each GELU went into its linear, applied as the int8 GEMM stores its results.
        assert ran == [f"kwexport::linear_int8.{'dynamic' if dynamic else 'default'}"] * 3, ran
        for inputs in [x, torch.randn(8, 64) * 3]:
            want = q(inputs)
            assert ((fast(inputs) - want).abs().max() / want.abs().max()).item() < 1e-2
            # Off the kernel, the fused ops' Python forms (GELU included): the reference's bits.
            with torch.enable_grad():
                assert torch.equal(fast(inputs.clone().requires_grad_()).detach(), exact(inputs))


def test_the_int8_linears_python_form_is_the_ops_it_replaced():
    """``kwexport::linear_int8`` through torch's dispatcher (its Python form) against the
    quantize/dequantize ops it stands for, with a weight zero point the kernel doesn't take."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the ops)

    from kwexport import _passes

    _passes.define_ops()
    qd = torch.ops.quantized_decomposed
    torch.manual_seed(0)
    x, w = torch.randn(3, 16), torch.randint(-128, 128, (8, 16), dtype=torch.int8)
    w_scale, w_zp, bias = torch.rand(8) / 50, torch.randint(-3, 3, (8,)), torch.randn(8)
    wd = qd.dequantize_per_channel(w, w_scale, w_zp, 0, -128, 127, torch.int8)
    xd = qd.dequantize_per_tensor(qd.quantize_per_tensor(x, 0.03, 7, 0, 255, torch.uint8), 0.03, 7, 0, 255, torch.uint8)
    xd_static = xd
    got = torch.ops.kwexport.linear_int8(x, 0.03, 7, 0, 255, w, w_scale, w_zp, bias, "none", None)
    assert torch.equal(got, torch.nn.functional.linear(xd, wd, bias))
    s, z = qd.choose_qparams.tensor(x, 0, 255, 1e-5, torch.uint8)
    xd = qd.dequantize_per_tensor.tensor(
        qd.quantize_per_tensor.tensor(x, s, z, 0, 255, torch.uint8), s, z, 0, 255, torch.uint8
    )
    got = torch.ops.kwexport.linear_int8.dynamic(x, 0, 255, 1e-5, torch.uint8, w, w_scale, w_zp, None, "none", None)
    assert torch.equal(got, torch.nn.functional.linear(xd, wd))
    # With the activation fused into it, as oneDNN's fused linear names it.
    got = torch.ops.kwexport.linear_int8.dynamic(x, 0, 255, 1e-5, torch.uint8, w, w_scale, w_zp, None, "gelu", "tanh")
    assert torch.equal(got, torch.nn.functional.gelu(torch.nn.functional.linear(xd, wd), approximate="tanh"))
    # ReLU6, named without its bounds; and a 1×1 convolution's [n, k, 1, 1] weight.
    got = torch.ops.kwexport.linear_int8.dynamic(
        x, 0, 255, 1e-5, torch.uint8, w[..., None, None], w_scale, w_zp, None, "hardtanh", None
    )
    assert torch.equal(got, torch.nn.functional.relu6(torch.nn.functional.linear(xd, wd)))
    # The fake quantization of the result moved into it (`linear_int8_output`), after the
    # activation.
    got = torch.ops.kwexport.linear_int8(x, 0.03, 7, 0, 255, w, w_scale, w_zp, bias, "hardtanh", None, 0.05, 3, 0, 255)
    y = torch.nn.functional.relu6(torch.nn.functional.linear(xd_static, wd, bias))
    assert torch.equal(got, torch.fake_quantize_per_tensor_affine(y, 0.05, 3, 0, 255))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: a 1×1 expansion with ReLU6 into a depthwise convolution (which no
    int8 kernel takes, so its input is fake-quantized), then a 1×1 projection; a 3×3 first,
    so that the expansion's input is channels-last."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.expand = nn.Sequential(nn.Conv2d(8, 32, 1), nn.ReLU6())
        self.depthwise = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.ReLU6())
        self.project = nn.Conv2d(32, 8, 1)

    def forward(self, x):
        return self.project(self.depthwise(self.expand(self.stem(x))))


def test_fast_fake_quantizes_an_int8_linears_result_as_its_gemm_stores_it(tmp_path):
    """The expansion's result, fake-quantized for the depthwise convolution, is quantized by
    the int8 GEMM as it stores it: the only fake quantization left is the stem's input's, and
    the result is the reference's within a quantization step, on the kernel and (autograd)
    on the op's Python form."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    q = quantized(InvertedResidual(), x, dynamic=False)
    fast = kwexport.load(saved(tmp_path, q, x), optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    assert ran.count("kwexport::linear_int8.default") == 2, ran
    assert ran.count("aten::fake_quantize_per_tensor_affine.default") == 1, ran
    for inputs in [x, torch.randn(2, 3, 12, 12) * 3]:
        want = q(inputs)
        for got in [fast(inputs), fast(inputs.clone().requires_grad_()).detach()]:
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2


class InvertedResidualHeads(nn.Module):
    """Two MobileNet heads whose expanded images are over 1 MB: a 1×1 expansion with ReLU6
    into a 3×3 depthwise convolution, and one with SiLU into a 5×5 at stride 2 (EfficientNet's),
    each then projected; a float32 stem first (3 channels), so that the expansions' input is
    channels-last."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.expand1 = nn.Sequential(nn.Conv2d(8, 48, 1), nn.ReLU6())
        self.dw1 = nn.Sequential(nn.Conv2d(48, 48, 3, padding=1, groups=48), nn.ReLU6())
        self.project1 = nn.Conv2d(48, 16, 1)
        self.expand2 = nn.Sequential(nn.Conv2d(16, 64, 1), nn.SiLU())
        self.dw2 = nn.Sequential(nn.Conv2d(64, 64, 5, stride=2, padding=2, groups=64), nn.SiLU())
        self.project2 = nn.Conv2d(64, 8, 1)

    def forward(self, x):
        h = self.project1(self.dw1(self.expand1(self.stem(x))))
        return self.project2(self.dw2(self.expand2(h)))


def test_fast_runs_an_int8_expansion_with_its_depthwise_convolution(tmp_path):
    """An int8 expansion, its `movedim` back to an image and the depthwise convolution that
    alone reads it run as one step (the profile shows the linear's node for the three) where
    the expanded image is large; within a quantization step of the reference, and under
    autograd (each node on its own) the same."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 80, 80)
    q = quantized(InvertedResidualHeads(), x, dynamic=False)
    fast = kwexport.load(saved(tmp_path, q, x), optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    assert ran.count("kwexport::linear_int8.default") == 4, ran
    convs = ran.count("mkldnn::_convolution_pointwise.default")
    assert convs == (1 if kwexport.kernel_info()["isa"] is not None else 3), ran
    for inputs in [x, torch.randn(1, 3, 80, 80) * 3]:
        want = q(inputs)
        got = fast(inputs)
        assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
        with torch.enable_grad():
            apart = fast(inputs.clone().requires_grad_()).detach()
        assert ((got - apart).abs().max() / want.abs().max()).item() < 1e-2


class GhostModule(nn.Module):
    """GhostNet's module: a 1×1 convolution whose result a depthwise convolution and the
    concatenation both read, so pt2e dequantizes its one quantize twice; the concatenation's
    first channels kept (its `[:, :oup]`), so pt2e quantizes its result too."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.primary = nn.Sequential(nn.Conv2d(16, 8, 1), nn.ReLU())
        self.cheap = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU())
        self.head = nn.Conv2d(12, 4, 1)

    def forward(self, x):
        x1 = self.primary(self.stem(x))
        return self.head(torch.cat([x1, self.cheap(x1)], 1)[:, :12])


def test_fast_fake_quantizes_a_value_two_ops_read_once(tmp_path):
    """The primary convolution's result, quantized once and dequantized for each of its two
    readers, is fake-quantized once, by the int8 GEMM as it stores it (it was twice, each its
    own pass), and the concatenation of values already on its levels isn't again: the fake
    quantizations left are the stem's input's and the depthwise result's (before the
    concatenation), and the result is the reference's within a quantization step."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    q = quantized(GhostModule(), x, dynamic=False)
    fast = kwexport.load(saved(tmp_path, q, x), optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    assert ran.count("kwexport::linear_int8.default") == 2, ran
    assert ran.count("aten::fake_quantize_per_tensor_affine.default") == 2, ran
    for inputs in [x, torch.randn(2, 3, 12, 12) * 3]:
        want, got = q(inputs), fast(inputs)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2


class PooledNet(nn.Module):
    """SqueezeNet's stem: a convolution, then a max pool of its quantized result."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv = nn.Conv2d(16, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(self.pool(self.stem(x)))


def test_fast_fake_quantizes_after_a_max_pool_over_fewer_values(tmp_path):
    """The stem's result is fake-quantized after the max pool rather than before it (the two
    commute), and once: pt2e quantizes the pool's result again with the same parameters,
    which changes nothing. The same values as the reference's, within a quantization step."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 33, 33)
    q = quantized(PooledNet(), x, dynamic=False)
    fast = kwexport.load(saved(tmp_path, q, x), optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    pool = ran.index("aten::max_pool2d.default")
    fake = "aten::fake_quantize_per_tensor_affine.default"
    assert ran[pool - 1] != fake and ran[pool + 1] == fake and ran[pool + 2] != fake, ran
    for inputs in [x, torch.randn(2, 3, 33, 33) * 3]:
        want, got = q(inputs), fast(inputs)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2


def test_a_pt2e_conv_net_loads_without_flags_and_gives_the_references_bits(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    q = quantized(ConvNet(), x, dynamic=False)
    path = saved(tmp_path, q, x)
    want = q(x)
    assert torch.equal(kwexport.load(path)(x), want)
    got = kwexport.load(path, optimize="fast")(x)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_fast_runs_a_static_int8_conv_nets_stem_on_float32_kernels_with_one_pass_fake_quantization(tmp_path):
    """At `fast`, the stem's quantize → dequantize pair (an image's 3 channels) is one fake
    quantization (kwexport's kernel, the pair's bits) and its convolution of an int8 weight is
    lowered as a float32 one, on a weight dequantized once at load; the next convolution runs
    on the int8 kernel. No plain `conv2d` is left, and no quantize arithmetic."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    q = quantized(ConvNet(), x, dynamic=False)
    path = saved(tmp_path, q, x)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    assert "aten::conv2d.default" not in ran and "aten::round.default" not in ran, ran
    assert ran.count("mkldnn::_convolution_pointwise.default") == 1, ran
    assert ran.count("kwexport::conv_int8.default") == 1, ran
    assert ran.count("aten::fake_quantize_per_tensor_affine.default") == 1, ran
    for inputs in [x, torch.randn(2, 3, 16, 16) * 3]:
        want = q(inputs)
        assert torch.equal(exact(inputs), want)
        # Float32 convolutions in another order: within a quantization step of the reference.
        assert ((fast(inputs) - want).abs().max() / want.abs().max()).item() < 1e-2


class SpatialNet(nn.Module):
    """Spatial convolutions of int8 weights: on the NCHW input, strided past one panel of
    output channels, with channels that don't fill a word (10), a 5×3 kernel, one whose
    result a depthwise convolution (float32) reads, so its quantization goes into it, and
    one of 3 groups of 8 input channels, and one of 6 groups of 8 channels in and out at stride 2
    (RegNet's, whose groups the AVX-512 kernel runs in lane pairs)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 10, 3, padding=1)
        self.b = nn.Sequential(nn.Conv2d(10, 80, 3, stride=2, padding=1), nn.ReLU())
        self.c = nn.Conv2d(80, 80, 3, padding=1, groups=80)
        self.d = nn.Sequential(nn.Conv2d(80, 24, (5, 3), padding=(2, 1)), nn.ReLU())
        self.e = nn.Conv2d(24, 48, 3, padding=1, groups=3)
        self.f = nn.Conv2d(48, 48, 3, stride=2, padding=1, groups=6)

    def forward(self, x):
        return self.f(self.e(self.d(self.c(self.b(self.a(x))))))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_fast_runs_spatial_int8_convolutions_on_the_int8_kernel(tmp_path, dynamic):
    """Each spatial convolution with 8 input channels (per group) or more becomes the int8
    convolution (choosing its input's parameters where they are dynamic), run on kwexport's
    kernel (torch's profiler records no Python form), its ReLU and (static) the quantization
    of a result the depthwise convolution reads fused with it; within a quantization step of
    the reference, channels-last; off the kernel (autograd), the op's Python form: the
    reference's ops."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 14, 13)
    q = quantized(SpatialNet(), x, dynamic=dynamic)
    path = saved(tmp_path, q, x)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    fused = f"kwexport::conv_int8.{'dynamic' if dynamic else 'default'}"
    assert ran.count(fused) == 5 and "aten::conv2d.default" not in ran, ran
    assert "aten::relu.default" not in ran and "aten::fake_quantize_per_tensor_affine.default" not in ran, ran
    with torch.profiler.profile() as prof:
        fast(x)
    if kwexport.kernel_info()["isa"] is not None:
        assert not [e.name for e in prof.events() if "conv_int8" in e.name]
    for inputs in [x, torch.randn(2, 8, 14, 13) * 3]:
        want, got = q(inputs), fast(inputs)
        assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
        # Under autograd (dynamic parameters require a gradient there: read detached).
        with torch.enable_grad():
            graded = fast(inputs.clone().requires_grad_()).detach()
        assert ((graded - exact(inputs)).abs().max() / want.abs().max()).item() < 1e-5


class WideBlock(nn.Module):
    """A ResNet block of 128 channels: two 3×3 convolutions at stride 1, the second adding the
    block's input, each then a ReLU."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(128, 128, 3, padding=1), nn.ReLU())
        self.b = nn.Conv2d(128, 128, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.b(self.a(x)) + x)


@pytest.mark.parametrize("size", [(10, 9), (8, 8)], ids=["odd", "even"])
def test_fast_runs_wide_int8_3x3_convolutions_within_a_quantization_step(tmp_path, size):
    """3×3 convolutions of 128 channels over 64 pixels or more, which without VNNI run by
    Winograd's transforms on int16 pairs (`kernels::int8::winograd`, the direct kernel's
    sums exactly): both on the int8 convolution, the residual add and ReLU fused, within a
    quantization step of the reference, with an odd image's half blocks."""
    torch.manual_seed(0)
    x = torch.randn(1, 128, *size)
    q = quantized(WideBlock(), x, dynamic=False)
    fast = kwexport.load(saved(tmp_path, q, x), optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    assert ran.count("kwexport::conv_int8.default") == 1 and ran.count("kwexport::conv_int8.residual") == 1, ran
    for inputs in [x, torch.randn(1, 128, *size) * 3]:
        want, got = q(inputs), fast(inputs)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2


def test_fast_runs_a_resnets_7x7_stem_on_the_int8_kernel_and_a_3x3_stem_in_float32(tmp_path):
    """An image's 3 channels in a 7×7 kernel (147 values a patch, ResNet's stem) run on the
    int8 convolution, its patches gathered into dense rows; in a 3×3 one (27 values) the
    float32 kernel is faster and runs it. Both within a quantization step of the reference."""
    torch.manual_seed(0)
    for kernel, want_int8 in [(7, 2), (3, 1)]:
        model = nn.Sequential(nn.Conv2d(3, 16, kernel, stride=2, padding=kernel // 2), nn.ReLU(), nn.Conv2d(16, 8, 3))
        x = torch.randn(2, 3, 20, 19)
        q = quantized(model, x, dynamic=False)
        fast = kwexport.load(saved(tmp_path, q, x), optimize="fast")
        ran = [n["op"] for n in fast.profile(x)]
        assert ran.count("kwexport::conv_int8.default") == want_int8, (kernel, ran)
        for inputs in [x, torch.randn(2, 3, 20, 19) * 3]:
            want = q(inputs)
            assert ((fast(inputs) - want).abs().max() / want.abs().max()).item() < 1e-2, kernel


class ResidualNet(nn.Module):
    """ResNet's two residual adds: a downsampling block, whose add sums two convolutions
    (the 3×3 and the strided 1×1), then a block adding its input; each add then a ReLU."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.a = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1))
        self.down = nn.Conv2d(16, 32, 1, stride=2)
        self.b = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1))

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.a(x) + self.down(x))
        return torch.relu(self.b(x) + x)


def test_fast_adds_an_int8_convolutions_residual_and_relu_as_it_stores_its_results(tmp_path):
    """Each residual add and the ReLU after it go into the int8 convolution before it
    (`conv_int8.residual`), run on kwexport's kernel (no Python form in torch's profiler), no
    add or ReLU left; within a quantization step of the reference; off the kernel (autograd),
    the op's Python form: the reference's ops."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 12, 11)
    q = quantized(ResidualNet(), x, dynamic=False)
    path = saved(tmp_path, q, x)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    assert ran.count("kwexport::conv_int8.residual") == 2, ran
    assert not [op for op in ran if op.startswith(("aten::add", "aten::relu"))], ran
    with torch.profiler.profile() as prof:
        fast(x)
    if kwexport.kernel_info()["isa"] is not None:
        assert not [e.name for e in prof.events() if "conv_int8" in e.name]
    for inputs in [x, torch.randn(2, 8, 12, 11) * 3]:
        want, got = q(inputs), fast(inputs)
        assert got.shape == want.shape
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
        with torch.enable_grad():
            graded = fast(inputs.clone().requires_grad_()).detach()
        assert ((graded - exact(inputs)).abs().max() / want.abs().max()).item() < 1e-5


class BottleneckNet(nn.Module):
    """ResNet's bottleneck blocks: 1×1, 3×3, then a 1×1 whose result the block's input (or,
    downsampling, a strided 1×1's) is added to before a ReLU; then MobileNetV2's projection,
    a 1×1 added to its input with no ReLU after."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(8, 32, 3, padding=1), nn.ReLU())
        self.a = nn.Sequential(nn.Conv2d(32, 16, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.a_out = nn.Conv2d(16, 32, 1)
        self.b = nn.Sequential(nn.Conv2d(32, 16, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU())
        self.b_out, self.down = nn.Conv2d(16, 48, 1), nn.Conv2d(32, 48, 1, stride=2)
        self.project = nn.Sequential(nn.Conv2d(48, 96, 3, padding=1, groups=48), nn.ReLU6(), nn.Conv2d(96, 48, 1))

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.a_out(self.a(x)) + x)
        x = torch.relu(self.b_out(self.b(x)) + self.down(x))
        return self.project(x) + x


def test_fast_adds_an_int8_1x1_convolutions_residual_as_it_stores_its_results(tmp_path, monkeypatch):
    """A 1×1 convolution, which `linear_int8` makes an int8 linear over its pixels, takes its
    residual add (and ReLU) as the int8 convolution it is (`conv_int8.residual`): no add or
    ReLU left, the same bits as the program without the fusion, within a quantization step of
    the reference, and the reference's ops off the kernel (autograd)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 12, 11)
    q = quantized(BottleneckNet(), x, dynamic=False)
    path = saved(tmp_path, q, x)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    monkeypatch.setenv("KWEXPORT_SKIP_PASSES", "conv_residual")
    apart = kwexport.load(path, optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    assert ran.count("kwexport::conv_int8.residual") == 3, ran
    assert not [op for op in ran if op.startswith(("aten::add", "aten::relu"))], ran
    assert "kwexport::conv_int8.residual" not in [n["op"] for n in apart.profile(x)]
    for inputs in [x, torch.randn(2, 8, 12, 11) * 3]:
        want, got = q(inputs), fast(inputs)
        assert torch.equal(got, apart(inputs))
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
        with torch.enable_grad():
            graded = fast(inputs.clone().requires_grad_()).detach()
        assert ((graded - exact(inputs)).abs().max() / want.abs().max()).item() < 1e-5


class PointwiseNet(nn.Module):
    """1×1 convolutions (MobileNet's expand and project), the first on the NCHW input."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.c = nn.Conv2d(16, 24, 1)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_fast_runs_1x1_int8_convolutions_on_the_int8_gemm(tmp_path, dynamic):
    """A 1×1 convolution of a quantized input is the int8 linear over each pixel's channels:
    on the kernel where the input is channels-last (after `fast`'s 3×3), on the op's Python
    form where it isn't (the NCHW input), within a quantization step of the reference."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 10, 10)
    q = quantized(PointwiseNet(), x, dynamic=dynamic)
    path = saved(tmp_path, q, x)
    fast = kwexport.load(path, optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    fused = f"kwexport::linear_int8.{'dynamic' if dynamic else 'default'}"
    assert ran.count(fused) == 2 and "aten::conv2d.default" not in ran, ran
    for inputs in [x, torch.randn(2, 8, 10, 10) * 3]:
        want, got = q(inputs), fast(inputs)
        assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2


class ChunkedNet(nn.Module):
    """ShuffleNet's branch: a 1×1 convolution on half the channels of a 3×3 one's output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 32, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 1)

    def forward(self, x):
        kept, branch = self.a(x).chunk(2, 1)
        return torch.cat([kept, self.b(branch)], 1)


def test_fast_runs_an_int8_convolution_on_a_slice_of_channels_on_the_kernel(tmp_path):
    """The 1×1 convolution's input is half of a channels-last tensor's channels, its pixels
    32 floats apart: the int8 kernel reads the rows where they lie (the op's Python form,
    which torch's profiler would record, doesn't run), within a quantization step of the
    reference."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 9, 11)
    q = quantized(ChunkedNet(), x, dynamic=False)
    fast = kwexport.load(saved(tmp_path, q, x), optimize="fast")
    assert "kwexport::linear_int8.default" in [n["op"] for n in fast.profile(x)]
    with torch.profiler.profile() as prof:
        got = fast(x)
    want = q(x)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
    if kwexport.kernel_info()["isa"] is not None:
        assert not [e.name for e in prof.events() if "linear_int8" in e.name]


def test_fast_fake_quantizes_in_one_pass_with_the_pairs_bits(tmp_path):
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the ops)

    qd = torch.ops.quantized_decomposed

    def pair(x):
        q = qd.quantize_per_tensor.default(x, 0.0173, 3, 0, 255, torch.uint8)
        return qd.dequantize_per_tensor.default(q, 0.0173, 3, 0, 255, torch.uint8)

    torch.manual_seed(0)
    x = torch.randn(2, 16, 9, 11) * 3
    path = tmp_path / "pair.kwx"
    kwexport.save(kwexport.export(pair, (x,)), path)
    fast = kwexport.load(path, optimize="fast")
    assert [n["op"] for n in fast.profile(x) if "::" in n["op"]] == ["aten::fake_quantize_per_tensor_affine.default"]
    for inputs in [x, x.contiguous(memory_format=torch.channels_last), torch.randn(2, 16, 9, 11) * 1e3]:
        got = fast(inputs)
        assert torch.equal(got, pair(inputs)) and got.stride() == inputs.stride()


def test_fast_fake_quantizes_a_dynamic_pair_with_its_bits(tmp_path):
    """Dynamic quantization's pair (parameters chosen per call, as tensors) is the
    `.tensor_qparams` fake quantization, on the same kernel, with the pair's bits."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the ops)

    qd = torch.ops.quantized_decomposed

    def pair(x):
        s, z = qd.choose_qparams.tensor(x, 0, 255, 1e-5, torch.uint8)
        q = qd.quantize_per_tensor.tensor(x, s, z, 0, 255, torch.uint8)
        return qd.dequantize_per_tensor.tensor(q, s, z, 0, 255, torch.uint8)

    torch.manual_seed(0)
    x = torch.randn(2, 16, 9, 11) * 3
    path = tmp_path / "pair.kwx"
    kwexport.save(kwexport.export(pair, (x,)), path)
    fast = kwexport.load(path, optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    assert "aten::fake_quantize_per_tensor_affine.tensor_qparams" in ran and "aten::reciprocal.default" not in ran, ran
    for inputs in [x, x.contiguous(memory_format=torch.channels_last), torch.rand(2, 16, 9, 11) + 2]:
        got = fast(inputs)
        assert torch.equal(got, pair(inputs)) and got.stride() == inputs.stride()


def test_a_quantize_op_the_format_does_not_know_is_refused(tmp_path):
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the ops)

    class PerToken(nn.Module):
        def forward(self, x):
            scales = torch.full((4, 1), 0.1)
            zeros = torch.zeros((4, 1), dtype=torch.int64)
            return torch.ops.quantized_decomposed.quantize_per_token(x, scales, zeros, -128, 127, torch.int8)

    x = torch.randn(4, 8)
    path = tmp_path / "t.kwx"
    kwexport.save(kwexport.export(PerToken(), (x,)), path)
    with pytest.raises(kwexport.ArtifactError, match='op namespace "quantized_decomposed" is not allowed'):
        kwexport.load(path)


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x, *, scale: float = 1.0, mask=None):
        y = self.b(torch.relu(self.a(x)))
        return y if mask is None else y * mask


@pytest.mark.parametrize("activations", ["static", "dynamic"])
def test_quantize_makes_an_int8_program_that_keeps_the_signature(tmp_path, activations):
    torch.manual_seed(0)
    model = Keywords().eval()
    x = torch.randn(4, 32)
    calibration = [((torch.randn(4, 32),), {}) for _ in range(3)]
    ex = kwexport.quantize(model, (x,), calibration=calibration, activations=activations)
    path = tmp_path / "int8.kwx"
    kwexport.save(ex, path)
    prog = kwexport.load(path)
    # The quantized graph: int8 weights, their dequantization, quantized activations.
    assert any("quantized_decomposed" in op for op in ops_of(ex.exported_program.graph_module))
    # The quantized graph's own result: it takes the call's leaves (x and the defaults).
    want = ex.exported_program.module()(x, 1.0, None)
    assert torch.equal(prog(x), want)
    assert torch.equal(prog(x=x), want), "called by keyword, as the original signature allows"
    with pytest.raises(kwexport.SignatureError):
        prog(x, 2.0)  # `scale` is keyword-only, as in the model
    # Close to the float32 model: int8's quantization step, not another computation.
    with torch.no_grad():
        ref = model(x)
    assert ((prog(x) - ref).abs().max() / ref.abs().max()).item() < 0.05


@pytest.mark.parametrize("activations", ["static", "dynamic"])
def test_quantize_with_reduce_range_quantizes_activations_to_128_levels(tmp_path, activations):
    """``reduce_range=True``: the x86 quantizer's activations of 128 levels, whose byte products
    sum exactly on ``vpmaddubsw`` where a CPU lacks VNNI; at ``fast`` on kwexport's int8
    kernels (the linear and the convolution), within float32 rounding of the quantized graph."""
    torch.manual_seed(0)
    for model, x, op in [
        (MLP().eval(), torch.randn(8, 64), "linear_int8"),
        (ConvNet().eval(), torch.randn(2, 3, 16, 16), "conv_int8"),
    ]:
        ex = kwexport.quantize(model, (x,), activations=activations, reduce_range=True)
        graph = ex.exported_program.graph_module.graph
        ranges = {
            (n.args[-3], n.args[-2]) if activations == "static" else (n.args[1], n.args[2])
            for n in graph.nodes
            if n.op == "call_function"
            and str(n.target).startswith(
                "quantized_decomposed.quantize_per_tensor"
                if activations == "static"
                else "quantized_decomposed.choose_qparams"
            )
        }
        assert ranges == {(0, 127)}, ranges
        path = tmp_path / f"{op}.kwx"
        kwexport.save(ex, path)
        fast = kwexport.load(path, optimize="fast")
        if kwexport.kernel_info()["isa"] is not None:
            assert any(op in n["op"] for n in fast.profile(x)), fast.profile(x)
        want = ex.exported_program.module()(x)
        # One layer's products exact, a value at a boundary one step away in the next layer
        # (test_an_int8_mlp_at_fast_is_within_a_quantization_step_of_the_reference).
        assert ((fast(x) - want).abs().max() / want.abs().max()).item() < 1e-2


class BasicBlock(nn.Module):
    """torchvision's ResNet block: one ReLU module called twice, a residual add."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.conv2(self.relu(self.conv1(x)))
        out += x
        return self.relu(out)


def test_quantize_takes_a_module_called_twice(tmp_path):
    """The x86 quantizer raised "Input partition has more than one output node" on a module
    called twice (every torchvision ResNet); each call is now quantized as its own, and both
    convolutions run on the int8 kernel at `fast` (the second with the residual add), within
    int8's step of float32."""
    torch.manual_seed(0)
    model, x = BasicBlock().eval(), torch.randn(2, 16, 10, 10)
    ex = kwexport.quantize(model, (x,))
    kwexport.save(ex, tmp_path / "int8.kwx")
    fast = kwexport.load(tmp_path / "int8.kwx", optimize="fast")
    ran = [n["op"] for n in fast.profile(x)]
    assert ran.count("kwexport::conv_int8.default") == ran.count("kwexport::conv_int8.residual") == 1, ran
    with torch.no_grad():
        ref = model(x.clone())
    assert ((fast(x) - ref).abs().max() / ref.abs().max()).item() < 0.05


def test_quantize_refuses_a_calibration_call_of_another_structure():
    with pytest.raises(kwexport.SignatureError, match="calibration call"):
        calibration = [((torch.randn(2, 32),), {"mask": torch.ones(2, 8)})]
        kwexport.quantize(Keywords().eval(), (torch.randn(2, 32),), calibration=calibration)


def test_quantize_keeps_dynamic_shapes(tmp_path):
    torch.manual_seed(0)
    model = Keywords().eval()
    ex = kwexport.quantize(model, (torch.randn(4, 32),), activations="dynamic", dynamic=True)
    path = tmp_path / "int8.kwx"
    kwexport.save(ex, path)
    prog, graph = kwexport.load(path), ex.exported_program.module()
    for batch in [1, 7]:
        x = torch.randn(batch, 32)
        assert torch.equal(prog(x), graph(x, 1.0, None))


def test_quantize_names_the_activation_modes():
    with pytest.raises(ValueError, match="activations must be 'static' or 'dynamic', not 'int4'"):
        kwexport.quantize(Keywords().eval(), (torch.randn(2, 32),), activations="int4")


TORCHAO_CONFIGS = ["Int8DynamicActivationInt8WeightConfig", "Int8WeightOnlyConfig"]


@pytest.mark.parametrize("config", TORCHAO_CONFIGS)
def test_a_torchao_int8_model_saves_as_plain_tensors_and_aten_ops(tmp_path, config):
    """torchao's ``quantize_`` keeps each weight as a tensor subclass and calls torchao's
    ops; the file holds the subclass's inner tensors and the ops' aten arithmetic."""
    from torchao import quantization

    torch.manual_seed(0)
    model = MLP().eval()
    quantization.quantize_(model, getattr(quantization, config)())
    x = torch.randn(4, 64)
    with torch.no_grad():
        want = model(x)
    path = tmp_path / "torchao.kwx"
    ex = kwexport.export(model, (x,))
    kwexport.save(ex, path)
    assert not [op for op in ops_of(ex.exported_program.graph_module) if op.startswith("torchao.")]
    assert "layers.0.parametrizations.weight.original0" in ex.exported_program.state_dict
    assert torch.equal(kwexport.load(path)(x), want), "the subclass's own computation, bit for bit"
    assert torch.allclose(kwexport.load(path, optimize="fast")(x), want, rtol=1e-5, atol=1e-6)


def test_a_torchao_int8_file_loads_and_runs_in_a_process_without_torchao(tmp_path):
    from torchao import quantization

    torch.manual_seed(0)
    model = MLP().eval()
    quantization.quantize_(model, quantization.Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.save({"x": x, "want": model(x)}, tmp_path / "io.pt")
    kwexport.save(kwexport.export(model, (x,)), tmp_path / "torchao.kwx")
    code = (
        "import sys, torch, kwexport;"
        f"io = torch.load({str(tmp_path / 'io.pt')!r});"
        f"prog = kwexport.load({str(tmp_path / 'torchao.kwx')!r});"
        "assert torch.equal(prog(io['x']), io['want']);"
        "assert 'torchao' not in sys.modules, 'loading imported torchao'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_quantize_a_pt2_from_the_command_line(tmp_path):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(4, 64)
    pt2, calls = tmp_path / "m.pt2", tmp_path / "calls.pt"
    torch.export.save(torch.export.export(model, (x,)), pt2)
    torch.save([((torch.randn(4, 64),), {}) for _ in range(3)], calls)

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "kwexport", "quantize", *map(str, args)], capture_output=True, text=True
        )

    with torch.no_grad():
        want = model(x)
    for activations, extra, overload in [("dynamic", [], "dynamic"), ("static", ["--calibrate", calls], "default")]:
        kwx = tmp_path / f"{activations}.kwx"
        out = cli(pt2, kwx, "--activations", activations, *extra)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().startswith(f"{kwx}: forward(x), int8 ({activations} activations)")
        prog = kwexport.load(kwx, optimize="fast")
        assert [n["op"] for n in prog.profile(x) if "::" in n["op"]] == [f"kwexport::linear_int8.{overload}"] * 3
        assert ((prog(x) - want).abs().max() / want.abs().max()).item() < 0.05
    # `--reduce-range`: the same program but for its activations' range.
    reduced = tmp_path / "reduced.kwx"
    assert cli(pt2, reduced, "--activations", "dynamic", "--reduce-range").returncode == 0
    assert cli(pt2, tmp_path / "again.kwx", "--activations", "dynamic").returncode == 0
    assert (tmp_path / "again.kwx").read_bytes() == (tmp_path / "dynamic.kwx").read_bytes() != reduced.read_bytes()
    got = kwexport.load(reduced, optimize="fast")(x)
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.05
    out = cli(pt2, tmp_path / "other.kwx", "--activations", "static")
    assert out.returncode == 1
    assert "static activations need calibration calls: pass --calibrate CALLS.pt" in out.stderr


class Conv1DNet(nn.Module):
    """transformers' ``Conv1D`` (GPT-2's attention and MLP): ``addmm`` with a ``[k, n]`` weight."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(64, 32) / 8), nn.Parameter(torch.randn(32))

    def forward(self, x):
        return torch.relu(torch.addmm(self.b, x.view(-1, 64), self.w)).view(*x.shape[:-1], 32)


def test_quantize_takes_gpt2s_addmm_linears(tmp_path):
    torch.manual_seed(0)
    model, x = Conv1DNet().eval(), torch.randn(2, 5, 64)
    ex = kwexport.quantize(model, (x,), activations="dynamic")
    assert "quantized_decomposed.dequantize_per_channel.default" in ops_of(ex.exported_program.graph_module)
    path = tmp_path / "int8.kwx"
    kwexport.save(ex, path)
    fast = kwexport.load(path, optimize="fast")
    ran = [n["op"] for n in fast.profile(x) if "::" in n["op"]]
    # The product and its ReLU: one int8 node between the reshapes.
    assert [op for op in ran if "reshape" not in op] == ["kwexport::linear_int8.dynamic"], ran
    want = ex.exported_program.module()(x)
    assert torch.equal(kwexport.load(path)(x), want)
    assert ((fast(x) - want).abs().max() / want.abs().max()).item() < 1e-5
    with torch.no_grad():
        ref = model(x)
    assert ((fast(x) - ref).abs().max() / ref.abs().max()).item() < 0.05


def test_kernel_info_names_the_int8_gemms_layout():
    """VNNI's byte quads where the AVX-512 family runs on a CPU with AVX512-VNNI or the AVX2
    family on one with AVX-VNNI (`KWEXPORT_ISA` forces a family), int16 pairs otherwise."""
    info = kwexport.kernel_info()
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("needs /proc/cpuinfo to know the CPU's features")
    lines = cpuinfo.read_text().splitlines()
    flags = next((line.split() for line in lines if line.startswith("flags")), [])
    vnni = {"avx512": "avx512_vnni" in flags, "avx2": "avx_vnni" in flags}.get(info["isa"], False)
    want = None if info["isa"] is None else "quads" if vnni else "pairs"
    assert info["int8"] == want, info
    # Activations of 128 levels (`reduce_range`): quads on `vpmaddubsw` on every x86 family.
    reduced = {None: None, "portable": "pairs"}.get(info["isa"], "quads")
    assert info["int8_reduced"] == reduced, info
    # AMX's tiles for quads on the AVX-512 family where the CPU has AMX-INT8 (Linux 5.16+
    # grants their state), unless `KWEXPORT_AMX=0`.
    tiles = info["isa"] == "avx512" and "amx_int8" in flags and os.environ.get("KWEXPORT_AMX") != "0"
    assert info["int8_tiles"] == tiles, info
