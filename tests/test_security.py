"""Loading runs no code from the file: custom ops only when the caller allows them."""

import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import assert_same

import kwexport


@torch.library.custom_op("kwtest::scale", mutates_args=())
def scale(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


@scale.register_fake
def _(x, k):
    return torch.empty_like(x)


def uses_custom_op(x):
    return torch.ops.kwtest.scale(x, 3.0) + 1


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "custom.kwx"
    kwexport.save(kwexport.export(uses_custom_op, (torch.ones(3),)), path)
    return path


def test_custom_ops_need_the_callers_permission(custom_file):
    with pytest.raises(kwexport.ArtifactError) as e:
        kwexport.load(custom_file)
    assert str(e.value) == (
        'methods.forward.ops[0] (kwtest::scale.default): op namespace "kwtest" is not allowed '
        '(pass allow_ops=["kwtest::*"] to load it, once its library is registered)'
    )
    for allow in (["kwtest::*"], ["kwtest::scale"], ["kwtest::scale.default"]):
        prog = kwexport.load(custom_file, allow_ops=allow)
        x = torch.randn(3)
        assert_same(prog(x), uses_custom_op(x))
    with pytest.raises(kwexport.ArtifactError, match="not allowed"):
        kwexport.load(custom_file, allow_ops=["kwtest::other"])
    with pytest.raises(ValueError, match=r'allow_ops: "kwtest" is not of the form'):
        kwexport.load(custom_file, allow_ops=["kwtest"])


def test_unregistered_custom_ops_are_not_imported(custom_file):
    """A fresh process that never registered the op: allowed, but not found; nothing imported."""
    script = textwrap.dedent(f"""
        import sys, kwexport
        try:
            kwexport.load({str(custom_file)!r}, allow_ops=["kwtest::*"])
        except kwexport.ArtifactError as e:
            print(e)
        assert "test_security" not in sys.modules
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        f"methods.forward.ops[0] (kwtest::scale.default): op not found in the running torch {torch.__version__} "
        "(custom ops must be registered before loading)"
    )


def test_only_the_ops_a_pass_inserts_load_from_other_torch_namespaces(tmp_path):
    """`mkldnn::_convolution_pointwise` (what `optimize="fast"` lowers convolutions onto) loads
    from a file too, running as the convolution it stands for, as does `_linear_pointwise`
    (fused linears); torch's other oneDNN ops don't."""
    import json

    import kwexport._cli

    conv = torch.nn.Conv2d(3, 4, 3).eval()
    path = tmp_path / "conv.kwx"
    kwexport.save(kwexport.export(conv, (torch.randn(1, 3, 6, 6),)), path)

    def rewrite(op: str, dst: str) -> str:
        d = kwexport._rt.describe(str(path))
        header = json.loads(d["header"])
        ops = header["methods"]["forward"]["ops"]
        node = header["methods"]["forward"]["graph"]["nodes"][0]
        ops[node["op"]] = {"name": op, "schema": None}
        node["args"] = node["args"][:3] + [
            {"list": [{"int": 0}, {"int": 0}]},
            {"list": [{"int": 1}, {"int": 1}]},
            {"list": [{"int": 1}, {"int": 1}]},
            {"int": 1},
            {"str": "relu"},
            {"list": []},
            {"none": None},
        ]
        with open(path, "rb") as f:
            f.seek(d["data_offset"])
            data = f.read()
        out = tmp_path / dst
        kwexport._cli.write_atomic(str(out), kwexport._rt.container_head(json.dumps(header).encode()), [(0, data)])
        return str(out)

    x = torch.randn(1, 3, 6, 6)
    with torch.no_grad():
        want = torch.relu(conv(x))
    prog = kwexport.load(rewrite("mkldnn::_convolution_pointwise.default", "fused.kwx"))
    assert (prog(x) - want).abs().max() < 1e-5
    with pytest.raises(kwexport.ArtifactError, match='op namespace "mkldnn" is not allowed'):
        kwexport.load(rewrite("mkldnn::_convolution_transpose_pointwise.default", "other.kwx"))
