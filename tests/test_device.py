"""Placing a program on a device at load: weights, device literals in the graph, input
checks and outputs follow it. Without a GPU, the placement is checked on the meta device;
the CUDA tests run where CUDA is available."""

import json
import pickle

import pytest
import torch
from torch import nn

import kwexport
from kwexport import InputError

CUDA = torch.cuda.is_available()


class Placed(nn.Module):
    """Weights, factories with a device literal, a transfer, a state buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("offset", torch.arange(3.0))

    def forward(self, x, *, scale: float = 2.0):
        pos = torch.arange(x.shape[0], device="cpu")  # a literal of the exported device
        h = self.lin(x) * scale + pos[:, None] + self.offset
        return {"h": h, "zeros": torch.zeros(2, device=x.device), "mask": h > 0}


def saved(tmp_path):
    torch.manual_seed(0)
    m = Placed().eval()
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(m, (torch.randn(5, 4),)), path)
    return m, path


def test_default_device_is_where_it_was_exported(tmp_path):
    _, path = saved(tmp_path)
    assert kwexport.load(path).device == torch.device("cpu")
    assert kwexport.load(path, device="cpu").device == torch.device("cpu")


@pytest.mark.parametrize("dispatch", ["auto", "python"])
def test_meta_placement_runs_every_output_on_meta(tmp_path, dispatch):
    m, path = saved(tmp_path)
    prog = kwexport.load(path, device=torch.device("meta"), dispatch=dispatch)
    assert prog.device == torch.device("meta")
    out = prog(torch.empty(5, 4, device="meta"))
    want = m(torch.randn(5, 4))
    assert list(out) == ["h", "zeros", "mask"]
    for k in out:
        assert out[k].device == torch.device("meta"), k
        assert out[k].shape == want[k].shape and out[k].dtype == want[k].dtype, k


def test_an_input_on_another_device_names_the_path_and_both_devices(tmp_path):
    _, path = saved(tmp_path)
    prog = kwexport.load(path, device="meta")
    with pytest.raises(InputError) as e:
        prog(torch.randn(5, 4))
    assert str(e.value) == "x: expected a tensor on meta, got one on cpu"
    with pytest.raises(InputError, match="^x: expected a tensor on cpu, got one on meta$"):
        kwexport.load(path)(torch.empty(5, 4, device="meta"))


def test_bad_devices_are_refused_at_load(tmp_path):
    _, path = saved(tmp_path)
    with pytest.raises(ValueError, match=r"""^device "gpu9": Invalid device string: 'gpu9'$"""):
        kwexport.load(path, device="gpu9")
    if not CUDA:
        with pytest.raises(ValueError, match='^device "cuda:1": CUDA is not available in this process$'):
            kwexport.load(path, device="cuda:1")


def test_placement_travels_with_pickles_and_copies(tmp_path):
    import copy

    _, path = saved(tmp_path)
    prog = kwexport.load(path, device="meta")
    assert pickle.loads(pickle.dumps(prog)).device == torch.device("meta")
    assert copy.copy(prog).device == torch.device("meta")


def test_inspect_says_where_it_was_exported(tmp_path):
    from kwexport._rt import describe

    _, path = saved(tmp_path)
    assert json.loads(describe(path)["description"])["device"] == "cpu"


@pytest.mark.skipif(not CUDA, reason="CUDA is not available")
@pytest.mark.parametrize("dispatch", ["auto", "abi", "python"])
def test_cuda_placement_matches_eager_on_cuda(tmp_path, dispatch):
    m, path = saved(tmp_path)
    prog = kwexport.load(path, device="cuda", dispatch=dispatch)
    assert prog.device == torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(5, 4)
    with torch.no_grad():
        want = m(x)  # eager can't run it on CUDA: its arange names the CPU
    got = prog(x.cuda())
    for k in want:
        assert got[k].device == prog.device
        torch.testing.assert_close(got[k].cpu(), want[k])
    with pytest.raises(InputError, match="expected a tensor on cuda:0, got one on cpu"):
        prog(x)


@pytest.mark.skipif(not CUDA, reason="CUDA is not available")
def test_cuda_paths_agree_bitwise(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benches"))
    import workloads

    for name in ["kwargs_mlp", "transformer", "convnet"]:
        f, args, kwargs = workloads.build(name)
        path = tmp_path / f"{name}.kwx"
        kwexport.save(kwexport.export(f, args, kwargs), path)
        move = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t  # noqa: E731
        cargs = torch.utils._pytree.tree_map(move, args)
        ckwargs = torch.utils._pytree.tree_map(move, kwargs)
        outs = {d: kwexport.load(path, device="cuda", dispatch=d)(*cargs, **ckwargs) for d in ["abi", "python"]}
        a, b = (torch.utils._pytree.tree_leaves(o) for o in outs.values())
        assert all(torch.equal(x, y) for x, y in zip(a, b)), name


def test_views_become_reshapes_on_another_kind_of_device(tmp_path):
    """A graph exported on the CPU views tensors whose strides the CPU's kernels chose;
    another device's kernels may choose others (CUDA's attention does), so there a view is
    a reshape: the same values, a copy only where the view is impossible."""

    def f(x):
        return x.transpose(0, 1).contiguous().view(-1) * 2, x.reshape(2, 6)

    path = tmp_path / "v.kwx"
    kwexport.save(kwexport.export(f, (torch.randn(3, 4),)), path)
    on_meta = {e["op"] for e in kwexport.load(path, device="meta", dispatch="python").dispatch["on_python"]}
    assert "aten::reshape.default" in on_meta and "aten::view.default" not in on_meta
    on_cpu = {e["op"] for e in kwexport.load(path, device="cpu", dispatch="python").dispatch["on_python"]}
    assert "aten::view.default" in on_cpu
    out = kwexport.load(path, device="meta")(torch.empty(3, 4, device="meta"))
    assert [o.shape for o in out] == [(12,), (2, 6)]


def test_off_the_cpu_adds_run_through_a_dispatching_shim(tmp_path):
    """The shims that call CPU kernels directly are for the CPU alone; elsewhere add.Tensor
    runs as subtract.Tensor with the opposite alpha (torch's own subtraction), which
    dispatches to the device's kernel."""
    if not kwexport._rt.stable_abi_available():
        pytest.skip("the running torch has no usable stable C ABI")

    def f(x, y):
        return torch.add(x, y, alpha=2) * y

    path = tmp_path / "a.kwx"
    kwexport.save(kwexport.export(f, (torch.randn(3), torch.randn(3))), path)
    prog = kwexport.load(path, device="meta", dispatch="abi")
    assert prog.dispatch == {"stable_abi": 2, "python": 0, "on_python": []}
    out = prog(torch.empty(3, device="meta"), torch.empty(3, device="meta"))
    assert out.device == torch.device("meta") and out.shape == (3,)
