"""Inputs that are tensors but not plain strided ones: subclasses run as in eager, the rest
are an `InputError` naming the argument path, never a crash. Each case that crashed a
process runs in a child, so a regression fails the test instead of taking pytest down; and
an op error on the C path doesn't make every following failure pay torch's backtrace."""

import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import requires_abi

import kwexport

DISPATCHES = ["auto", "abi", "python"]


def f(x, y):
    return (x * y + 1.0).relu()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("odd") / "f.kwx"
    kwexport.save(kwexport.export(f, (torch.randn(2, 4), torch.randn(2, 4))), p)
    return p


def run_child(code: str) -> str:
    """Runs `code` in a fresh interpreter; its stdout, after checking it exited cleanly."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"child exited with {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_tensor_subclass_runs_its_torch_dispatch_as_in_eager(path, dispatch):
    out = run_child(f"""
        import torch, kwexport
        from torch.testing._internal.two_tensor import TwoTensor
        prog = kwexport.load({str(path)!r}, dispatch={dispatch!r})
        a = TwoTensor(torch.randn(2, 4), torch.randn(2, 4))
        b = torch.randn(2, 4)
        got, want = prog(a, b), (a * b + 1.0).relu()
        assert type(got) is TwoTensor, type(got)
        assert torch.equal(got.a, want.a) and torch.equal(got.b, want.b)
        plain = torch.randn(2, 4)  # plain calls after a subclass still run as before
        assert torch.equal(prog(plain, b), (plain * b + 1.0).relu())
        print("ok")
    """)
    assert out.strip() == "ok"


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_a_storage_resized_under_its_tensor_is_an_input_error(path, dispatch):
    # Eager crashes on this (SIGSEGV in the mul kernel); kwexport must not.
    out = run_child(f"""
        import torch, kwexport
        prog = kwexport.load({str(path)!r}, dispatch={dispatch!r})
        x = torch.randn(2, 4)
        x.untyped_storage().resize_(0)
        try:
            prog(x, torch.randn(2, 4))
        except kwexport.InputError as e:
            print(e)
        y = torch.randn(4, 4)[1:3]
        y.untyped_storage().resize_(16)  # holds 4 floats; the view reads from the 5th
        try:
            prog(torch.randn(2, 4), y)
        except kwexport.InputError as e:
            print(e)
    """)
    assert out.splitlines() == [
        "x: expected a tensor whose storage holds its view (32 bytes), got a storage of 0 bytes",
        "y: expected a tensor whose storage holds its view (48 bytes), got a storage of 16 bytes",
    ]


def test_sparse_and_nested_tensors_are_input_errors(path):
    prog = kwexport.load(path)
    with pytest.raises(kwexport.InputError, match=r"^x: expected a strided tensor, got a sparse_coo tensor$"):
        prog(torch.randn(2, 4).to_sparse(), torch.randn(2, 4))
    nested = torch.nested.nested_tensor([torch.randn(4), torch.randn(4)])
    with pytest.raises(kwexport.InputError, match=r"^y: expected a strided tensor, got a nested tensor$"):
        prog(torch.randn(2, 4), nested)
    jagged = torch.nested.nested_tensor([torch.randn(4), torch.randn(4)], layout=torch.jagged)
    with pytest.raises(kwexport.InputError, match=r"^x: expected a strided tensor, got a nested tensor$"):
        prog(jagged, torch.randn(2, 4))


class LyingShape(torch.Tensor):
    @property
    def shape(self):
        return torch.Size([2, 4])


def test_a_subclass_is_checked_by_its_real_sizes(path):
    prog = kwexport.load(path)
    liar = torch.randn(3, 4).as_subclass(LyingShape)
    with pytest.raises(
        kwexport.InputError,
        match=r"^x: expected a tensor whose \.shape is its size \[3, 4\], got a LyingShape whose \.shape is \[2, 4\]$",
    ):
        prog(liar, torch.randn(2, 4))
    honest = torch.randn(2, 4).as_subclass(LyingShape)  # .shape and size agree: runs
    assert torch.equal(prog(honest, torch.ones(2, 4)).as_subclass(torch.Tensor), f(honest, torch.ones(2, 4)))


@requires_abi
def test_after_an_op_error_on_the_c_path_failures_are_cheap_and_the_c_path_returns(tmp_path):
    def g(x, i):
        return x[i] + 1

    p = tmp_path / "g.kwx"
    kwexport.save(kwexport.export(g, (torch.randn(8, 4), torch.tensor([1, 2]))), p)
    prog = kwexport.load(p, dispatch="abi")
    x, bad, good = torch.randn(8, 4), torch.tensor([1, 99]), torch.tensor([3, 0])
    # The C path names the node and op; torch formats this error with its C++ backtrace.
    with pytest.raises(RuntimeError, match=r"^graph\.nodes\[0\] \(aten::index\.Tensor\): index 99 is out of bounds"):
        prog(x, bad)
    # The next calls run through torch's Python ops, whose error is cheap, of torch's own
    # class, and noted with the node and op.
    for _ in range(3):
        with pytest.raises(IndexError, match="index 99 is out of bounds") as e:
            prog(x, bad)
        assert e.value.__notes__ == ["kwexport: raised by graph.nodes[0] (aten::index.Tensor)"]
    # Once calls succeed again, the C path comes back.
    for _ in range(kwexport._rt.FALLBACK_CALLS_AFTER_ERROR):
        assert torch.equal(prog(x, good), g(x, good))
    with pytest.raises(RuntimeError, match=r"^graph\.nodes\[0\] \(aten::index\.Tensor\)"):
        prog(x, bad)
