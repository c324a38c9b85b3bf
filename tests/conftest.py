import pytest
import torch

import kwexport


@pytest.fixture(params=["abi", "python"])
def roundtrip(tmp_path, request):
    """export -> save -> load, returning the loaded Program: once with every node the stable
    C ABI covers run through it, once with every node through torch's Python ops."""
    counter = iter(range(10**6))

    def go(f, args, kwargs=None, *, dynamic_shapes=None, extra_files=None):
        ex = kwexport.export(f, args, kwargs, dynamic_shapes=dynamic_shapes)
        path = tmp_path / f"p{next(counter)}.kwx"
        kwexport.save(ex, path, extra_files=extra_files)
        return kwexport.load(path, dispatch=request.param)

    return go


def assert_same(got, want):
    """Equal values in the same structure: container types, dict key order, namedtuple types."""
    assert type(got).__name__ == type(want).__name__, (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        if hasattr(want, "_fields"):
            assert got._fields == want._fields
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want


def reversed_kwargs(kwargs):
    return dict(reversed(list(kwargs.items())))
