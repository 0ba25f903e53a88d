"""InferenceObjective priorities: the value the request path reads (`Objectives`), and without
Kubernetes, a file of objectives for `--objectives-file`.

The file holds InferenceObjective resources (as `kubectl apply` would take them, one or more
YAML documents or a List) or a plain mapping `{name: priority}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import yaml

from picker.config.schema import ConfigError
from picker.framework.request import InferenceRequest

_KIND = "InferenceObjective"


@dataclass(frozen=True, slots=True)
class Objectives:
    """The InferenceObjective priorities in force, `{name: priority}` (None: unset); a change is
    a new value, swapped in whole (`RuntimeHolder.set_objectives`)."""

    priorities: Mapping[str, int | None] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, priorities: Mapping[str, int | None]) -> Objectives:
        """Objectives holding a read-only copy of `priorities`."""
        return cls(MappingProxyType(dict(priorities)))

    def priority(self, request: InferenceRequest) -> int:
        """The request's InferenceObjective priority; no objective, unknown or unset → 0."""
        if request.objective is None:
            return 0
        return self.priorities.get(request.objective) or 0


def _from_resource(item: Any, where: str) -> tuple[str, int | None]:
    if not isinstance(item, dict) or item.get("kind") != _KIND:
        raise ConfigError([f"{where}: expected kind {_KIND}"])
    name = (item.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError([f"{where}.metadata.name: required"])
    priority = (item.get("spec") or {}).get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise ConfigError([f"{where}.spec.priority: expected an integer"])
    return name, priority


def parse_objectives(text: str) -> dict[str, int | None]:
    """`{objective name: priority}` from the file's text; raises ConfigError naming the bad entry."""
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise ConfigError([f"objectives: invalid YAML: {e}"]) from None
    objectives: dict[str, int | None] = {}
    for i, doc in enumerate(documents):
        if isinstance(doc, dict) and "kind" not in doc:
            for name, priority in doc.items():
                if not isinstance(name, str) or (
                    priority is not None and (not isinstance(priority, int) or isinstance(priority, bool))
                ):
                    raise ConfigError([f"objectives[{i}].{name}: expected name: integer priority"])
                objectives[name] = priority
            continue
        items = doc.get("items", []) if isinstance(doc, dict) and doc.get("kind") == "List" else [doc]
        for j, item in enumerate(items):
            name, priority = _from_resource(item, f"objectives[{i}]" + (f".items[{j}]" if len(items) > 1 else ""))
            objectives[name] = priority
    return objectives
