"""The stand-in kwexport returns for a registered container class (a transformers
``ModelOutput``, a dataclass, a ``register_pytree_node`` class) that the loading process
has not imported: loading never imports what a file names.

It behaves like the ``ModelOutput`` it stands for, which is how these objects are used:
``out.logits``, ``out["logits"]``, ``out[0]`` and ``out[1:]`` (by position among the set
fields), ``keys()``, ``values()``, ``items()``, ``get()``, ``to_tuple()``, ``len()``,
iteration over the keys in order, ``in``, and ``==`` with another stand-in or any mapping
with the same items. It is read-only and its ``repr`` names the original class.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


class StandIn(Mapping[Any, Any]):
    """A read-only record of a container's fields, in order, standing for ``class_name``."""

    __slots__ = ("_class_name", "_keys", "_values")

    def __init__(self, class_name: str, keys: tuple[Any, ...], values: tuple[Any, ...]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        object.__setattr__(self, "_class_name", class_name)
        object.__setattr__(self, "_keys", tuple(keys))
        object.__setattr__(self, "_values", tuple(values))

    @property
    def class_name(self) -> str:
        """The qualified name of the class this stands for, e.g.
        ``transformers.modeling_outputs.SequenceClassifierOutput``."""
        return self._class_name

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the fields.
        try:
            return self._values[self._keys.index(name)]
        except ValueError:
            raise AttributeError(f"{self._short_name()} stand-in has no field {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self._short_name()} stand-in is read-only")

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            try:
                return self._values[self._keys.index(key)]
            except ValueError:
                raise KeyError(key) from None
        if isinstance(key, (int, slice)):
            return self._values[key]
        raise TypeError(f"{self._short_name()} stand-in indices must be str, int or slice, not {type(key).__name__}")

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StandIn):
            return self._class_name == other._class_name and self._keys == other._keys and self._values == other._values
        if isinstance(other, Mapping):
            return list(self.keys()) == list(other.keys()) and all(self[k] == other[k] for k in self._keys)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, like the dict it mimics

    def to_tuple(self) -> tuple[Any, ...]:
        """The field values in order, as ``ModelOutput.to_tuple()`` gives them."""
        return self._values

    def _short_name(self) -> str:
        return self._class_name.rsplit(".", 1)[-1]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" if isinstance(k, str) else repr(v) for k, v in zip(self._keys, self._values))
        return f"<kwexport stand-in for {self._class_name}>({fields})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (StandIn, (self._class_name, self._keys, self._values))
