"""Files of several methods (format 4.0): one weight table, shared state, each method called
by name exactly like the module's own method."""

import copy
import json
import pickle
import subprocess
import sys

import pytest
import torch
from conftest import assert_same
from torch import nn

import kwexport


class Accumulator(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        return self.proj(x).relu()

    def accumulate(self, h, *, scale):
        self.total.add_(h.sum(0) * scale)
        return self.proj(self.total)

    def read(self, x):
        return self.proj(x) + self.total


def exports(m):
    x = torch.randn(2, 4)
    return {
        "forward": kwexport.export(m, (x,)),
        "accumulate": kwexport.export(m.accumulate, (x,), {"scale": torch.tensor(2.0)}),
        "read": kwexport.export(m.read, (x,)),
    }


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    m = Accumulator().eval()
    ex = exports(m)
    m.total.zero_()  # the traces ran on it
    path = tmp_path / "acc.kwx"
    kwexport.save(ex, path)
    return path, m


@pytest.mark.parametrize("dispatch", ["auto", "python"])
def test_methods_run_like_the_modules_methods_and_share_state(saved, dispatch):
    path, m = saved
    prog = kwexport.load(path, dispatch=dispatch)
    assert list(prog.methods) == ["accumulate", "forward", "read"]
    assert "read" in prog and "write" not in prog
    for _ in range(3):
        x, scale = torch.randn(2, 4), torch.tensor(0.5)
        assert_same(prog(x), m(x), bitwise=True)
        assert_same(prog.accumulate(x, scale=scale), m.accumulate(x, scale=scale), bitwise=True)
        # `read` sees the state `accumulate` wrote: one buffer, not one per method.
        assert_same(prog["read"](x), m.read(x), bitwise=True)
    assert_same(prog.state["total"], m.total, bitwise=True)
    prog.reset()
    assert torch.equal(prog.state["total"], torch.zeros(4))


def test_weights_are_stored_once(saved, tmp_path):
    path, m = saved
    alone = tmp_path / "forward.kwx"
    kwexport.save(kwexport.export(m, (torch.randn(2, 4),)), alone)
    info = json.loads(kwexport._rt.describe(str(path))["description"])
    # proj.weight, proj.bias and total, once each, read by three methods.
    assert info["weights"]["tensors"] == 3
    assert info["weights"]["bytes"] == (16 + 4 + 4) * 4
    assert info["methods"]["accumulate"]["writes"] == ["total"]
    assert info["methods"]["read"]["writes"] == []
    alone_info = json.loads(kwexport._rt.describe(str(alone))["description"])
    assert alone_info["weights"]["bytes"] == info["weights"]["bytes"]


def test_methods_by_name_and_their_errors(saved):
    path, _ = saved
    prog = kwexport.load(path)
    assert prog.read.name == "read" and prog["read"].__name__ == "Accumulator.read"
    assert str(prog.accumulate.__signature__) == "(h, *, scale)"
    assert repr(prog) == f'<kwexport.Program with methods accumulate, forward, read from "{path}">'
    with pytest.raises(
        KeyError, match=r"^'\"write\": the program has no such method; it holds accumulate, forward, read'$"
    ):
        prog["write"]
    with pytest.raises(AttributeError, match=r"has no attribute or method 'write'; it holds accumulate, forward, read"):
        prog.write  # noqa: B018
    # A method's signature errors name the method's own callable.
    with pytest.raises(kwexport.SignatureError, match=r"^Accumulator.accumulate\(\) missing 1 required keyword-only"):
        prog.accumulate(torch.randn(2, 4))


def test_a_file_without_forward_names_its_methods(tmp_path):
    m = Accumulator()
    ex = exports(m)
    path = tmp_path / "two.kwx"
    kwexport.save({"encode": ex["forward"], "decode": ex["read"]}, path)
    prog = kwexport.load(path)
    x = torch.randn(2, 4)
    assert_same(prog.encode(x), m(x), bitwise=True)
    with pytest.raises(TypeError, match=r"^this program has several methods and none is named 'forward': call one"):
        prog(x)
    with pytest.raises(TypeError, match=r"none is named 'forward'"):
        prog.__signature__  # noqa: B018


def test_copies_and_pickles_are_per_file(saved):
    path, m = saved
    prog = kwexport.load(path)
    x, scale = torch.randn(2, 4), torch.tensor(1.0)
    prog.accumulate(x, scale=scale)
    twin = copy.copy(prog)
    assert torch.equal(twin.state["total"], prog.state["total"])
    twin.accumulate(x, scale=scale)
    assert not torch.equal(twin.state["total"], prog.state["total"])  # its own state
    method = pickle.loads(pickle.dumps(prog.read))
    assert isinstance(method, kwexport.Method) and method.name == "read"
    assert_same(method(x), kwexport.load(path).read(x), bitwise=True)
    assert list(pickle.loads(pickle.dumps(prog)).methods) == ["accumulate", "forward", "read"]


def test_exported_programs_and_colliding_names(tmp_path):
    """Two unrelated modules, each with a `weight`: both kept, the second under its method's name."""
    a, b = nn.Linear(3, 3, bias=False), nn.Linear(3, 2, bias=False)
    x = torch.randn(2, 3)
    path = tmp_path / "pair.kwx"
    kwexport.save({"first": torch.export.export(a, (x,)), "second": kwexport.export(b, (x,))}, path)
    prog = kwexport.load(path)
    assert_same(prog.first(x), a(x), bitwise=True)
    assert_same(prog.second(x), b(x), bitwise=True)
    header = json.loads(kwexport._rt.describe(str(path))["header"])
    assert sorted(header["weights"]["tensors"]) == ["second.weight", "weight"]


@pytest.mark.parametrize(
    "methods, error, message",
    [
        ({}, ValueError, r"^save\(\) got no methods"),
        (
            {"_hidden": None},
            kwexport.ArtifactError,
            r"^methods\[\"_hidden\"\]: a method name is an ASCII Python identifier of at most 128 bytes, "
            r"not starting with '_'$",
        ),
        ({"ok": 3}, TypeError, r"^save\(\) takes the result of kwexport.export .* for method 'ok', got int$"),
    ],
)
def test_save_refuses_bad_methods(tmp_path, methods, error, message):
    with pytest.raises(error, match=message):
        kwexport.save(methods, tmp_path / "bad.kwx")
    assert not (tmp_path / "bad.kwx").exists()


def test_inspect_lists_methods(saved):
    path, _ = saved
    out = subprocess.run([sys.executable, "-m", "kwexport", "inspect", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "method accumulate:\n  signature:    Accumulator.accumulate(h, *, scale)\n" in out.stdout
    assert "  writes:       total\n" in out.stdout
    assert "method read:\n" in out.stdout
