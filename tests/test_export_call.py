"""Export calls the function exactly as the user called it: the same positional arguments and
keywords, nothing added. Defaults are recorded in the signature and bound by the runtime."""

import functools
import inspect
import json

import pytest
import torch
from conftest import assert_same

import kwexport


def spied(log):
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            log.append((len(args), list(kwargs)))
            return fn(*args, **kwargs)

        return wrapper

    return deco


def test_traced_call_is_the_users_call(roundtrip):
    log = []

    @spied(log)
    def f(x, y=None, *rest, scale=2.0, use_cache=False, **extra):
        out = x * scale
        return out if y is None else out + y

    x = torch.randn(3)
    prog = roundtrip(f, (x,), {"scale": 3.0})
    assert log and all(call == (1, ["scale"]) for call in log), log
    # Omitted defaults bind to their recorded values; passing them is the same call.
    assert_same(prog(x, scale=3.0), f(x, scale=3.0))
    assert_same(prog(x=x, scale=3.0, use_cache=False, y=None), f(x, scale=3.0))
    with pytest.raises(kwexport.InputError, match=r"^use_cache: expected False \(specialized at export\), got True$"):
        prog(x, scale=3.0, use_cache=True)


def test_keywords_stay_keywords_and_positionals_stay_positional(roundtrip):
    log = []

    class M(torch.nn.Module):
        @spied(log)
        def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_attentions=None):
            h = input_ids.float()
            return h if attention_mask is None else h * attention_mask

    ids, mask = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4)
    prog = roundtrip(M(), (), {"attention_mask": mask, "input_ids": ids})
    assert all(call == (1, ["attention_mask", "input_ids"]) for call in log), log  # self, then keywords
    assert_same(prog(input_ids=ids, attention_mask=mask), M()(input_ids=ids, attention_mask=mask))
    assert_same(prog(ids, mask), M()(ids, mask))


def test_one_tensor_passed_twice_is_traced_as_two_inputs(roundtrip):
    # torch.export alone traces `f(x, x)` as reading one input twice; later calls with two
    # different tensors must still see both.
    def f(a, b, *, c):
        return a + b * 2 + c[0]

    x, y, z = torch.randn(3), torch.randn(3), torch.randn(2, 3)
    prog = roundtrip(f, (x, x), {"c": x.expand(2, 3)})
    assert_same(prog(x, y, c=z), f(x, y, c=z))


def test_a_tensor_default_is_saved_in_the_file(roundtrip, tmp_path):
    default = torch.tensor([1.0, -2.0, 3.0])

    def f(x, y=default, *, scale=2.0):
        return x * y * scale

    prog = roundtrip(f, (torch.randn(2, 3),))
    x = torch.randn(2, 3)
    assert_same(prog(x), f(x), bitwise=True)
    assert_same(prog(x, torch.ones(3)), f(x, torch.ones(3)), bitwise=True)
    assert_same(prog(y=torch.ones(3), x=x, scale=2.0), f(x, torch.ones(3)), bitwise=True)
    sig = inspect.signature(prog)
    assert torch.equal(sig.parameters["y"].default, default) and sig.parameters["scale"].default == 2.0
    header = json.loads(kwexport._rt.describe(prog.path)["header"])
    assert header["methods"]["forward"]["signature"]["params"][1] == {
        "name": "y",
        "kind": "positional_or_keyword",
        "default_weight": "<default>.y",
    }
    assert (
        'y=<tensor "<default>.y">'
        in json.loads(kwexport._rt.describe(prog.path)["description"])["methods"]["forward"]["signature"]
    )
