"""Optimization levels: `exact` is eager's bits; `fast` changes kernels and layouts within the
tolerance docs/optimize.md states (convolution weights held channels-last)."""

import pickle

import pytest
import torch
from conftest import assert_same
from torch import nn

import kwexport

torchvision = pytest.importorskip("torchvision")


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_fast_conv_nets_stay_within_tolerance(name, tmp_path):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(model, (x,)), path)
    exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    assert (exact.optimize, fast.optimize) == ("exact", "fast")
    with torch.no_grad():
        want = model(x)
    assert_same(exact(x), want, bitwise=True)
    got = fast(x)
    assert rel_err(got, want) < 1e-4
    assert not torch.equal(got, want)  # other kernels ran: the level is not a no-op


class ConvView(nn.Module):
    """A `view` of a convolution's output: impossible on a channels-last tensor."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        h = self.conv(x).relu()
        return self.fc(h.view(h.shape[0], -1))


def test_fast_runs_views_of_channels_last_tensors(tmp_path):
    torch.manual_seed(0)
    m, x = ConvView().eval(), torch.randn(2, 3, 6, 6)
    path = tmp_path / "cv.kwx"
    kwexport.save(kwexport.export(m, (x,)), path)
    with torch.no_grad():
        want = m(x)
        cl = m.to(memory_format=torch.channels_last)
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            cl(x)  # what running the graph as exported on channels-last weights would do
    fast = kwexport.load(path, optimize="fast")
    assert rel_err(fast(x), want) < 1e-4
    assert "aten::view.default" not in {o["op"] for o in fast.profile(x)}


def test_the_level_is_checked_and_travels_with_pickles(tmp_path):
    path = tmp_path / "m.kwx"
    kwexport.save(kwexport.export(nn.Linear(2, 2), (torch.randn(1, 2),)), path)
    with pytest.raises(ValueError, match=r"^optimize must be 'exact' or 'fast', not 'fastest'$"):
        kwexport.load(path, optimize="fastest")
    assert pickle.loads(pickle.dumps(kwexport.load(path, optimize="fast"))).optimize == "fast"
    assert pickle.loads(pickle.dumps(kwexport.load(path))).optimize == "exact"
