"""Programs made elsewhere: kwexport.save takes a torch.export.ExportedProgram, and
`kwexport convert` turns a .pt2 into a .kwx in one command."""

import inspect
import subprocess
import sys

import pytest
import torch
from conftest import assert_same

import kwexport


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, y=None, *, scale=2.0, cfg=None):
        return {"out": self.lin(x) * scale + cfg["shift"], "y": y}


def example():
    torch.manual_seed(0)
    return M().eval(), (torch.randn(2, 4),), {"cfg": {"shift": torch.randn(3)}}


@pytest.mark.parametrize("dispatch", ["abi", "python"])
def test_save_takes_an_exported_program(tmp_path, dispatch):
    m, args, kwargs = example()
    ep = torch.export.export(m, args, kwargs)
    kwexport.save(ep, tmp_path / "m.kwx")
    prog = kwexport.load(tmp_path / "m.kwx", dispatch=dispatch)
    # The signature the ExportedProgram allows: x by position or name, cfg by keyword.
    assert str(inspect.signature(prog)) == "(x, *, cfg)"
    assert_same(prog(*args, **kwargs), m(*args, **kwargs))
    assert_same(prog(cfg=kwargs["cfg"], x=args[0]), m(*args, **kwargs))
    with pytest.raises(kwexport.SignatureError, match=r"^forward\(\) missing 1 required keyword-only argument: 'cfg'$"):
        prog(*args)


def test_convert_a_pt2_from_the_command_line(tmp_path):
    m, args, kwargs = example()
    pt2, kwx = tmp_path / "m.pt2", tmp_path / "m.kwx"
    torch.export.save(torch.export.export(m, args, kwargs), pt2)
    out = subprocess.run(
        [sys.executable, "-m", "kwexport", "convert", str(pt2), str(kwx)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{kwx}: forward(x, *, cfg), 3 nodes, 2 weights"
    assert_same(kwexport.load(kwx)(*args, **kwargs), m(*args, **kwargs))
    again = subprocess.run(
        [sys.executable, "-m", "kwexport", "convert", str(pt2), str(kwx)], capture_output=True, text=True
    )
    assert again.returncode == 1 and "exists; pass --force" in again.stderr


def test_transformers_model_exported_by_torch(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64)
    model = transformers.DistilBertForSequenceClassification(cfg).eval()
    ids, mask = torch.randint(0, 100, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    kwexport.save(torch.export.export(model, (), {"input_ids": ids, "attention_mask": mask}), tmp_path / "d.kwx")
    out = kwexport.load(tmp_path / "d.kwx")(attention_mask=mask, input_ids=ids)
    assert type(out).__name__ == "SequenceClassifierOutput"
    torch.testing.assert_close(out.logits, model(input_ids=ids, attention_mask=mask).logits, atol=1e-4, rtol=1e-4)
