"""kwexport: export a PyTorch function or module to one safe file, load it fast, and call
it exactly like the original.

    ex = kwexport.export(f, args, kwargs)
    kwexport.save(ex, "model.kwx")
    prog = kwexport.load("model.kwx")
    out = prog(*args, **kwargs)

Loading and calling live in the Rust extension (``kwexport._rt``); exporting and saving
(``kwexport._export``) import torch.export only when used.
"""

from kwexport._rt import (
    FORMAT_VERSION,
    OLDEST_FORMAT_VERSION,
    ArtifactError,
    InputError,
    KwexportError,
    Program,
    SignatureError,
    VersionError,
)
from kwexport._rt import load as _load

__version__ = "0.1.0"

__all__ = [
    "ArtifactError",
    "Exported",
    "FORMAT_VERSION",
    "InputError",
    "KwexportError",
    "OLDEST_FORMAT_VERSION",
    "Program",
    "SignatureError",
    "VersionError",
    "export",
    "load",
    "save",
]


def load(path, *, allow_ops=(), dispatch="auto") -> Program:
    """Load a kwexport file. Parses and validates everything before returning; never
    unpickles, evaluates or imports anything named in the file.

    Only ops of torch's built-in namespaces (aten, prims) load by default; ``allow_ops``
    admits custom ones, e.g. ``["mylib::*"]`` or ``["mylib::scale.default"]``, which must
    already be registered (kwexport never loads libraries for a file).

    ``dispatch="auto"`` runs each node through torch's stable C ABI where it covers the
    node and saves more than converting values around it costs (no Python; long stretches
    release the GIL), and through torch's Python op objects otherwise; ``"abi"`` uses the
    C ABI for every node it covers; ``"python"`` uses the Python op objects throughout.
    Results are identical; ``Program.dispatch`` counts the nodes on each path.
    """
    import os

    return _load(os.fspath(path), allow_ops=list(allow_ops), dispatch=dispatch)


def export(f, args, kwargs=None, *, dynamic_shapes=None):
    """Trace ``f`` (an ``nn.Module`` or a function) with torch.export, keeping its signature."""
    from kwexport._export import export as _export

    return _export(f, args, kwargs, dynamic_shapes=dynamic_shapes)


def save(ex, path, *, extra_files=None) -> None:
    """Write ``ex`` to ``path`` as one file, atomically."""
    from kwexport._export import save as _save

    _save(ex, path, extra_files=extra_files)


def __getattr__(name):
    if name == "Exported":
        from kwexport._export import Exported

        return Exported
    raise AttributeError(f"module 'kwexport' has no attribute {name!r}")
