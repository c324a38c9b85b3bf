"""Stateful programs: buffers the graph writes live in memory the Program owns, persist
across calls as with `ep.module()`, and can be read, reset and copied."""

import copy
import pickle

import pytest
import torch
from conftest import assert_same, in_threads
from torch import nn

import kwexport


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()


@pytest.fixture(params=["abi", "python"])
def stateful(tmp_path, request):
    m = bn_model()
    path = tmp_path / "bn.kwx"
    kwexport.save(kwexport.export(m, (torch.randn(8, 4),)), path)
    return m, path, kwexport.load(path, dispatch=request.param)


def test_batch_norm_in_training_mode_matches_eager(stateful):
    m, path, prog = stateful
    assert set(prog.state) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for step in range(4):
        x = torch.randn(8, 4) * (step + 1)
        assert_same(prog(x), m(x))
        for name, value in prog.state.items():
            assert_same(value, m.state_dict()[name])
    assert int(prog.state["1.num_batches_tracked"]) == 4
    # The file is never written: a new load starts from the saved statistics.
    assert int(kwexport.load(path).state["1.num_batches_tracked"]) == 0


def test_reset_copy_and_read_only_view(stateful):
    m, path, prog = stateful
    x = torch.randn(8, 4)
    prog(x)
    twin = copy.copy(prog)
    assert_same(twin.state["1.running_mean"], prog.state["1.running_mean"])
    twin(x)
    assert int(twin.state["1.num_batches_tracked"]) == 2 and int(prog.state["1.num_batches_tracked"]) == 1
    prog.reset()
    assert int(prog.state["1.num_batches_tracked"]) == 0
    assert torch.equal(prog.state["1.running_mean"], torch.zeros(4))
    assert int(twin.state["1.num_batches_tracked"]) == 2  # its own state
    with pytest.raises(TypeError):
        prog.state["1.running_mean"] = torch.ones(4)


def test_concurrent_calls_are_serialized(stateful):
    _, _, prog = stateful
    x = torch.randn(8, 4)

    def work():
        for _ in range(25):
            prog(x)

    in_threads(work, 4)
    assert int(prog.state["1.num_batches_tracked"]) == 100


def test_pickling_by_reference_starts_from_the_file(stateful):
    _, _, prog = stateful
    prog(torch.randn(8, 4))
    again = pickle.loads(pickle.dumps(prog))
    assert int(again.state["1.num_batches_tracked"]) == 0
    assert int(prog.state["1.num_batches_tracked"]) == 1


def test_stateless_programs_have_no_state(roundtrip):
    prog = roundtrip(nn.Linear(2, 2), (torch.randn(1, 2),))
    assert dict(prog.state) == {}
    prog.reset()  # nothing to do


def test_in_place_writes_to_inputs_reach_the_callers_tensors(roundtrip):
    def f(x, counter):
        counter.add_(1)
        x.view(-1).mul_(2)
        return x + counter

    prog = roundtrip(f, (torch.ones(2, 2), torch.zeros(1)))
    x, counter = torch.ones(2, 2), torch.zeros(1)
    out = prog(x, counter)
    x2, counter2 = torch.ones(2, 2), torch.zeros(1)
    assert_same(out, f(x2, counter2))
    assert_same(x, x2)
    assert_same(counter, counter2)
