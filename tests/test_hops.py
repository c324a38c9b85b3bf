"""Higher-order ops with subgraphs: `torch.cond` (the tutorial's control flow), grad-mode and
autocast regions (what transformers' rotary embeddings produce), and the loops `map`, `scan`,
`while_loop` and `associative_scan`, on both dispatch paths. Any other higher-order op is
refused at export, by name."""

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
    from torch._higher_order_ops.out_dtype import out_dtype

    def f(x, w):
        return out_dtype(torch.ops.aten.mm.default, torch.int32, x, w)

    x = torch.randint(-5, 5, (3, 4), dtype=torch.int8)
    with pytest.raises(
        kwexport.ArtifactError,
        match=r"^node 'out_dtype': kwexport can't run the higher-order op 'out_dtype' \(it runs cond, wrap_with_set_grad_enabled, wrap_with_autocast, map_impl, scan, while_loop, associative_scan\)",
    ):
        kwexport.export(f, (x, x.T.contiguous()))


# The loops: each runs its subgraph with a nested plan (on the C path where it covers the
# nodes), over rows or until its condition fails.


class MapRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, xs, bias):
        from torch._higher_order_ops.map import map as hop_map

        return hop_map(lambda x, b: (self.lin(x).relu() + b, x.sum()), xs, bias)


def test_map_runs_its_body_per_row(roundtrip):
    torch.manual_seed(0)
    m = MapRows().eval()
    xs, bias = torch.randn(3, 4), torch.randn(4)
    prog = roundtrip(m, (xs, bias), dynamic_shapes={"xs": {0: torch.export.Dim("rows", max=64)}, "bias": None})
    for n in (1, 3, 7):
        xs = torch.randn(n, 4)
        assert_same(prog(xs, bias), m(xs, bias))


def test_scan_carries_and_stacks(roundtrip):
    from torch._higher_order_ops.scan import scan

    def f(init, xs, scale):
        def combine(carry, x):
            nxt = carry * scale + x
            return nxt, (nxt.sum(), nxt * 2)

        return scan(combine, init, xs)

    init, xs, scale = torch.zeros(4), torch.randn(5, 4), torch.randn(4)
    prog = roundtrip(f, (init, xs, scale))
    assert_same(prog(init, xs, scale), f(init, xs, scale))
    init2 = torch.randn(4)
    assert_same(prog(init2, xs, scale), f(init2, xs, scale))


def test_while_loop_runs_until_its_condition_fails(roundtrip):
    from torch._higher_order_ops.while_loop import while_loop

    def f(i, x, limit):
        return while_loop(lambda i, x: i < limit.sum(), lambda i, x: (i + 1, x * 2 + 1), (i, x))

    i, x = torch.tensor(0), torch.randn(3)
    prog = roundtrip(f, (i, x, torch.tensor([2, 3])))
    for limit in (torch.tensor([2, 3]), torch.tensor([0, 0]), torch.tensor([9, 1])):
        assert_same(prog(i, x, limit), f(i, x, limit))


def test_associative_scan_over_a_dim(roundtrip):
    from torch._higher_order_ops.associative_scan import associative_scan

    def f(x, y):
        return associative_scan(lambda a, b: (a[0] * b[0], a[1] + b[1]), (x, y), dim=1)

    x, y = torch.randn(2, 6), torch.randn(2, 6)
    prog = roundtrip(f, (x, y))
    assert_same(prog(x, y), f(x, y))


@requires_abi
def test_loop_bodies_run_on_the_c_path(tmp_path):
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(MapRows().eval(), (torch.randn(3, 4), torch.randn(4))), path)
    counts = kwexport.load(path, dispatch="abi").dispatch
    assert counts["stable_abi"] >= 3, counts
