"""The public API, type-checked: CI runs `mypy --strict` on this file.

python examples/typed_usage.py
"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path

import torch

import kwexport


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor, *, factor: float = 2.0) -> dict[str, torch.Tensor]:
        return {"y": x * factor}


def main() -> None:
    x = torch.randn(3)
    ex: kwexport.Exported = kwexport.export(Scale(), (x,), {"factor": 2.0})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scale.kwx"
        kwexport.save(ex, path, extra_files={"notes.txt": "v1"})
        prog: kwexport.Program = kwexport.load(path, dispatch="auto")
        out = prog(x=x)
        assert torch.equal(out["y"], x * 2.0)
        sig: inspect.Signature = inspect.signature(prog)
        notes: dict[str, str | bytes] = prog.extra_files
        version: tuple[int, int] = prog.format_version
        print(f"{prog.__name__}{sig} format {version}, notes {notes['notes.txt']!r}")
        try:
            prog(x, factor=3.0)
        except kwexport.InputError as e:
            print(f"refused: {e}")


if __name__ == "__main__":
    main()
