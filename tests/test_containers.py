"""Registered pytree containers at any depth, in inputs and outputs: dataclasses registered
with torch's pytree, classes registered with a JSON-able context, OrderedDict, defaultdict.
(transformers' ModelOutput classes are in test_zoo.py.)"""

import collections
import dataclasses
import subprocess
import sys
import types

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import assert_same

import kwexport


@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    right: torch.Tensor | None = None


pytree.register_dataclass(Pair)


class Box:
    """A class registered with a context of str and int."""

    def __init__(self, items, tag, scale):
        self.items, self.tag, self.scale = items, tag, scale


pytree.register_pytree_node(
    Box,
    lambda b: (list(b.items), (b.tag, b.scale)),
    lambda values, ctx: Box(list(values), *ctx),
    serialized_type_name="test_containers.Box",
)


def test_dataclass_output_nested_in_a_dict(roundtrip):
    def f(x):
        return {"pair": Pair(left=x + 1, right=x * 2), "n": x.sum()}

    x = torch.randn(3)
    got = roundtrip(f, (x,))(x)
    want = f(x)
    assert type(got["pair"]) is Pair  # the class is imported here: the real thing comes back
    assert_same(got["pair"].left, want["pair"].left)
    assert_same(got["pair"].right, want["pair"].right)


def test_dataclass_input_binds_by_field(roundtrip):
    def f(p, scale=1.0):
        return p.left * scale + p.right

    a, b = torch.randn(3), torch.randn(3)
    prog = roundtrip(f, (Pair(a, b),))
    assert_same(prog(Pair(right=b, left=a)), f(Pair(a, b)))
    with pytest.raises(kwexport.InputError, match=r"^p: expected a test_containers.Pair with left, right, got"):
        prog((a, b))
    with pytest.raises(
        kwexport.InputError, match=r"^p: expected a test_containers.Pair with left, right, got one whose pytree context"
    ):
        prog(Pair(a))  # right is None: another context
    with pytest.raises(kwexport.InputError, match=r"^p\.right: expected dtype torch.float32, got torch.int64$"):
        prog(Pair(a, b.long()))


def test_registered_class_with_a_json_context(roundtrip):
    def f(b):
        return Box([t * b.scale for t in b.items], b.tag, b.scale)

    x, y = torch.randn(2), torch.randn(2)
    prog = roundtrip(f, (Box([x, y], "v1", 3),))
    out = prog(Box([x, y], "v1", 3))
    assert type(out) is Box and (out.tag, out.scale) == ("v1", 3)
    assert_same(out.items, f(Box([x, y], "v1", 3)).items)
    with pytest.raises(
        kwexport.InputError,
        match=r"^b: expected a test_containers.Box with 0, 1, got one whose pytree context is \('v2', 3\)$",
    ):
        prog(Box([x, y], "v2", 3))


def test_ordered_dict_and_defaultdict(roundtrip):
    def f(d, od):
        out = collections.defaultdict(list)
        out["a"] = d["x"] + od["y"]
        return out, collections.OrderedDict(z=od["y"] * 2)

    d = collections.defaultdict(list, {"x": torch.randn(2)})
    od = collections.OrderedDict(y=torch.randn(2))
    got, want = roundtrip(f, (d, od))(d, od), f(d, od)
    assert type(got[0]) is collections.defaultdict and got[0].default_factory is list
    assert_same(dict(got[0]), dict(want[0]))
    assert got[0]["missing"] == []
    assert_same(got[1], want[1])


def test_unregistered_and_unsaveable_containers_are_refused_at_export():
    class Opaque:
        def __init__(self, t):
            self.t = t

    pytree.register_pytree_node(Opaque, lambda o: ([o.t], object()), lambda v, c: Opaque(v[0]))
    try:
        with pytest.raises(
            kwexport.ArtifactError,
            match=r"^outputs\['o'\]: can't save a container of type .*Opaque: its pytree context <object object at .*> is not made of None, bool, int, float, str, lists and tuples; register it with a flatten function whose context is$",
        ):
            kwexport.export(lambda x: {"o": Opaque(x)}, (torch.ones(1),))
    finally:
        pytree._deregister_pytree_node(Opaque)

    with pytest.raises(
        kwexport.ArtifactError,
        match=r"^outputs: can't save a defaultdict whose default_factory is <function .*>: kwexport saves only the builtin factories list, dict, set, tuple, int, float, str, bool",
    ):
        kwexport.export(lambda x: collections.defaultdict(lambda: 0, {"a": x}), (torch.ones(1),))


def test_standin_when_the_class_is_not_imported(tmp_path):
    mod = types.ModuleType("kwx_fake_outputs")

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        hidden: torch.Tensor | None = None

    Output.__module__ = mod.__name__
    Output.__qualname__ = "Output"
    mod.Output = Output
    sys.modules[mod.__name__] = mod
    pytree.register_dataclass(Output)
    try:
        path = tmp_path / "o.kwx"
        x = torch.randn(2, 3)
        kwexport.save(kwexport.export(lambda x: Output(logits=x * 2, hidden=x + 1), (x,)), path)
        assert type(kwexport.load(path)(x)) is Output
    finally:
        del sys.modules[mod.__name__]
        pytree._deregister_pytree_node(Output)
    out = kwexport.load(path)(x)  # the module is gone: a stand-in comes back
    assert isinstance(out, kwexport.StandIn) and out.class_name == "kwx_fake_outputs.Output"
    assert_same(out.logits, x * 2)
    assert_same(out["hidden"], x + 1)
    assert_same(out[0], x * 2)
    assert len(out[:2]) == 2 and len(out) == 2
    assert list(out) == list(out.keys()) == ["logits", "hidden"]
    assert_same(out.to_tuple()[1], x + 1)
    assert [k for k, _ in out.items()] == ["logits", "hidden"]
    assert "logits" in out and "loss" not in out
    assert repr(out).startswith("<kwexport stand-in for kwx_fake_outputs.Output>(logits=tensor(")
    with pytest.raises(AttributeError, match="Output stand-in has no field 'loss'"):
        out.loss
    with pytest.raises(AttributeError, match="read-only"):
        out.logits = x
    one = kwexport.load(path)(torch.ones(2, 3)[:1].expand(2, 3).contiguous())
    assert list(one.keys()) == list(out.keys()) and one != {"logits": 1}

    # A stand-in goes back in where the class went.
    def g(o):
        return o.logits + o.hidden

    sys.modules[mod.__name__] = mod
    pytree.register_dataclass(Output)
    try:
        kwexport.save(kwexport.export(g, (Output(x, x + 0.5),)), tmp_path / "g.kwx")
    finally:
        del sys.modules[mod.__name__]
        pytree._deregister_pytree_node(Output)
    assert_same(kwexport.load(tmp_path / "g.kwx")(out), x * 2 + x + 1)


def test_loading_imports_nothing_the_file_names(tmp_path):
    path = tmp_path / "p.kwx"
    kwexport.save(kwexport.export(lambda x: Pair(x, x), (torch.ones(2),)), path)
    code = (
        "import sys, kwexport, torch;"
        f"out = kwexport.load({str(path)!r})(torch.ones(2));"
        "assert 'test_containers' not in sys.modules;"
        "print(type(out).__name__, out.class_name)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["StandIn", "test_containers.Pair"]
