"""Real models through export -> save -> load -> call, equal to eager."""

import collections
import json

import pytest
import torch
from conftest import assert_same, reversed_kwargs
from torch import nn
from torch.export import Dim

import kwexport


class KwargsMLP(nn.Module):
    """*args, keyword-only args, a defaulted kwarg and **kwargs holding nested dicts and lists."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.Sequential(nn.ReLU(), nn.Linear(16, 16), nn.GELU())
        self.out = nn.Linear(16, 4)

    def forward(self, x, *extra, scale, bias=None, temperature=1.0, **cfg):
        h = self.inp(x + sum(extra))
        h = self.hidden(h * scale)
        if bias is not None:
            h = h + bias
        h = h + cfg["shift"]["a"] * cfg["shift"]["b"][0] - cfg["shift"]["b"][1]
        return {"logits": self.out(h) / temperature, "hidden": [h, h.mean(-1)]}


def mlp_inputs(batch=5):
    args = (torch.randn(batch, 8), torch.randn(batch, 8))
    kwargs = {
        "scale": torch.randn(16),
        "bias": torch.randn(16),
        "shift": {"a": torch.randn(16), "b": [torch.randn(16), torch.randn(16)]},
    }
    return args, kwargs


def test_kwargs_mlp(roundtrip):
    torch.manual_seed(0)
    m = KwargsMLP().eval()
    args, kwargs = mlp_inputs()
    prog = roundtrip(m, args, kwargs)
    want = m(*args, **kwargs)
    assert_same(prog(*args, **kwargs), want)
    assert_same(prog(*args, **reversed_kwargs(kwargs)), want)
    args2, kwargs2 = mlp_inputs()
    kwargs2["shift"] = {"b": kwargs2["shift"]["b"], "a": kwargs2["shift"]["a"]}  # keys reordered
    assert_same(prog(*args2, **kwargs2), m(*args2, **kwargs2))


def test_small_mlp(roundtrip):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)).eval()
    x = torch.randn(4, 10)
    prog = roundtrip(m, (x,))
    for _ in range(3):
        x = torch.randn(4, 10)
        assert_same(prog(x), m(x))
    assert_same(prog(input=x), m(x))


class Encoder(nn.Module):
    def __init__(self, d=32, layers=3):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, src, *, mask):
        return self.enc(src, src_key_padding_mask=mask)


def test_transformer_encoder_with_keyword_only_mask(roundtrip):
    torch.manual_seed(0)
    m = Encoder().eval()
    src = torch.randn(2, 7, 32)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 5:] = True
    with torch.no_grad():
        prog = roundtrip(m, (src,), {"mask": mask})
        src2 = torch.randn(2, 7, 32)
        assert_same(prog(src2, mask=mask), m(src2, mask=mask))
        assert_same(prog(mask=mask, src=src2), m(src2, mask=mask))
    with pytest.raises(kwexport.SignatureError, match=r"missing 1 required keyword-only argument: 'mask'"):
        prog(src2)
    with pytest.raises(kwexport.InputError, match=r"mask: expected dtype torch.bool, got torch.float32"):
        prog(src2, mask=mask.float())


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )

    def forward(self, images):
        return self.body(images)


def test_conv_net_with_batch_norm(roundtrip):
    torch.manual_seed(0)
    m = ConvNet()
    m.train()
    for _ in range(3):  # non-trivial running statistics
        m(torch.randn(8, 3, 16, 16))
    m.eval()
    x = torch.randn(2, 3, 16, 16)
    prog = roundtrip(m, (x,))
    x2 = torch.randn(2, 3, 16, 16)
    assert_same(prog(x2), m(x2))


def test_training_mode_batch_norm_updates_its_statistics(roundtrip):
    # Refused before stateful programs (issue 11); test_state.py covers it in depth.
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    prog = roundtrip(m, (torch.randn(3, 4),))
    x = torch.randn(3, 4)
    assert_same(prog(x), m(x))
    assert_same(prog.state["1.running_var"], m[1].running_var)


def test_linear_and_tied_weights(roundtrip):
    m = nn.Linear(64, 64)
    prog = roundtrip(m, (torch.randn(2, 64),))
    x = torch.randn(2, 64)
    assert_same(prog(x), m(x))

    # The same weights twice stay one storage in the file.
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
            self.b = nn.Linear(8, 8, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    t = Tied()
    ex = kwexport.export(t, (torch.randn(2, 8),))
    header, weights, mutable = kwexport._write.document({"forward": ex})
    header, storages = kwexport._write.optimized(header, weights, mutable, "exact")
    assert len(storages) == len(header["weights"]["storages"]) == 1
    prog = roundtrip(t, (torch.randn(2, 8),))
    x = torch.randn(2, 8)
    assert_same(prog(x), t(x))


def double_then_add(x, y):
    return x * 2 + y.sum(-1, keepdim=True)


def test_dynamic_shapes_with_shared_dim(roundtrip):
    batch = Dim("batch", min=2, max=64)
    prog = roundtrip(
        double_then_add, (torch.randn(4, 3), torch.randn(4, 5)), dynamic_shapes={"x": {0: batch}, "y": {0: batch}}
    )
    # 1 too: a lower bound of 2 is torch's 0/1 specialization, which ep.module() doesn't enforce.
    for n in (1, 2, 7, 64):
        x, y = torch.randn(n, 3), torch.randn(n, 5)
        assert_same(prog(x, y), double_then_add(x, y))
    # Messages name the user's Dim, not torch's symbol.
    with pytest.raises(kwexport.InputError, match=r"^x: dimension 0 is batch with batch in \[2, 64\], got 65$"):
        prog(torch.randn(65, 3), torch.randn(65, 5))
    with pytest.raises(
        kwexport.InputError, match=r"^y: dimension 0 is batch = 6, since batch = 6 from x dimension 0, got 5$"
    ):
        prog(torch.randn(6, 3), torch.randn(5, 5))
    with pytest.raises(kwexport.InputError, match=r"^y: dimension 1 must be 5 \(static at export\), got 4"):
        prog(torch.randn(6, 3), torch.randn(6, 4))


def test_a_lower_bound_above_two_holds(roundtrip):
    prog = roundtrip(
        double_then_add,
        (torch.randn(4, 3), torch.randn(4, 5)),
        dynamic_shapes={"x": {0: Dim("rows", min=3)}, "y": {0: Dim("rows", min=3)}},
    )
    for n in (1, 2):
        with pytest.raises(kwexport.InputError, match=rf"^x: dimension 0 is rows with rows in \[3, inf\), got {n}$"):
            prog(torch.randn(n, 3), torch.randn(n, 5))
    x, y = torch.randn(3, 3), torch.randn(3, 5)
    assert_same(prog(x, y), double_then_add(x, y))


def test_dynamic_true_makes_every_dimension_dynamic(roundtrip):
    prog = roundtrip(double_then_add, (torch.randn(4, 3), torch.randn(4, 5)), dynamic=True)
    for n, k in ((1, 3), (6, 2), (9, 11)):
        x, y = torch.randn(n, k), torch.randn(n, 5 + k)
        assert_same(prog(x, y), double_then_add(x, y))
    with pytest.raises(ValueError, match="pass dynamic=True or dynamic_shapes, not both"):
        kwexport.export(double_then_add, (torch.randn(4, 3), torch.randn(4, 5)), dynamic=True, dynamic_shapes={})


def test_dynamic_shapes_in_nested_kwargs(roundtrip):
    def f(x, *, cfg):
        return x.reshape(-1) * cfg["scale"][0].sum() + cfg["shift"].mean()

    n = Dim("n", min=1, max=32)
    dyn = {"x": {0: n}, "cfg": {"scale": [{0: n}], "shift": None}}
    prog = roundtrip(
        f, (torch.randn(3, 2),), {"cfg": {"scale": [torch.randn(3)], "shift": torch.randn(4)}}, dynamic_shapes=dyn
    )
    for k in (1, 5, 32):
        x, cfg = torch.randn(k, 2), {"shift": torch.randn(4), "scale": [torch.randn(k)]}
        assert_same(prog(x, cfg=cfg), f(x, cfg=cfg))
    with pytest.raises(
        kwexport.InputError,
        match=r"^cfg\['scale'\]\[0\]: dimension 0 is n = 5, since n = 5 from x dimension 0, got 4$",
    ):
        prog(torch.randn(5, 2), cfg={"shift": torch.randn(4), "scale": [torch.randn(4)]})


def test_derived_dim(roundtrip):
    def f(x, y):
        return x[1:] + y

    d = Dim("d", min=2, max=20)
    prog = roundtrip(f, (torch.randn(5), torch.randn(4)), dynamic_shapes={"x": {0: d + 1}, "y": {0: d}})
    for k in (2, 9):
        x, y = torch.randn(k + 1), torch.randn(k)
        assert_same(prog(x, y), f(x, y))
    with pytest.raises(kwexport.InputError, match=r"^y: dimension 0 is d = 4, since d = 4 from x dimension 0, got 7$"):
        prog(torch.randn(5), torch.randn(7))


Pair = collections.namedtuple("Pair", ["first", "second"])


def test_output_structure_is_rebuilt(roundtrip):
    def f(x, *, pair):
        return {"z": Pair(x + pair.first, [pair.second, (x,)]), "a": x.shape[0], "b": None}

    x, pair = torch.randn(3), Pair(torch.randn(3), torch.randn(2))
    prog = roundtrip(f, (x,), {"pair": pair})
    got = prog(x, pair=pair)
    assert_same(got, f(x, pair=pair))
    assert isinstance(got["z"], Pair)  # the class itself, as its module is loaded
    assert list(got) == ["z", "a", "b"]
    with pytest.raises(kwexport.InputError, match=r"^pair: expected a Pair\(first, second\), got a tuple of 2 items$"):
        prog(x, pair=(pair.first, pair.second))


def test_in_place_ops_on_intermediates_run_as_traced(roundtrip):
    def f(x, mask):
        h = x * 2
        h.masked_fill_(mask, 0.0)  # on a fresh intermediate: safe to run in place
        return h.relu_()

    x, mask = torch.randn(4, 3), torch.rand(4, 3) > 0.5
    prog = roundtrip(f, (x, mask))
    for _ in range(2):  # the input is never written, so calls stay repeatable
        x2 = torch.randn(4, 3)
        before = x2.clone()
        assert_same(prog(x2, mask), f(x2.clone(), mask))
        assert torch.equal(x2, before)


def test_in_place_ops_on_inputs_write_the_callers_tensor(roundtrip):
    # Refused before stateful programs (issue 11): now applied as torch.export applies it.
    def f(x):
        y = x.view(-1)
        y.add_(1)  # writes to the caller's tensor through a view
        return x * 2

    prog = roundtrip(f, (torch.zeros(2, 2),))
    x = torch.zeros(2, 2)
    assert_same(prog(x), torch.full((2, 2), 2.0))
    assert_same(x, torch.ones(2, 2))


def test_torch_sym_functions_on_sizes(roundtrip):
    # Exported graphs call torch.sym_* on symbolic sizes (Llava's sym_ite, for one).
    def f(x, y):
        n = torch.sym_max(x.shape[0], y.shape[0])
        m = torch.sym_ite(x.shape[0] > y.shape[0], x.shape[0], y.shape[0] + 1)
        return x.new_zeros(n, torch.sym_min(m, 5)) + torch.sym_float(x.shape[0])

    b = Dim("b", max=50)
    c = Dim("c", max=50)
    prog = roundtrip(f, (torch.randn(3, 2), torch.randn(4, 2)), dynamic_shapes={"x": {0: b}, "y": {0: c}})
    ops = {o["name"] for o in json.loads(kwexport._rt.describe(prog.path)["header"])["methods"]["forward"]["ops"]}
    assert {"torch::sym_max", "torch::sym_ite", "torch::sym_min"} <= ops, ops
    for n, k in ((3, 4), (7, 2), (6, 6)):
        x, y = torch.randn(n, 2), torch.randn(k, 2)
        assert_same(prog(x, y), f(x, y))
