"""The calling conventions of PyTorch's kwargs change (`test_export_func_with_*`), through
a saved file, with the keyword arguments in both orders."""

import pytest
import torch
from conftest import assert_same, reversed_kwargs


def check(roundtrip, f, args, kwargs=None):
    kwargs = kwargs or {}
    prog = roundtrip(f, args, kwargs)
    want = f(*args, **kwargs)
    assert_same(prog(*args, **kwargs), want)
    assert_same(prog(*args, **reversed_kwargs(kwargs)), want)
    return prog


def test_kwargs(roundtrip):
    def kw_func(arg1, arg2, kw1, kw2):
        return arg1 + arg2, kw1 + kw2

    args = (torch.ones(6, 4), torch.ones(1, 1))
    kwargs = {"kw1": torch.ones(1, 1), "kw2": torch.ones(6, 4)}
    prog = check(roundtrip, kw_func, args, kwargs)
    # Positional parameters by name, keyword parameters by position.
    x, y = args
    assert_same(prog(arg2=y, arg1=x, kw2=kwargs["kw2"], kw1=kwargs["kw1"]), kw_func(*args, **kwargs))
    assert_same(prog(x, y, kwargs["kw1"], kwargs["kw2"]), kw_func(*args, **kwargs))


def test_pytree_kwargs(roundtrip):
    def kw_func(arg1, arg2, a, b):
        return arg1 + a["kw1"] + b[0], arg2 + a["kw2"] + b[1]

    args = (torch.ones(2, 3), torch.ones(3, 4))
    kwargs = {"a": {"kw1": torch.ones(2, 3), "kw2": torch.ones(3, 4)}, "b": [torch.ones(2, 3), torch.ones(3, 4)]}
    prog = check(roundtrip, kw_func, args, kwargs)
    # A nested dict with its keys in another order binds by key.
    swapped = {"a": reversed_kwargs(kwargs["a"]), "b": kwargs["b"]}
    assert_same(prog(*args, **swapped), kw_func(*args, **kwargs))


def test_default_kwargs(roundtrip):
    def kw_func(arg1, arg2, a, b=1):
        return arg1 + arg2, a["kw1"] + a["kw2"] + b

    def kw_func2(arg1, arg2, a=1, b=2):
        return arg1 + a, arg2 + b

    args = (torch.ones(6, 4), torch.ones(1, 1))
    kwargs1 = {"a": {"kw1": torch.ones(1, 1), "kw2": torch.ones(6, 4)}}
    kwargs2 = {"a": {"kw1": torch.ones(1, 1), "kw2": torch.ones(6, 4)}, "b": 2}
    prog = check(roundtrip, kw_func, args, kwargs1)
    assert_same(prog(*args, **kwargs1, b=1), kw_func(*args, **kwargs1))  # the default, given explicitly
    check(roundtrip, kw_func, args, kwargs2)
    prog2 = check(roundtrip, kw_func2, args, {"b": 1})
    assert_same(prog2(*args, b=1, a=1), kw_func2(*args, b=1))


def test_var_positional_args(roundtrip):
    def kw_func(arg1, arg2, *args):
        return arg1 + args[0], arg2 + args[1]

    args = (torch.ones(2, 3), torch.ones(3, 4), torch.ones(2, 3), torch.ones(3, 4))
    check(roundtrip, kw_func, args)


def test_keyword_only_args(roundtrip):
    def kw_func(arg1, arg2, *args, kw1, kw2):
        return arg1 + args[0] + kw1, arg2 + args[1] + kw2

    args = (torch.ones(2, 3), torch.ones(3, 4), torch.ones(2, 3), torch.ones(3, 4))
    kwargs = {"kw1": torch.ones(2, 3), "kw2": torch.ones(3, 4)}
    check(roundtrip, kw_func, args, kwargs)


def test_var_keyword_args(roundtrip):
    def kw_func(arg1, arg2, *args, kw1, kw2, **kwargs):
        return arg1 + args[0] + kw1 + kwargs["kw3"], arg2 + args[1] + kw2 + kwargs["kw4"]

    args = (torch.ones(2, 3), torch.ones(3, 4), torch.ones(2, 3), torch.ones(3, 4))
    kwargs = {"kw1": torch.ones(2, 3), "kw2": torch.ones(3, 4), "kw3": torch.ones(2, 3), "kw4": torch.ones(3, 4)}
    check(roundtrip, kw_func, args, kwargs)


def test_var_keyword_pytree_args(roundtrip):
    def kw_func(arg1, arg2, *args, kw1, kw2, **kwargs):
        return arg1 + arg2[0][0] + args[0] + kw1[0] + kwargs["kw3"][0], arg2[1] + args[1] + kw2 + kwargs["kw4"]

    args = (torch.ones(2, 3), [(torch.ones(2, 3),), torch.ones(3, 4)], torch.ones(2, 3), torch.ones(3, 4))
    kwargs = {
        "kw1": (torch.ones(2, 3),),
        "kw2": torch.ones(3, 4),
        "kw3": (torch.ones(2, 3), torch.ones(3, 4)),
        "kw4": torch.ones(3, 4),
    }
    check(roundtrip, kw_func, args, kwargs)


@pytest.mark.parametrize("seed", [0, 1])
def test_results_follow_inputs(roundtrip, seed):
    """Not just ones: random inputs at call time, different from the export's."""

    def kw_func(x, *, scale, shift=0.5):
        return x * scale + shift

    g = torch.Generator().manual_seed(seed)
    prog = roundtrip(kw_func, (torch.rand(3, 2, generator=g),), {"scale": torch.rand(2, generator=g)})
    x, s = torch.randn(3, 2, generator=g), torch.randn(2, generator=g)
    assert_same(prog(x, scale=s), kw_func(x, scale=s))
    assert_same(prog(scale=s, x=x, shift=0.5), kw_func(x, scale=s))
