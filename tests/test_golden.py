"""Every released format version keeps loading and reproducing its recorded outputs."""

import json
import pathlib

import pytest
from conftest import assert_same
from golden.tensor_codec import decode

import kwexport

GOLDEN = pathlib.Path(__file__).parent / "golden"
CASES = sorted(GOLDEN.glob("*/*.kwx"))


def test_every_released_version_has_golden_files():
    have = {p.parent.name for p in CASES}
    want = {f"{major}.{minor}" for major, minor in kwexport._rt.RELEASED_FORMAT_VERSIONS}
    assert want <= have, f"no golden files for format version(s) {sorted(want - have)}"


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_golden_file_loads_and_reproduces(path):
    prog = kwexport.load(path)
    assert prog.file_format_version == tuple(map(int, path.parent.name.split(".")))
    assert prog.format_version == kwexport.FORMAT_VERSION
    assert prog.extra_files["golden.txt"].startswith(path.stem)
    for call in json.loads(path.with_suffix(".json").read_text())["calls"]:  # in order: methods share state
        method = prog[call["method"]] if "method" in call else prog
        got, want = method(*decode(call["args"]), **decode(call["kwargs"])), decode(call["expected"])
        if "rtol" in call:  # a file written at `fast`: within its tolerance of eager
            assert prog.optimize == "fast"
            assert ((got - want).abs().max() / want.abs().max()).item() < call["rtol"]
        else:
            assert_same(got, want)
