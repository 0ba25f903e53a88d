"""LoRA adapter → base model, from the ConfigMaps the reference BBR reads.

A ConfigMap labelled `inference.networking.k8s.io/bbr-managed: "true"` holds `baseModel` (one
name) and `adapters` (a YAML list of adapter names); a large mapping may span several ConfigMaps
of one base model. The store is rebuilt whole from the watched ConfigMaps at each change, in
namespace/name order, so the same objects always give the same mapping.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

log = logging.getLogger(__name__)

BBR_MANAGED_LABEL = "inference.networking.k8s.io/bbr-managed"
BASE_MODEL_KEY = "baseModel"
ADAPTERS_KEY = "adapters"


class AdapterConfigMapError(ValueError):
    """A ConfigMap without a usable `baseModel` or `adapters`."""


def parse_config_map(data: Mapping[str, str]) -> tuple[str, frozenset[str]]:
    """A ConfigMap's data as (base model, adapters), names trimmed, empty entries skipped."""
    base_model = str(data.get(BASE_MODEL_KEY) or "").strip()
    if not base_model:
        raise AdapterConfigMapError("missing or empty baseModel")
    raw = data.get(ADAPTERS_KEY) or ""
    if not raw.strip():
        return base_model, frozenset()
    try:
        names = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise AdapterConfigMapError(f"adapters is not YAML: {error}") from None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise AdapterConfigMapError("adapters must be a YAML list of names")
    return base_model, frozenset(name.strip() for name in names if name.strip())


@dataclass(slots=True)
class AdaptersStore:
    """The current mapping; `base_model` is read on the request path (two dict lookups)."""

    _base_of_adapter: dict[str, str] = field(default_factory=dict)
    _base_models: frozenset[str] = frozenset()

    def base_model(self, model: str) -> str:
        """The base model of `model` (an adapter's, or `model` itself when it is a base model);
        empty when it is neither."""
        name = model.strip()
        base = self._base_of_adapter.get(name)
        if base is not None:
            return base
        return name if name in self._base_models else ""

    def replace(self, config_maps: Iterable[Mapping[str, Any]]) -> None:
        """Rebuild from the labelled ConfigMaps (objects as the API serves them)."""
        base_of_adapter: dict[str, str] = {}
        base_models: set[str] = set()
        ordered = sorted(config_maps, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        for config_map in ordered:
            metadata = config_map["metadata"]
            if (metadata.get("labels") or {}).get(BBR_MANAGED_LABEL) != "true" or metadata.get("deletionTimestamp"):
                continue
            try:
                base_model, adapters = parse_config_map(config_map.get("data") or {})
            except AdapterConfigMapError as error:
                log.error("ConfigMap %s/%s ignored: %s", metadata.get("namespace"), metadata["name"], error)
                continue
            base_models.add(base_model)
            base_of_adapter.update(dict.fromkeys(adapters, base_model))
        self._base_of_adapter, self._base_models = base_of_adapter, frozenset(base_models)
