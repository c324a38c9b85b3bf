"""Higher-order ops with subgraphs: `torch.cond` (the tutorial's control flow), grad-mode and
autocast regions (what transformers' rotary embeddings produce), on both dispatch paths.
Any other higher-order op is refused at export, by name."""

import pytest
import torch
from conftest import assert_same, requires_abi

import kwexport


class CondBranches(torch.nn.Module):
    """The torch.export tutorial's data-dependent control flow."""

    def forward(self, x):
        def true_fn(x):
            return torch.sin(x)

        def false_fn(x):
            return torch.cos(x)

        return torch.cond(x.sum() > 0, true_fn, false_fn, [x])


def test_cond_takes_the_branch_the_data_picks(roundtrip):
    x = torch.randn(3, 4).abs()
    prog = roundtrip(CondBranches(), (x,))
    assert_same(prog(x), CondBranches()(x))
    assert_same(prog(-x), CondBranches()(-x))


def test_cond_with_nested_region_and_two_operands(roundtrip):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            def true_fn(x, y):
                with torch.no_grad():
                    h = self.lin(x)
                return h + y, h

            def false_fn(x, y):
                return x - y, x * 2

            return torch.cond(y.mean() > 0, true_fn, false_fn, (x, y))

    torch.manual_seed(0)
    m = M().eval()
    x, y = torch.randn(2, 4), torch.randn(2, 4).abs()
    prog = roundtrip(m, (x, y))
    for yy in (y, -y):
        assert_same(prog(x, yy), m(x, yy))


def test_grad_mode_region_is_applied_and_restored(roundtrip):
    def f(x):
        with torch.no_grad():
            inner = (x * 2).requires_grad
        return x * 3, torch.tensor(inner)

    x = torch.randn(3, requires_grad=True)
    prog = roundtrip(f, (x,))
    before = torch.is_grad_enabled()
    out, _ = prog(x)
    assert torch.is_grad_enabled() == before
    assert_same(out, x * 3)
    assert out.requires_grad  # outside the region, autograd sees the call


def test_autocast_region(roundtrip):
    class M(torch.nn.Module):
        def forward(self, x, w):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = x @ w
            return y.float() + 1

    x, w = torch.randn(4, 8), torch.randn(8, 4)
    prog = roundtrip(M(), (x, w))
    assert_same(prog(x, w), M()(x, w))


@requires_abi
def test_region_nodes_run_on_the_c_path(tmp_path):
    class M(torch.nn.Module):
        def forward(self, x):
            with torch.no_grad():
                y = torch.relu(x).neg().exp()
            return y.sum(0)

    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(M(), (torch.randn(3, 4),)), path)
    counts = kwexport.load(path, dispatch="abi").dispatch
    assert counts["stable_abi"] >= 3, counts


def test_other_higher_order_ops_are_refused_at_export():
    from torch._higher_order_ops.map import map as hop_map

    def f(xs):
        return hop_map(lambda x: x * 2, xs)

    with pytest.raises(
        kwexport.ArtifactError,
        match=r"^node 'map_impl': kwexport can't run the higher-order op 'map_impl' \(it runs cond, wrap_with_set_grad_enabled, wrap_with_autocast\)",
    ):
        kwexport.export(f, (torch.randn(3, 2),))
