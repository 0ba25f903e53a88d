"""Per-request data shared by the plugins of one request: `CycleState` and its typed keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StateKey(Generic[T]):
    """A typed CycleState key: the data key producers declare (`name`) and its value's type."""

    name: str
    type: type[T]

    def __str__(self) -> str:
        return self.name


_EXPLAIN = StateKey("Explain", dict)


class CycleState:
    """Per-request values keyed by `StateKey`, created by the director for one request and
    handed to every hook of that request: producers write, scorers and later hooks read."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[str, object] = {}

    def read(self, key: StateKey[T]) -> T | None:
        """The value under `key`, or None when absent (or not of the key's type)."""
        value = self._values.get(key.name)
        return value if isinstance(value, key.type) else None

    def __getitem__(self, key: StateKey[T]) -> T:
        value = self.read(key)
        if value is None:
            raise KeyError(key.name)
        return value

    def __setitem__(self, key: StateKey[T], value: T) -> None:
        if not isinstance(value, key.type):  # a wrong value would read as absent: fail at the write
            raise TypeError(f"{key.name} holds {key.type.__name__}, not {type(value).__name__}")
        self._values[key.name] = value

    def __contains__(self, key: StateKey[Any]) -> bool:
        return self.read(key) is not None

    def explain(self) -> dict[str, Any]:
        """What plugins want `/debug/decisions` to show about this decision, by topic (JSON-ready
        values or named tuples, converted only when the log is read). Created on first use."""
        explain = self.read(_EXPLAIN)
        if explain is None:
            explain = self._values[_EXPLAIN.name] = {}
        return explain

    def explained(self) -> dict[str, Any] | None:
        """The explain map if any plugin wrote to it."""
        return self.read(_EXPLAIN)
