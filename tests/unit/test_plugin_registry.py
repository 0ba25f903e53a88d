"""The built-in registry: plugin types registered by name (imported when a config names them)
are their classes' types, and the start does not import them."""

from __future__ import annotations

import subprocess
import sys

from picker.framework.handle import Handle
from picker.framework.registry import DeferredFactory
from picker.plugins import REGISTRY

DEFERRED = {
    plugin_type: registration.factory
    for plugin_type, registration in REGISTRY.registrations.items()
    if isinstance(registration.factory, DeferredFactory)
}


def test_the_optional_concerns_are_registered_by_name() -> None:
    assert {"latency-scorer", "precise-prefix-cache-scorer", "pd-profile-handler"} <= DEFERRED.keys()


def test_a_type_registered_by_name_is_its_classs_type() -> None:
    for plugin_type, factory in DEFERRED.items():
        assert factory.plugin_class().plugin_type == plugin_type


def test_a_deferred_factory_builds_the_plugin() -> None:
    plugin = DEFERRED["pd-profile-handler"]("pd", {}, Handle())
    assert type(plugin).__name__ == "PdProfileHandler"


def test_the_registry_does_not_import_the_deferred_modules() -> None:
    modules = {factory.module for factory in DEFERRED.values()}
    check = f"import sys, picker.plugins; print(sorted(m for m in {sorted(modules)!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
