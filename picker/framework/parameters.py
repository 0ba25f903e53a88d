"""Strict reading of a plugin's raw `parameters` mapping.

Each accessor validates one parameter and records it as known; `finish()` then rejects any
parameter the plugin did not read, so a misspelt key is an error rather than silently ignored.
Messages name the parameter (`queueDepthThreshold: must be > 0, got 0`); the config loader
prefixes them with the plugin's place in the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from picker.framework.durations import format_duration, parse_duration

T = TypeVar("T")


class PluginConfigError(ValueError):
    """A plugin's parameters are invalid; the message names the parameter."""


class Parameters:
    """A typed, strict view of one plugin's parameters."""

    def __init__(self, raw: Mapping[str, Any] | None) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise PluginConfigError(f"parameters: must be a mapping, got {type(raw).__name__}")
        self._raw = raw
        self._read: set[str] = set()
        self._effective: dict[str, Any] = {}

    def _get(self, key: str) -> Any:
        self._read.add(key)
        return self._raw.get(key)

    def _keep(self, key: str, value: T, shown: Any = None) -> T:
        """Record `value` (or its display form `shown`) as the effective parameter and return it."""
        self._effective[key] = value if shown is None else shown
        return value

    def number(
        self,
        key: str,
        default: float,
        *,
        above: float | None = None,
        at_least: float | None = None,
        at_most: float | None = None,
    ) -> float:
        """A number; `above` is an exclusive lower bound, `at_least`/`at_most` inclusive."""
        value = self._get(key)
        if value is None:
            return self._keep(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PluginConfigError(f"{key}: must be a number, got {value!r}")
        if above is not None and not value > above:
            raise PluginConfigError(f"{key}: must be > {above:g}, got {value!r}")
        if at_least is not None and value < at_least:
            raise PluginConfigError(f"{key}: must be >= {at_least:g}, got {value!r}")
        if at_most is not None and value > at_most:
            raise PluginConfigError(f"{key}: must be <= {at_most:g}, got {value!r}")
        return self._keep(key, float(value))

    def integer(self, key: str, default: int, *, at_least: int | None = None) -> int:
        """An integer (a float with no fraction is accepted, as JSON does)."""
        value = self._get(key)
        if value is None:
            return self._keep(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PluginConfigError(f"{key}: must be an integer, got {value!r}")
        if at_least is not None and value < at_least:
            raise PluginConfigError(f"{key}: must be >= {at_least}, got {value!r}")
        return self._keep(key, value)

    def optional_integer(self, key: str, default: int | None, *, at_least: int | None = None) -> int | None:
        """An integer, or None when set to null (`default` when absent)."""
        if self._get(key) is None and (key in self._raw or default is None):
            return self._keep(key, None)
        return self.integer(key, default if default is not None else 0, at_least=at_least)

    def deprecated(self, key: str) -> Any:
        """The raw value of a parameter still accepted but no longer used (not shown as effective)."""
        return self._get(key)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return self._keep(key, default)
        if not isinstance(value, bool):
            raise PluginConfigError(f"{key}: must be true or false, got {value!r}")
        return self._keep(key, value)

    def string(self, key: str, default: str, *, choices: tuple[str, ...] | None = None) -> str:
        value = self._get(key)
        if value is None:
            return self._keep(key, default)
        if not isinstance(value, str):
            raise PluginConfigError(f"{key}: must be a string, got {value!r}")
        if choices is not None and value not in choices:
            raise PluginConfigError(f"{key}: must be one of {', '.join(choices)}, got {value!r}")
        return self._keep(key, value)

    def strings(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        """A list of non-empty strings."""
        value = self._get(key)
        if value is None:
            return self._keep(key, default, list(default))
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise PluginConfigError(f"{key}: must be a list of non-empty strings, got {value!r}")
        return self._keep(key, tuple(value), list(value))

    def duration(self, key: str, default: float) -> float:
        """A Go-style duration string ("200ms") or a number of seconds, as seconds (>= 0)."""
        value = self._get(key)
        if value is None:
            return self._keep(key, default, format_duration(default))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        elif isinstance(value, str):
            try:
                seconds = parse_duration(value)
            except ValueError as error:
                raise PluginConfigError(f"{key}: {error}") from None
        else:
            raise PluginConfigError(f'{key}: must be a duration such as "200ms", got {value!r}')
        if seconds < 0:
            raise PluginConfigError(f"{key}: must not be negative, got {value!r}")
        return self._keep(key, seconds, value)

    def mapping(self, key: str) -> Mapping[str, Any]:
        """A nested mapping (empty when absent); its contents are the caller's to check."""
        value = self._get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise PluginConfigError(f"{key}: must be a mapping, got {value!r}")
        return self._keep(key, value)

    def mappings(self, key: str) -> tuple[Mapping[str, Any], ...]:
        """A list of mappings (empty when absent); their contents are the caller's to check."""
        value = self._get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            raise PluginConfigError(f"{key}: must be a list of mappings, got {value!r}")
        return self._keep(key, tuple(value), value)

    def finish(self) -> dict[str, Any]:
        """Reject every parameter no accessor asked for; return the effective parameters
        (every one read, defaults included) for `Plugin.parameters`."""
        unknown = [key for key in self._raw if key not in self._read]
        if unknown:
            raise PluginConfigError(f"{unknown[0]}: unknown parameter")
        return dict(self._effective)
