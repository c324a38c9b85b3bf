"""Where the time goes: `Program.profile` (per-node times of one call) and `kwexport bench`
(load, first and steady call, threads, top ops, on inputs made from the file alone)."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.export import Dim

import kwexport


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, *, mask):
        return {"out": self.fc2(self.fc1(x).relu()) * mask}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("bench") / "net.kwx"
    torch.manual_seed(0)
    ex = kwexport.export(
        Net().eval(),
        (torch.randn(3, 8),),
        {"mask": torch.ones(3, 4)},
        dynamic_shapes={"x": {0: Dim("batch")}, "mask": {0: Dim("batch")}},
    )
    kwexport.save(ex, p)
    return p


@pytest.mark.parametrize("dispatch", ["auto", "python"])
def test_profile_times_each_node_of_one_call(path, dispatch):
    prog = kwexport.load(path, dispatch=dispatch)
    x, mask = torch.randn(5, 8), torch.ones(5, 4)
    nodes = [n for n in prog.profile(x, mask=mask) if n["node"] is not None]
    ops = [n["op"] for n in nodes]
    assert ops == ["aten::linear.default", "aten::relu.default", "aten::linear.default", "aten::mul.Tensor"]
    assert [n["node"] for n in nodes] == [0, 1, 2, 3]
    assert all(n["us"] > 0 for n in nodes)
    assert {n["path"] for n in nodes} == ({"python"} if dispatch == "python" else {"c"})


def test_a_profiled_call_is_a_call(tmp_path):
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            self.n.add_(1)
            return x * self.n

    p = tmp_path / "c.kwx"
    kwexport.save(kwexport.export(Counter(), (torch.ones(2),)), p)
    prog = kwexport.load(p)
    prog.profile(torch.ones(2))
    assert torch.equal(prog(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(kwexport.InputError, match=r"^x: expected dtype torch.float32, got torch.float64$"):
        prog.profile(torch.ones(2, dtype=torch.float64))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kwexport", *map(str, args)], capture_output=True, text=True)


def test_bench_reports_on_inputs_made_from_the_file(path):
    out = run_cli("bench", path, "--dim", "batch=6", "--seconds", "0.1", "--optimize", "exact,fast", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["inputs"] == {"x": [6, 8], "mask": [6, 4]}
    assert list(r["levels"]) == ["exact", "fast"]
    for e in r["levels"].values():
        assert e["load_ms"] > 0 and e["first_call_ms"] > 0 and e["call_us"] > 0
        assert set(e["calls_per_s"]) == {"1", "2"} and e["scaling"] > 0
        ops = {o["op"] for o in e["top_ops"]}
        assert ops & {"aten::linear.default [c]", "aten::linear.default [python]"}, ops
        assert abs(sum(o["share"] for o in e["top_ops"]) - 1) < 1e-6
    text = run_cli("bench", path, "--shape", "x=2x8", "--shape", "mask=2x4", "--seconds", "0.1").stdout
    assert "inputs:       x=[2, 8], mask=[2, 4]" in text
    assert "optimize=exact:" in text and "steady call:" in text and "aten::linear.default" in text


def test_bench_refuses_an_unknown_dim_or_level(path):
    out = run_cli("bench", path, "--dim", "rows=3")
    assert out.returncode == 1
    assert out.stderr.strip() == "kwexport: ValueError: --dim names ['rows']; the file's symbols are ['batch']"
    out = run_cli("bench", path, "--optimize", "exact,turbo")
    assert out.returncode == 1
    assert out.stderr.strip() == "kwexport: ValueError: optimize must be 'exact' or 'fast', not 'turbo'"
