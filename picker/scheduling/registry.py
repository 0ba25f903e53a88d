"""The plugin registry: factories keyed by plugin type, as the config names them.

A package contributes plugins by registering them in its `plugins` module
(`picker/<package>/plugins.py`); `load_plugin_modules()` imports every such module once, so a
new plugin type becomes available to configs without editing a central list.

A factory is called as `factory(name, parameters, handle)`: `parameters` is the raw mapping
from the config (empty when omitted). It must validate them strictly (see `Parameters`) and
raise `PluginConfigError` with a message naming the bad parameter.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import picker
from picker.scheduling.framework import Handle, Plugin

PluginFactory = Callable[[str, Mapping[str, Any], Handle], Plugin]


class PluginConfigError(ValueError):
    """A plugin's parameters are invalid; the message names the parameter."""


@dataclass(frozen=True, slots=True)
class Registration:
    """One registered plugin type.

    `default_producer_for`: data keys this type is the default producer of; the config loader
    adds an instance (with default parameters) when a configured plugin consumes such a key
    and no configured plugin produces it.
    """

    plugin_type: str
    factory: PluginFactory
    default_producer_for: frozenset[str] = frozenset()


_REGISTRY: dict[str, Registration] = {}
_modules_loaded = False


def register(plugin_type: str, factory: PluginFactory, *, default_producer_for: frozenset[str] = frozenset()) -> None:
    """Register `factory` under `plugin_type`; registering a type twice is a programming error."""
    if plugin_type in _REGISTRY and _REGISTRY[plugin_type].factory is not factory:
        raise ValueError(f"plugin type {plugin_type!r} is already registered")
    _REGISTRY[plugin_type] = Registration(plugin_type, factory, frozenset(default_producer_for))


def load_plugin_modules() -> None:
    """Import `picker.scheduling.plugins` and every other `picker.<package>.plugins` module."""
    global _modules_loaded
    if _modules_loaded:
        return
    _modules_loaded = True
    importlib.import_module("picker.scheduling.plugins")
    for package in pkgutil.iter_modules(picker.__path__):
        if not package.ispkg or package.name == "scheduling":
            continue
        module = f"picker.{package.name}.plugins"
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


def lookup(plugin_type: str) -> Registration | None:
    """The registration of `plugin_type`, or None if it is unknown."""
    load_plugin_modules()
    return _REGISTRY.get(plugin_type)


def is_registered(plugin_type: str) -> bool:
    return lookup(plugin_type) is not None


def registered_types() -> list[str]:
    """Every registered plugin type, sorted."""
    load_plugin_modules()
    return sorted(_REGISTRY)


def default_producer(data_key: str) -> str | None:
    """The plugin type registered as the default producer of `data_key`, if any."""
    load_plugin_modules()
    for registration in _REGISTRY.values():
        if data_key in registration.default_producer_for:
            return registration.plugin_type
    return None
