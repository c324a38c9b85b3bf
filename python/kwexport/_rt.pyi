"""Type stubs for ``kwexport._rt``, kwexport's Rust runtime (``rust/runtime``)."""

import inspect
import os
from collections.abc import Mapping
from typing import Any, final

import torch

__all__ = [
    "KwexportError",
    "ArtifactError",
    "VersionError",
    "SignatureError",
    "InputError",
    "FORMAT_VERSION",
    "OLDEST_FORMAT_VERSION",
    "RELEASED_FORMAT_VERSIONS",
    "MAGIC",
    "ALIGN",
    "DTYPES",
    "PY_OPERATORS",
    "SYM_FUNCTIONS",
    "LAYOUTS",
    "MEMORY_FORMATS",
    "HIGHER_ORDER_OPS",
    "SHIM_SYMBOLS",
    "POST_OPS",
    "FALLBACK_CALLS_AFTER_ERROR",
    "stable_abi_available",
    "kernel_info",
    "Program",
    "Method",
    "TokenStream",
    "load",
    "describe",
    "check_extra_name",
    "check_method_name",
    "optimize_header",
    "container_head",
    "_bind",
    "_load_verified",
    "_load_method",
]

FORMAT_VERSION: tuple[int, int]
OLDEST_FORMAT_VERSION: tuple[int, int]
RELEASED_FORMAT_VERSIONS: list[tuple[int, int]]

# The format's tables (rust/core/src/tables.rs).
MAGIC: bytes
ALIGN: int
DTYPES: list[tuple[str, int]]
PY_OPERATORS: list[str]
SYM_FUNCTIONS: list[str]
LAYOUTS: list[str]
MEMORY_FORMATS: list[str]
HIGHER_ORDER_OPS: list[str]
SHIM_SYMBOLS: list[str]
# The activations fused ops apply, as (oneDNN's attr, aten op) (rust/core/src/passes/post_ops.rs).
POST_OPS: list[tuple[str, str]]
FALLBACK_CALLS_AFTER_ERROR: int

class KwexportError(Exception):
    """Base class of every error kwexport raises."""

class ArtifactError(KwexportError, ValueError):
    """A file that is malformed, corrupt, unsafe or unsupported."""

class VersionError(ArtifactError):
    """A file whose format version this runtime cannot read."""

class SignatureError(KwexportError, TypeError):
    """A call that cannot bind to the saved signature."""

class InputError(KwexportError, ValueError):
    """Inputs that bind but don't match what was exported."""

@final
class Program:
    """A loaded kwexport file, called like the original function: its methods over one set of
    weights and one state. ``prog(...)`` calls its only method, or ``forward``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def profile(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]: ...
    def __getitem__(self, key: str, /) -> Method: ...
    # Methods as attributes (`prog.decode`): the runtime's attribute lookup falls back to them.
    def __getattr__(self, name: str) -> Method: ...
    def __contains__(self, key: str, /) -> bool: ...
    @property
    def methods(self) -> Mapping[str, Method]: ...
    def generate(
        self,
        input_ids: torch.Tensor | list[int],
        max_new_tokens: int = 20,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 50,
        top_p: float = 1.0,
        eos_token_id: int | list[int] | None = None,
        seed: int | None = None,
        decoder_start_token_id: int = 0,
        streamer: Any = None,
    ) -> torch.Tensor: ...
    def stream(
        self,
        input_ids: torch.Tensor | list[int],
        max_new_tokens: int = 20,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 50,
        top_p: float = 1.0,
        eos_token_id: int | list[int] | None = None,
        seed: int | None = None,
        decoder_start_token_id: int = 0,
    ) -> TokenStream: ...
    def __copy__(self) -> Program: ...
    def reset(self) -> None: ...
    @property
    def state(self) -> Mapping[str, Any]: ...
    def __reduce__(self) -> tuple[Any, tuple[str, str, list[str], str]]: ...
    def _run_flat(self, leaves: list[Any]) -> list[Any]: ...
    def _flatten(self, *args: Any, **kwargs: Any) -> list[Any]: ...
    @property
    def __signature__(self) -> inspect.Signature: ...
    @property
    def __name__(self) -> str: ...
    @property
    def extra_files(self) -> dict[str, str | bytes]: ...
    @property
    def format_version(self) -> tuple[int, int]: ...
    @property
    def file_format_version(self) -> tuple[int, int]: ...
    @property
    def upgraders_applied(self) -> list[str]: ...
    @property
    def producer(self) -> dict[str, str]: ...
    @property
    def dispatch(self) -> dict[str, Any]: ...
    @property
    def load_notes(self) -> list[str]: ...
    @property
    def path(self) -> str: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def optimize(self) -> str: ...
    @property
    def precision(self) -> str: ...

@final
class TokenStream:
    """``Program.stream``'s iterator of new tokens."""

    def __iter__(self) -> TokenStream: ...
    def __next__(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...

@final
class Method:
    """One method of a loaded file, called like the original function or method."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def profile(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]: ...
    def __reduce__(self) -> tuple[Any, tuple[str, tuple[Any, ...]]]: ...
    def _run_flat(self, leaves: list[Any]) -> list[Any]: ...
    def _run_leaves(self, leaves: list[Any]) -> list[Any]: ...
    def _flatten(self, *args: Any, **kwargs: Any) -> list[Any]: ...
    @property
    def __signature__(self) -> inspect.Signature: ...
    @property
    def __name__(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def dispatch(self) -> dict[str, Any]: ...

def load(
    path: str | os.PathLike[str],
    *,
    allow_ops: list[str] = ...,
    dispatch: str = "auto",
    device: str | torch.device | None = None,
    mmap: bool = True,
    optimize: str = "exact",
    precision: str = "float32",
    cuda_graphs: tuple[int, int, bool] | None = None,
) -> Program: ...
def describe(path: str | os.PathLike[str]) -> dict[str, Any]: ...
def stable_abi_available() -> bool: ...
def kernel_info() -> dict[str, Any]: ...
def check_extra_name(name: str) -> None: ...
def check_method_name(name: str) -> None: ...
def optimize_header(header: str, level: str) -> tuple[str, list[str], list[dict[str, Any]]]: ...
def container_head(header: bytes) -> bytes: ...
def _bind(signature_json: str, n_args: int, keywords: list[str]) -> list[tuple[Any, ...]]: ...
def _load_verified(
    path: str | os.PathLike[str],
    digest: str,
    allow_ops: list[str],
    dispatch: str,
    device: str | torch.device | None = None,
    mmap: bool = True,
    optimize: str = "exact",
    precision: str = "float32",
    cuda_graphs: tuple[int, int, bool] | None = None,
) -> Program: ...
def _load_method(name: str, file: tuple[Any, ...]) -> Method: ...
