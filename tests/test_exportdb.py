"""torch's own export examples (ExportDB, shipped in the wheel as `torch._export.db.examples`):
every case torch.export exports runs in kwexport and matches eager. The cases are read from
the installed torch, so a new torch brings its new cases into CI."""

import warnings

import pytest
import torch
from conftest import assert_same
from torch.utils import _pytree as pytree

import kwexport

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch._export.db.examples import all_examples

CASES = dict(sorted(all_examples().items()))

# Known gaps, each an open part of issue 21: a case here that starts to pass fails the test
# until it is taken off the list.
NOT_YET: dict[str, str] = {}


@pytest.mark.parametrize("name", list(CASES))
def test_exportdb_case(name, tmp_path):
    case = CASES[name]
    args, kwargs = case.example_args, case.example_kwargs or {}
    try:
        torch.export.export(case.model, args, kwargs, dynamic_shapes=case.dynamic_shapes, strict=False)
    except Exception as e:  # noqa: BLE001 - torch's own verdict on the case
        pytest.skip(f"torch.export can't export it: {type(e).__name__}")
    if name not in NOT_YET:
        _run(case, tmp_path)
        return
    try:
        _run(case, tmp_path)
    except Exception:  # noqa: BLE001 - the known gap
        pytest.xfail(NOT_YET[name])
    pytest.fail(f"{name} runs now: take it off NOT_YET")


def _run(case, tmp_path):
    args, kwargs = case.example_args, case.example_kwargs or {}
    want = case.model(*pytree.tree_map(_clone, args), **pytree.tree_map(_clone, kwargs))
    ex = kwexport.export(case.model, args, kwargs, dynamic_shapes=case.dynamic_shapes)
    kwexport.save(ex, tmp_path / "case.kwx")
    for dispatch in ("abi", "python"):
        prog = kwexport.load(tmp_path / "case.kwx", dispatch=dispatch)
        got = prog(*pytree.tree_map(_clone, args), **pytree.tree_map(_clone, kwargs))
        assert_same(got, want)


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x
