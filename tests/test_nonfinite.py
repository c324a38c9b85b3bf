"""NaN and ±inf as eager has them: at `fast` and `precision="bf16"`, with kwexport's kernels
and with torch's forced in turn, a NaN or an infinity in an input reaches the outputs exactly
where eager's does. Each model is one kernel path, shallow enough that the special values stay
where they land (a deep net spreads them over every output and would hide a lost one)."""

import pytest
import torch
from conftest import with_each_kernel
from torch import nn
from torch.nn import functional as F

import kwexport


class Conv(nn.Module):
    """A convolution and its activation, then optionally a max pooling: the activation absorbed
    by kwexport's kernels (direct, indirect, Winograd, GEMM, depthwise) or by oneDNN's."""

    def __init__(self, cin, cout, k, act, *, stride=1, groups=1, pool=False):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups)
        self.act, self.pool = act, pool

    def forward(self, x):
        h = self.act(self.conv(x))
        return F.max_pool2d(h, 3, 2, 1) if self.pool else h


class Residual(nn.Module):
    """`relu(conv(x) + r)`: the add and the ReLU as the convolution's post-ops, with the
    special values in the residual alone."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x, r):
        return torch.relu(self.conv(x) + r)


class Mlp(nn.Module):
    """Linears with each activation the fused-linear pass absorbs, a layer norm and a GELU."""

    def __init__(self):
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(24, 24) for _ in range(3))
        self.norm = nn.LayerNorm(24)

    def forward(self, x):
        return (
            torch.relu(self.fc[0](x)),
            F.gelu(self.fc[1](x)),
            F.silu(self.fc[2](x)),
            self.norm(x),
            F.gelu(x, approximate="tanh"),
        )


class Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True)


def image(c, h=13, w=14):
    return torch.randn(2, c, h, w).contiguous(memory_format=torch.channels_last)


MODELS = {
    "stem 7x7 + relu": (lambda: Conv(3, 16, 7, nn.ReLU(), stride=2), lambda: (image(3, 23, 21),)),
    "3x3 + relu + max pool": (lambda: Conv(16, 32, 3, nn.ReLU(), pool=True), lambda: (image(16),)),
    "3x3 + hardsigmoid": (lambda: Conv(16, 24, 3, nn.Hardsigmoid()), lambda: (image(16),)),
    "strided 3x3 + swish": (lambda: Conv(16, 24, 3, nn.SiLU(), stride=2), lambda: (image(16),)),
    "1x1 + relu": (lambda: Conv(16, 40, 1, nn.ReLU()), lambda: (image(16),)),
    "1x1 + hardswish": (lambda: Conv(16, 40, 1, nn.Hardswish()), lambda: (image(16),)),
    "depthwise 7x7 + relu": (lambda: Conv(32, 32, 7, nn.ReLU(), groups=32), lambda: (image(32),)),
    "depthwise 3x3 + relu6": (lambda: Conv(32, 32, 3, nn.ReLU6(), groups=32), lambda: (image(32),)),
    "1x1 + relu6": (lambda: Conv(16, 40, 1, nn.ReLU6()), lambda: (image(16),)),
    "depthwise 3x3 + F.relu6": (lambda: Conv(32, 32, 3, F.relu6, groups=32), lambda: (image(32),)),
    "residual + relu": (Residual, lambda: (image(16), image(16))),
    "linears, norm, gelu": (Mlp, lambda: (torch.randn(3, 24),)),
    "attention": (Attention, lambda: tuple(torch.randn(1, 2, 9, 16) for _ in range(3))),
}

SPECIALS = (float("nan"), float("inf"), float("-inf"))


def spoil(inputs, seed):
    """The inputs with a few NaNs and infinities at random positions of each (one per kind in
    the first, or in the last where the model has several: the residual, the values)."""
    g = torch.Generator().manual_seed(seed)
    inputs = [t.clone() for t in inputs]
    target = inputs[-1]
    for special, at in zip(SPECIALS, torch.randperm(target.numel(), generator=g)[: len(SPECIALS)]):
        target[torch.unravel_index(at, target.shape)] = special
    return inputs


def masks(out):
    outs = out if isinstance(out, tuple) else (out,)
    return [(o.isnan(), o == float("inf"), o == float("-inf")) for o in outs]


def test_every_kernel_path_keeps_eagers_nan_and_inf(tmp_path):
    cases = {}
    for name, (build, make) in MODELS.items():
        torch.manual_seed(0)
        model = build().eval()
        inputs = make()
        path = tmp_path / f"{len(cases)}.kwx"
        kwexport.save(kwexport.export(model, inputs), path)
        spoiled = [spoil(inputs, seed) for seed in range(3)]
        with torch.no_grad():
            want = [masks(model(*s)) for s in spoiled]
        # The special values must change the outputs, or the test proves nothing.
        assert any(m.any() for w in want for triple in w for m in triple), name
        cases[name] = (str(path), spoiled, want)
    torch.save({name: (path, spoiled) for name, (path, spoiled, _) in cases.items()}, tmp_path / "cases.pt")
    script = (
        "import sys, torch, kwexport\n"
        f"cases = torch.load({str(tmp_path / 'cases.pt')!r})\n"
        "outs = {}\n"
        "for name, (path, spoiled) in cases.items():\n"
        "    for options in ({'optimize': 'fast'}, {'precision': 'bf16'}):\n"
        "        prog = kwexport.load(path, **options)\n"
        "        prog(*spoiled[0])  # the first call of each shape measures the kernels\n"
        "        outs[name, options.get('precision', 'fast')] = [prog(*s) for s in spoiled]\n"
        "torch.save(outs, sys.argv[1])\n"
    )
    for kernel, outs in with_each_kernel(tmp_path, script).items():
        for (name, level), got in outs.items():
            for i, (g, w) in enumerate(zip(got, cases[name][2])):
                for (gn, gp, gm), (wn, wp, wm) in zip(masks(g), w):
                    where = f"{name} at {level} with {kernel}'s kernels, inputs {i}"
                    assert torch.equal(gn, wn), f"{where}: NaN at {int(gn.sum())} places, eager {int(wn.sum())}"
                    assert torch.equal(gp, wp) and torch.equal(gm, wm), f"{where}: infinities differ"


@pytest.mark.parametrize("special", SPECIALS)
def test_conv_relu_max_pool_keeps_a_nan_column(special, tmp_path):
    """The issue's report: conv → ReLU → max pool lost eager's NaNs at `fast`."""
    torch.manual_seed(0)
    model = Conv(3, 16, 3, nn.ReLU(), pool=True).eval()
    x = torch.randn(1, 3, 16, 16)
    path = tmp_path / "crm.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    x[..., 5] = special
    with torch.no_grad():
        want = model(x)
    for options in ({"optimize": "fast"}, {"precision": "bf16"}):
        prog = kwexport.load(path, **options)
        for _ in range(2):
            got = prog(x)
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), options
