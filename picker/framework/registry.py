"""Plugin registrations: factories keyed by plugin type, as a config names them.

The registry holds no list of its own: `picker.plugins` builds the one `Registry` of built-in
types from an explicit list, so every plugin type the picker knows can be found in one place.

A factory is called as `factory(name, parameters, handle)`: `parameters` is the raw mapping
from the config (empty when omitted). It must validate them strictly (see `Parameters`) and
raise `PluginConfigError` with a message naming the bad parameter.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from picker.framework.handle import Handle
from picker.framework.plugin import Plugin

PluginFactory = Callable[[str, Mapping[str, Any], Handle], Plugin]


@dataclass(frozen=True, slots=True)
class DeferredFactory:
    """The `create` of class `class_name` in `module`, imported at the first call: plugin types
    that few configs name keep their modules (and what those import) out of the start."""

    module: str
    class_name: str

    def plugin_class(self) -> Any:
        """The class, imported now."""
        return getattr(importlib.import_module(self.module), self.class_name)

    def __call__(self, name: str, parameters: Mapping[str, Any], handle: Handle) -> Plugin:
        factory: PluginFactory = self.plugin_class().create
        return factory(name, parameters, handle)


@dataclass(frozen=True, slots=True)
class Registration:
    """One registered plugin type.

    `default_producer_for`: data keys this type is the default producer of; the config loader
    adds an instance (with default parameters) when a configured plugin consumes such a key
    and no configured plugin produces it.
    `configures_default_producer`: this type's parameters are those of the default producer
    the loader adds for it, which gets them (the reference's `prefix-cache-scorer` passes its
    parameters to the `approx-prefix-cache-producer` it creates); its factory validates them
    as that producer's.
    """

    plugin_type: str
    factory: PluginFactory
    default_producer_for: frozenset[str] = frozenset()
    configures_default_producer: bool = False


class Registry:
    """Registrations by plugin type; registering a type twice is a programming error."""

    def __init__(self, registrations: Iterable[Registration]) -> None:
        self.registrations: dict[str, Registration] = {}
        for registration in registrations:
            if registration.plugin_type in self.registrations:
                raise ValueError(f"plugin type {registration.plugin_type!r} is registered twice")
            self.registrations[registration.plugin_type] = registration

    def lookup(self, plugin_type: str) -> Registration | None:
        """The registration of `plugin_type`, or None if it is unknown."""
        return self.registrations.get(plugin_type)

    def types(self) -> list[str]:
        """Every registered plugin type, sorted."""
        return sorted(self.registrations)

    def default_producer(self, data_key: str) -> str | None:
        """The plugin type registered as the default producer of `data_key`, if any."""
        for registration in self.registrations.values():
            if data_key in registration.default_producer_for:
                return registration.plugin_type
        return None
