"""Format versions, upgraders, op-schema drift and the command line."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import assert_same
from test_errors import read_parts, rewrite

import kwexport
from kwexport.__main__ import describe

GOLDEN_V1 = __import__("pathlib").Path(__file__).parent / "golden" / "1.0"


def test_v1_file_loads_through_the_upgrader():
    prog = kwexport.load(GOLDEN_V1 / "tiny_mlp.kwx")
    assert prog.file_format_version == (1, 0)
    assert prog.format_version == kwexport.FORMAT_VERSION == (4, 0)
    assert prog.upgraders_applied == [
        "v1_to_v2_op_table",
        "v2_to_v3_containers",
        "v3_0_to_v3_1_tensor_defaults",
        "v3_to_v4_methods",
    ]
    assert list(prog.methods) == ["forward"]


def test_v2_file_loads_through_the_upgrader():
    prog = kwexport.load(GOLDEN_V1.parent / "2.0" / "tiny_mlp.kwx")
    assert prog.file_format_version == (2, 0)
    assert prog.upgraders_applied == ["v2_to_v3_containers", "v3_0_to_v3_1_tensor_defaults", "v3_to_v4_methods"]


def test_newer_minor_loads(tmp_path):
    path = tmp_path / "m.kwx"
    m = torch.nn.Linear(3, 2)
    kwexport.save(kwexport.export(m, (torch.ones(1, 3),)), path)
    raw, header, end = read_parts(path)
    major, minor = kwexport.FORMAT_VERSION
    header["format_version"] = {"major": major, "minor": minor + 1}
    header["a_field_from_the_future"] = {"ignored": True}
    rewrite(path, header, raw, end)
    prog = kwexport.load(path)
    assert prog.file_format_version == (major, minor + 1)
    x = torch.randn(1, 3)
    assert_same(prog(x), m(x))


def linspace_fn(x):
    return x * torch.linspace(0, 1, 100)


@pytest.fixture
def linspace_file(tmp_path):
    path = tmp_path / "l.kwx"
    kwexport.save(kwexport.export(linspace_fn, (torch.ones(100),)), path)
    return path


def op_entry(header, name):
    return next(i for i, op in enumerate(header["methods"]["forward"]["ops"]) if op["name"] == name)


def test_incompatible_op_schema_is_refused(linspace_file):
    raw, header, end = read_parts(linspace_file)
    i = op_entry(header, "aten::mul.Tensor")
    header["methods"]["forward"]["ops"][i]["schema"] = (
        "aten::mul.Tensor(Tensor self, Tensor other, int extra) -> Tensor"
    )
    header["producer"]["torch"] = "2.99.0"
    rewrite(linspace_file, header, raw, end)
    with pytest.raises(kwexport.ArtifactError) as e:
        kwexport.load(linspace_file)
    assert str(e.value) == (
        f"methods.forward.ops[{i}] (aten::mul.Tensor): the op's schema changed incompatibly and no op upgrader is registered: "
        f"saved with torch 2.99.0 as `aten::mul.Tensor(Tensor self, Tensor other, int extra) -> Tensor`, "
        f"the running torch {torch.__version__} has `{torch.ops.aten.mul.Tensor._schema}`"
    )


def test_compatible_op_schema_drift_is_noted(linspace_file):
    raw, header, end = read_parts(linspace_file)
    i = op_entry(header, "aten::mul.Tensor")
    # A new argument without a default is not compatible.
    header["methods"]["forward"]["ops"][i]["schema"] = "aten::mul.Tensor(Tensor self) -> Tensor"
    rewrite(linspace_file, header, raw, end)
    with pytest.raises(kwexport.ArtifactError, match="changed incompatibly"):
        kwexport.load(linspace_file)

    # An older torch's add lacked the trailing defaulted `alpha`: compatible, noted.
    def f(x):
        return x + 1

    path = linspace_file.parent / "add.kwx"
    kwexport.save(kwexport.export(f, (torch.ones(2),)), path)
    raw, header, end = read_parts(path)
    i = op_entry(header, "aten::add.Tensor")
    header["methods"]["forward"]["ops"][i]["schema"] = "aten::add.Tensor(Tensor self, Tensor other) -> Tensor"
    rewrite(path, header, raw, end)
    prog = kwexport.load(path)
    assert prog.load_notes == [
        f"aten::add.Tensor: the running torch {torch.__version__} adds argument(s) Scalar alpha=1; their defaults apply"
    ]
    assert_same(prog(torch.ones(2)), f(torch.ones(2)))


def test_op_upgrader_rewrites_old_linspace(linspace_file):
    raw, header, end = read_parts(linspace_file)
    i = op_entry(header, "aten::linspace.default")
    header["methods"]["forward"]["ops"][i]["schema"] = (
        "aten::linspace(Scalar start, Scalar end, int? steps=None, *, ScalarType? dtype=None, "
        "Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"
    )
    node = next(n for n in header["methods"]["forward"]["graph"]["nodes"] if n["op"] == i)
    node["args"][2] = {"none": None}  # the old default, which torch then read as 100 steps
    rewrite(linspace_file, header, raw, end)
    prog = kwexport.load(linspace_file)
    assert prog.load_notes == [
        f"aten::linspace.default: op upgrader linspace_steps_required rewrote its nodes for torch {torch.__version__}"
    ]
    x = torch.randn(100)
    assert_same(prog(x), linspace_fn(x))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kwexport", *map(str, args)], capture_output=True, text=True)


def test_inspect(tmp_path):
    out = run_cli("inspect", GOLDEN_V1 / "dynamic.kwx", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["format_version"] == [1, 0]
    assert info["needs_upgrade"] is True
    m = info["methods"]["forward"]
    assert m["signature"] == "dynamic(x, y)"
    assert m["ops"] == {"aten::cat.default": 1, "aten::softmax.int": 1}
    sym = m["symbols"][0]
    assert (sym["min"], sym["max"]) == (2, 16)
    assert m["inputs"][0]["shape"] == [f"{sym['name']} ({sym['name']} in [2, 16])", 5]
    assert info["extra_files"] == {"golden.txt": len("dynamic at format 1.0")}
    text = run_cli("inspect", GOLDEN_V1 / "tiny_mlp.kwx").stdout
    assert "signature:    TinyMLP.forward(x, *, mask=None)" in text
    assert (
        "format:       1.0 (needs upgrading to 4.0: v1_to_v2_op_table, v2_to_v3_containers, "
        "v3_0_to_v3_1_tensor_defaults, v3_to_v4_methods)" in text
    )
    assert describe(GOLDEN_V1.parent / "2.0" / "tiny_mlp.kwx")["weights"]["bytes"] > 0


def test_upgrade(tmp_path):
    old = GOLDEN_V1 / "tiny_mlp.kwx"
    new = tmp_path / "new.kwx"
    out = run_cli("upgrade", old, new)
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.strip()
        == f"{new}: format 1.0 -> 4.0 (v1_to_v2_op_table, v2_to_v3_containers, v3_0_to_v3_1_tensor_defaults, "
        "v3_to_v4_methods)"
    )
    a, b = kwexport.load(old), kwexport.load(new)
    assert b.file_format_version == (4, 0) and b.upgraders_applied == []
    x, mask = torch.randn(4, 6), torch.randn(3)
    assert_same(b(x, mask=mask), a(x, mask=mask))
    assert b.extra_files == a.extra_files
    # The data section is carried over byte for byte.
    d_old, d_new = describe(old), describe(new)
    assert d_old["weights"] == d_new["weights"]
    old_raw, new_raw = old.read_bytes(), new.read_bytes()
    assert (
        old_raw[kwexport._rt.describe(str(old))["data_offset"] :]
        == new_raw[kwexport._rt.describe(str(new))["data_offset"] :]
    )
    # It never overwrites without being asked.
    before = new.read_bytes()
    refused = run_cli("upgrade", old, new)
    assert refused.returncode == 1 and "exists; pass --force" in refused.stderr
    assert new.read_bytes() == before


def test_cli_reports_version_errors(tmp_path):
    path = tmp_path / "future.kwx"
    raw, header, end = read_parts(GOLDEN_V1 / "dynamic.kwx")
    header["format_version"] = {"major": 7, "minor": 1}
    path.write_bytes(raw)
    rewrite(path, header, raw, end)
    out = run_cli("inspect", path)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "kwexport: VersionError: file format 7.1 is newer than this runtime, which reads 1.0 to 4.x: upgrade kwexport"
    )


def test_cli_needs_no_torch(tmp_path):
    """inspect and upgrade read everything from the Rust core: torch is never imported."""
    new = tmp_path / "new.kwx"
    code = (
        "import sys; from kwexport._cli import main;"
        f"assert main(['upgrade', {str(GOLDEN_V1 / 'tiny_mlp.kwx')!r}, {str(new)!r}]) == 0;"
        f"assert main(['inspect', {str(new)!r}, '--json']) == 0;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert kwexport.load(new).file_format_version == tuple(kwexport.FORMAT_VERSION)
