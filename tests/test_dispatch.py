"""The two ways a node runs: torch's stable C ABI and torch's Python op objects. Every model
gives bitwise-identical results both ways (and equal to eager), whichever mix of paths the
plan chooses."""

import gc
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same, in_threads, requires_abi
from torch import nn
from torch.export import Dim

import kwexport

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent.parent / "benches"))
import workloads  # noqa: E402

MODES = ["auto", "abi", "python"]


def load_all(tmp_path, f, args, kwargs=None, **export_kw):
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(f, args, kwargs, **export_kw), path)
    return {mode: kwexport.load(path, dispatch=mode) for mode in MODES}


def check_paths(progs, f, args, kwargs=None):
    kwargs = kwargs or {}
    with torch.no_grad():
        want = f(*args, **kwargs)
        outs = {mode: p(*args, **kwargs) for mode, p in progs.items()}
    for out in outs.values():
        assert_same(out, want)
    assert_same(outs["abi"], outs["python"], bitwise=True)
    assert_same(outs["auto"], outs["python"], bitwise=True)


@requires_abi
@pytest.mark.parametrize("name", [*workloads.NAMES, "resnet18", "gpt2"])
def test_benchmark_workloads_agree_on_every_path(tmp_path, name):
    pytest.importorskip({"resnet18": "torchvision", "gpt2": "transformers"}.get(name, "torch"))
    f, args, kwargs = workloads.build(name)
    progs = load_all(tmp_path, f, args, kwargs)
    check_paths(progs, f, args, kwargs)
    n = len_nodes(progs["python"])
    assert progs["python"].dispatch["stable_abi"] == 0
    assert progs["python"].dispatch["python"] == n
    assert progs["python"].dispatch["on_python"][0]["why"] == "dispatch='python' was asked for"
    # Every node of every benchmark workload runs on the C path.
    assert progs["abi"].dispatch == {"stable_abi": n, "python": 0, "on_python": []}


def len_nodes(prog):
    return prog.dispatch["stable_abi"] + prog.dispatch["python"]


def counts(prog):
    return prog.dispatch["stable_abi"], prog.dispatch["python"]


class Zoo(nn.Module):
    """Argument kinds the C path encodes: optional tensors, int and float lists, strings,
    dtypes, bools, numbers wrapped as tensors; list and tuple returns."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.conv = nn.Conv1d(3, 4, 3, padding=1)

    def forward(self, x, idx, *, mode: str = "tanh"):
        a, b, c = torch.split(x, 4, dim=-1)  # list return
        h = F.gelu(self.norm(x), approximate=mode)  # str, optional tensors, 3 returns
        h = h.to(torch.float64).sum(-1, keepdim=True)  # dtype, int list, bool
        y = torch.cat([a * 2, b / 3, c - 1.5], dim=-1)  # tensor list, wrapped numbers
        y = y.index_select(-1, idx).clamp(min=-1.0)  # optional number
        z = self.conv(x.view(2, 3, 12)).flatten()  # int lists with defaults
        m = torch.max(x, dim=0)  # (values, indices) tuple return
        return y, h, z, m.values, m.indices, (x > 0).sum()  # bool tensor, int64 reduction


@requires_abi
def test_argument_kinds_agree(tmp_path):
    torch.manual_seed(0)
    m = Zoo().eval()
    args = (torch.randn(6, 12), torch.tensor([0, 5, 11, 3]))
    progs = load_all(tmp_path, m, args, {"mode": "tanh"})
    check_paths(progs, m, args, {"mode": "tanh"})
    assert progs["abi"].dispatch["stable_abi"] >= 10


def test_int_and_bool_tensors_keep_torch_type_promotion(tmp_path):
    # A Python number passed where an op takes a tensor promotes like the number: int32 * 0.5
    # is float32, not float64; bool + 1 is int64; int16 * 3 stays int16.
    def f(i, b, s):
        return i * 0.5, b + 1, s * 3, (i > 2) & True

    args = (torch.arange(5, dtype=torch.int32), torch.tensor([True, False]), torch.arange(3, dtype=torch.int16))
    progs = load_all(tmp_path, f, args)
    check_paths(progs, f, args)
    out = progs["abi"](*args)
    assert [t.dtype for t in out] == [torch.float32, torch.int64, torch.int16, torch.bool]


def test_symbolic_sizes_cross_the_c_path(tmp_path):
    # sym_size results are ints that flow into view's size list: native ints on the C path.
    class M(nn.Module):
        def forward(self, x):
            return x.view(x.shape[0] * 2, -1).relu() + 1

    x = torch.randn(4, 6)
    progs = load_all(tmp_path, M(), (x,), dynamic_shapes={"x": {0: Dim("b", min=2, max=64)}})
    for b in (2, 7, 64):
        x = torch.randn(b, 6)
        check_paths(progs, M(), (x,))


@requires_abi
def test_dispatch_counts_and_modes(tmp_path):
    def f(x):
        for _ in range(10):
            x = torch.relu(x)
        return x

    progs = load_all(tmp_path, f, (torch.randn(3),))
    assert progs["abi"].dispatch == {"stable_abi": 10, "python": 0, "on_python": []}
    assert progs["auto"].dispatch == {"stable_abi": 10, "python": 0, "on_python": []}
    assert progs["python"].dispatch == {
        "stable_abi": 0,
        "python": 10,
        "on_python": [{"op": "aten::relu.default", "nodes": 10, "why": "dispatch='python' was asked for"}],
    }
    with pytest.raises(ValueError, match="dispatch must be 'auto', 'abi' or 'python', not 'fast'"):
        kwexport.load(tmp_path / "m.kwx", dispatch="fast")


@requires_abi
def test_auto_keeps_a_lone_c_node_between_python_nodes_on_python(tmp_path):
    # full_like takes its fill value as a Scalar, which no C entry point kwexport uses can
    # pass: it runs in Python. A single mul between two would cost more to convert than it
    # saves.
    def f(x, y):
        return torch.full_like(torch.full_like(x, 2.0) * y, 3.0)

    progs = load_all(tmp_path, f, (torch.randn(3), torch.randn(3)))
    assert counts(progs["abi"]) == (1, 2)
    assert counts(progs["auto"]) == (0, 3)
    assert progs["abi"].dispatch["on_python"] == [
        {
            "op": "aten::full_like.default",
            "nodes": 2,
            "why": "argument 'fill_value' is a Scalar, which the stable C ABI can't pass",
        }
    ]
    assert progs["auto"].dispatch["on_python"][1] == {
        "op": "aten::mul.Tensor",
        "nodes": 1,
        "why": "dispatch='auto': moving its values to and from the C path costs more than it saves",
    }
    check_paths(progs, f, (torch.randn(3), torch.randn(3)))


@requires_abi
def test_op_errors_on_the_c_path_name_the_op(tmp_path):
    def f(x, idx):
        return x.index_select(0, idx)

    progs = load_all(tmp_path, f, (torch.randn(4), torch.tensor([1, 2])))
    bad = (torch.randn(4), torch.tensor([1, 9]))
    with pytest.raises(RuntimeError, match=r"graph.nodes\[\d+\] \(aten::index_select.default\): .*out of range"):
        progs["abi"](*bad)
    with pytest.raises(IndexError, match="out of range"):
        progs["python"](*bad)
    assert torch.equal(progs["abi"](torch.arange(4.0), torch.tensor([3, 0])), torch.tensor([3.0, 0.0]))


def test_autograd_records_through_the_c_path(tmp_path):
    # The dispatcher runs autograd as the Python ops do: gradients flow to inputs.
    def f(x, w):
        return (torch.relu(x) * w).sum(-1)

    progs = load_all(tmp_path, f, (torch.randn(3, 4), torch.randn(4)))
    grads = {}
    for mode, p in progs.items():
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
        w = torch.ones(4, requires_grad=True)
        p(x, w).sum().backward()
        grads[mode] = (x.grad, w.grad)
    for mode in MODES:
        assert torch.equal(grads[mode][0], grads["python"][0]) and torch.equal(grads[mode][1], grads["python"][1])


def test_no_tensor_or_handle_leaks(tmp_path):
    f, args, kwargs = workloads.build("kwargs_mlp")
    prog = load_all(tmp_path, f, args, kwargs)["abi"]
    with torch.no_grad():
        for _ in range(50):
            prog(*args, **kwargs)
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(500):
            prog(*args, **kwargs)
        gc.collect()
    assert len(gc.get_objects()) - before < 50


def test_threads_share_one_program_on_the_c_path(tmp_path):
    f, args, kwargs = workloads.build("convnet")
    prog = load_all(tmp_path, f, args, kwargs)["abi"]
    with torch.no_grad():
        want = prog(*args, **kwargs)

    def work():
        with torch.no_grad():
            for _ in range(5):
                assert torch.equal(prog(*args, **kwargs), want)

    in_threads(work, 4)


def test_sizes_used_as_tensor_arguments(tmp_path):
    # `x * x.shape[0]` with a dynamic dim passes a symbolic int where mul takes a tensor:
    # Python ops wrap it; the stable ABI can't, so that node stays on Python.
    class M(nn.Module):
        def forward(self, x):
            return (x * x.shape[0]).relu() + x.shape[1]

    x = torch.randn(4, 6)
    progs = load_all(tmp_path, M(), (x,), dynamic_shapes={"x": {0: Dim("b", min=2, max=64), 1: Dim("c", min=2, max=9)}})
    for shape in [(2, 3), (5, 9), (64, 2)]:
        check_paths(progs, M(), (torch.randn(*shape),))
    assert progs["abi"].dispatch["python"] >= 1


class Scalars(nn.Module):
    """Nodes whose schema has a Scalar: per-op shims (add/sub alpha, addmm, pow), Tensor
    overloads on wrapped numbers (comparisons, masked_fill), factories made at load."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x, i):
        a = x + self.lin(x)  # add.Tensor, addmm(beta=1, alpha=1)
        b = torch.add(a, x, alpha=2.5) - torch.sub(x, a, alpha=3)  # alpha given, float and int
        c = torch.addmm(x[0], x, self.lin.weight, beta=0.5, alpha=2)
        d = b.pow(2) + b.pow(0.5).nan_to_num() + b.pow(3) + b.pow(-1)
        e = (x > 0.25) & (i >= 2) | (i == 3)  # comparisons with a float and int Scalar
        f = b.masked_fill(x < 0, -1e9)
        n = torch.arange(6) + i  # an integer add: its shim can't take it, the op runs
        g = x.clone()
        g += a  # add_.Tensor
        return a, b, c, d, e, f, n, g, i + 1, (i > 1) + True


def scalar_args(dtype=torch.float32):
    torch.manual_seed(3)
    return torch.randn(6, 6, dtype=dtype), torch.arange(6)


@requires_abi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scalar_nodes_run_on_the_c_path_bitwise_equal(tmp_path, dtype):
    m = Scalars().to(dtype).eval()
    progs = load_all(tmp_path, m, scalar_args(dtype))
    check_paths(progs, m, scalar_args(dtype))
    assert progs["abi"].dispatch == {"stable_abi": len_nodes(progs["abi"]), "python": 0, "on_python": []}
    outs = progs["abi"](*scalar_args(dtype))
    assert [o.dtype for o in outs[-4:]] == [torch.int64, dtype, torch.int64, torch.bool]


def test_scalar_shims_fall_back_where_autograd_or_autocast_apply(tmp_path):
    m = Scalars().eval()
    progs = load_all(tmp_path, m, scalar_args())
    x, i = scalar_args()
    grads = {}
    for mode in ("abi", "python"):
        xg = x.clone().requires_grad_()
        out = progs[mode](xg, i)
        assert out[0].grad_fn is not None and out[2].grad_fn is not None
        sum(o.float().sum() for o in out[:3]).backward()
        grads[mode] = xg.grad
    assert torch.equal(grads["abi"], grads["python"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = progs["python"](x, i)
        got = progs["abi"](x, i)
    assert got[2].dtype == want[2].dtype == torch.bfloat16  # addmm autocasts
    assert_same(got, want, bitwise=True)


class NumberLiterals(nn.Module):
    """Binary ops on number literals that float32 can't hold exactly (a float32 tensor gets
    the number cast once at load; other dtypes the wrapped float64 number)."""

    def forward(self, x):
        outs = []
        for y in (x, x.half(), x.bfloat16(), x.double(), (x * 100).int(), (x > 0).byte(), x.sum()):
            outs += [y + 0.1, y - 1 / 3, y * 1e-45, y / 3.4e39, y * 16777217, 0.1 * y, y + (-0.0)]
            outs += [y > 0.1, y == 16777217, y <= 1 / 3]
            if y.dtype.is_floating_point:
                z = y.clone()
                z += 0.1
                z.mul_(1 / 3)
                outs += [z, torch.div(y, 0.7), torch.sub(y, 0.1, alpha=3)]
        return outs


@requires_abi
def test_number_literals_give_the_same_bits_on_every_path(tmp_path):
    m = NumberLiterals()
    torch.manual_seed(5)
    args = (torch.randn(5, 7),)
    progs = load_all(tmp_path, m, args)
    check_paths(progs, m, args)
    for x in (torch.randn(5, 7), torch.randn(5, 7) * 1e30, torch.full((5, 7), 16777216.0)):
        check_paths(progs, m, (x,))
    assert counts(progs["abi"])[1] == 0
    # Autograd through the nodes with a number, against the Python path.
    grads = {}
    for mode in ("abi", "python"):
        x = args[0].clone().requires_grad_()
        sum(o.double().sum() for o in progs[mode](x) if o.dtype.is_floating_point).backward()
        grads[mode] = x.grad
    assert torch.equal(grads["abi"], grads["python"])


@requires_abi
def test_arange_made_at_load_gives_each_call_its_own_tensor(tmp_path):
    def f(x):
        return torch.arange(4) + x

    prog = load_all(tmp_path, f, (torch.tensor(1),))["abi"]
    assert counts(prog) == (2, 0)
    first = prog(torch.tensor(1))
    first.add_(100)
    assert torch.equal(prog(torch.tensor(1)), torch.tensor([1, 2, 3, 4]))


@requires_abi
@pytest.mark.parametrize(
    "symbol",
    # With the shims: what weights (and linear's transposed weights) are made with in C.
    kwexport._rt.SHIM_SYMBOLS + ["aoti_torch__reinterpret_tensor", "aoti_torch_get_strides", "torch_call_dispatcher"],
)
def test_each_missing_symbol_falls_back_to_python(tmp_path, symbol):
    """A torch without a symbol runs the nodes that need it through Python: forced here by
    hiding one symbol at a time, in a fresh process (the ABI is resolved once)."""
    import subprocess

    m = Scalars().eval()
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(m, scalar_args()), path)
    torch.save(m(*scalar_args()), tmp_path / "want.pt")
    code = f"""
import torch, kwexport
x, i = torch.randn(6, 6, generator=torch.Generator().manual_seed(0)), torch.arange(6)
prog = kwexport.load({str(path)!r}, dispatch="abi")
d = prog.dispatch
print(d["stable_abi"], d["python"], sorted({{e["op"] for e in d["on_python"]}}))
torch.manual_seed(3)
args = torch.randn(6, 6), torch.arange(6)
for got, want in zip(prog(*args), torch.load({str(tmp_path / "want.pt")!r})):
    assert torch.equal(got, want), (got, want)
"""
    env = dict(__import__("os").environ, KWEXPORT_HIDE_SYMBOLS=symbol)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n_c, n_py, ops = out.stdout.split(maxsplit=2)
    expected = {
        "aoti_torch_cpu_add_Tensor": "['aten::add.Tensor', 'aten::add_.Tensor']",
        "aoti_torch_aten_subtract_Tensor": "['aten::sub.Tensor']",
        "aoti_torch_cpu_pow_Tensor_Scalar": "['aten::pow.Tensor_Scalar']",
        "aoti_torch_cpu_addmm_out": "['aten::addmm.default']",
        # Ops the dispatcher also runs: without their shim they stay on the C path.
        "aoti_torch_cpu_mul_Tensor": "[]",
        "aoti_torch_cpu_mm_out": "[]",
        # Weights through Python; linear through the dispatcher.
        "aoti_torch__reinterpret_tensor": "[]",
        "aoti_torch_get_strides": "[]",
        "torch_call_dispatcher": None,
    }[symbol]
    if expected is None:  # no stable ABI at all
        assert int(n_c) == 0 and int(n_py) > 0
    else:
        assert int(n_c) > 0 and ops.strip() == expected


def test_batched_linear_on_a_transposed_input_runs_eagers_kernels(tmp_path):
    """at::matmul folds a batched, non-contiguous input into one mm only when the weight
    requires grad, as an nn.Parameter does in eager; else it runs a slower expanded bmm.
    kwexport's weights behave like eager's, with nothing recorded on plain calls."""
    from torch.profiler import profile

    torch.manual_seed(0)
    lin = nn.Linear(16, 8)

    def f(x):
        return lin(x.transpose(0, 1))

    x = torch.randn(5, 4, 16)
    progs = load_all(tmp_path, f, (x,))
    with torch.no_grad():
        want = f(x)
    for mode, prog in progs.items():
        with profile() as p:
            out = prog(x)
        ops = {e.key for e in p.key_averages()}
        assert "aten::mm" in ops and "aten::bmm" not in ops, (mode, ops)
        assert torch.equal(out, want) and not out.requires_grad and out.grad_fn is None
        xg = x.clone().requires_grad_()
        prog(xg).sum().backward()
        xe = x.clone().requires_grad_()
        f(xe).sum().backward()
        assert torch.equal(xg.grad, xe.grad)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_on_batched_inputs_runs_folded_with_eagers_bits(tmp_path, bias):
    """A contiguous input of 3 or more dimensions runs linear's shim folded into a matrix, as
    at::linear runs it; a non-contiguous one runs the op itself. Same bits on every path."""
    from torch.profiler import profile

    torch.manual_seed(0)
    lin = nn.Linear(16, 8, bias=bias)

    def f(x, y, z):
        return lin(x), lin(y), lin(z.transpose(0, 1))

    args = (torch.randn(2, 3, 16), torch.randn(2, 1, 3, 16), torch.randn(3, 2, 16))
    with torch.no_grad():
        want = f(*args)
    for mode, prog in load_all(tmp_path, f, args).items():
        with profile() as p:
            got = prog(*args)
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w), mode
            assert not g.requires_grad
        names = [e.name for e in p.events()]
        if mode != "python":
            # Two folded inputs through the shim; the transposed one through at::linear.
            assert names.count("aten::linear") == 1, (mode, names)


def test_views_made_without_the_dispatcher_match_eager(tmp_path):
    """unsqueeze, transpose, slice, select, expand, view, permute and alias are made in Rust
    on calls without autograd: the same values and shapes as eager, errors still torch's, and
    autograd still flows where an input requires grad."""

    def f(x, i: int):
        a = x.unsqueeze(1).transpose(0, -1)  # [4, 1, 3]
        b = x[:, 1::2].expand(2, 3, 2)
        c = x.select(0, i).view(2, 2).permute(1, 0)
        d = x.reshape(-1)[2:-3].view(-1, 7)
        return a * 2, b + 1, c.sum(), d, torch.ops.aten.alias(x)

    from torch.profiler import profile

    x = torch.randn(3, 4)
    progs = load_all(tmp_path, f, (x, 1))
    for mode, prog in progs.items():
        with profile() as p:
            got = prog(x, 1)
        if mode != "python":  # no view went through the dispatcher
            ran = {e.name for e in p.events()}
            assert not ran & {"aten::unsqueeze", "aten::transpose", "aten::expand", "aten::permute"}, ran
        want = f(x, 1)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.stride() == w.stride() and torch.equal(g, w), mode
        xg = x.clone().requires_grad_()
        prog(xg, 1)[0].sum().backward()
        assert torch.equal(xg.grad, torch.full_like(x, 2.0)), mode


def _ops_run_matching_eager(tmp_path, f, args):
    """Calls `f`'s program at each mode, asserting eager's shapes, strides and values; the
    names of the ops torch's profiler saw each mode run."""
    from torch.profiler import profile

    want, ran = f(*args), {}
    for mode, prog in load_all(tmp_path, f, args).items():
        with profile() as p:
            got = prog(*args)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.stride() == w.stride() and torch.equal(g, w), mode
        ran[mode] = [e.name for e in p.events()]
    return ran


def test_views_of_strided_inputs_match_eager(tmp_path):
    """A view or reshape of a tensor that isn't contiguous (GPT-2's `split` of its fused q, k
    and v into heads) is made in Rust with torch's strides wherever torch's own is a view;
    a reshape with no view (a transposed matrix flattened) still copies, as torch's does."""

    def f(qkv, m):
        q, k, v = qkv.split(8, dim=-1)  # [2, 5, 8] each, rows 24 apart
        heads = q.reshape(2, 5, 2, 4), k.view(2, 5, 2, -1), v.reshape(10, 8)
        return heads + (m.t().reshape(-1), m.t().reshape(6, 1, 4))

    args = (torch.randn(2, 5, 24), torch.randn(4, 6))
    for mode, ran in _ops_run_matching_eager(tmp_path, f, args).items():
        if mode != "python":
            # Only the flattened transpose (no view exists) went to torch's reshape.
            assert ran.count("aten::view") == 0 and ran.count("aten::reshape") <= 1, (mode, ran)


def test_flatten_and_movedim_made_without_the_dispatcher_match_eager(tmp_path):
    """A classifier's flatten of its pooled channels-last features and the int8 passes'
    movedim are views made in Rust: eager's values, shapes and strides; a flatten with no view
    (a transposed matrix's) still copies through torch's op."""

    def f(x, m):
        pooled = torch.nn.functional.adaptive_avg_pool2d(x, 1)  # [2, 8, 1, 1], channels-last
        rows = torch.movedim(x, -3, -1)  # [2, 5, 6, 8], dense
        return torch.flatten(pooled, 1), rows * 2, torch.movedim(rows, -1, -3), torch.flatten(m.t())

    args = (torch.randn(2, 8, 5, 6).contiguous(memory_format=torch.channels_last), torch.randn(4, 6))
    for mode, ran in _ops_run_matching_eager(tmp_path, f, args).items():
        if mode != "python":
            # Only the transposed matrix's flatten (no view exists) went to torch's op.
            assert ran.count("aten::flatten") <= 1 and "aten::movedim" not in ran, (mode, ran)


def test_integer_adds_run_without_python(tmp_path):
    """Position arithmetic (int64 add with a broadcast element) runs kwexport's kernel where
    the add shim can't take integers: the same values, no Python op; other integer adds
    (int32, two full shapes broadcast against each other) still run torch's."""
    from torch.profiler import profile

    def f(pos, n, small):
        a = torch.arange(6) + pos  # [6] + [1]
        b = pos + 1  # [1] + a wrapped number
        c = a.view(2, 3) + n.view(1, 1)  # [2, 3] + [1, 1]
        d = small + small  # int32: torch's op
        return a, b, c, d, torch.arange(3).view(3, 1) + torch.arange(4)  # [3, 1] + [4]: torch's op

    args = (torch.tensor([5]), torch.tensor(7), torch.tensor([1, 2], dtype=torch.int32))
    want = f(*args)
    for mode, prog in load_all(tmp_path, f, args).items():
        with profile() as p:
            got = prog(*args)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), mode
        if mode != "python":
            adds = [e.name for e in p.events()].count("aten::add")
            assert adds == 2, (mode, adds)  # the int32 add and the full broadcast
