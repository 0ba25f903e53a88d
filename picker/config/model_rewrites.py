"""InferenceModelRewrite rules (`inference.networking.x-k8s.io/v1alpha2`): the merged value the
request path reads (`ModelRewrites`), built from the resources that name this picker's pool.

Precedence is the reference EPP's (v1.5.0 `datastore/modelrewritestore.go`): a rule matching the
request's model exactly wins over a generic rule (one with no `matches`); among several, the
oldest resource (by creation timestamp) wins; within one resource, the first rule in list
order. The reference breaks a tie between resources created in the same second by the order it
happened to reconcile them; here the resource name decides, so every replica agrees.

The reference draws a weighted target at random per request; here the draw is a hash of the
request id, so a retry (Envoy keeps `x-request-id`) lands on the same target, and across many
requests the split follows the weights the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import xxhash

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RewriteTarget:
    """One weighted destination: the model name forwarded, and its share of the rule's traffic
    (weight / sum of the rule's weights; 0 when unset)."""

    model: str
    weight: int = 0


@dataclass(frozen=True, slots=True)
class RewriteRule:
    """One rule of one InferenceModelRewrite: its targets (empty: the rule matches but leaves the
    model as it is) and the resource it came from (the decision metric's `model_rewrite_name`)."""

    resource: str
    targets: tuple[RewriteTarget, ...]
    total_weight: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_weight", sum(t.weight for t in self.targets))

    def choose(self, request_id: str) -> str | None:
        """The target for `request_id`: weighted, or uniform when no target has a weight (as
        the reference does); None when the rule has no targets."""
        if not self.targets:
            return None
        draw = xxhash.xxh3_64_intdigest(request_id.encode())
        if self.total_weight == 0:
            return self.targets[draw % len(self.targets)].model
        point = draw % self.total_weight
        for target in self.targets:
            if point < target.weight:
                return target.model
            point -= target.weight
        raise AssertionError("unreachable: point < total_weight")


@dataclass(frozen=True, slots=True)
class ModelRewrites:
    """The rules in force, merged: the winning rule per exact model name, and the winning generic
    rule. A change is a new value, swapped in whole (`RuntimeHolder.set_model_rewrites`)."""

    exact: Mapping[str, RewriteRule] = field(default_factory=lambda: MappingProxyType({}))
    generic: RewriteRule | None = None

    @classmethod
    def of(cls, resources: Iterable[Mapping[str, Any]]) -> ModelRewrites:
        """The merged rules of `resources` (InferenceModelRewrite objects as decoded JSON, all of
        this pool); a malformed rule is logged and skipped, the rest of its resource kept."""
        ordered = sorted(resources, key=_age_key)
        exact: dict[str, RewriteRule] = {}
        generic: RewriteRule | None = None
        for resource in ordered:
            name = str((resource.get("metadata") or {}).get("name", ""))
            rules = (resource.get("spec") or {}).get("rules") or ()
            for index, raw in enumerate(rules if isinstance(rules, list) else ()):
                try:
                    models, rule = _rule(raw, name)
                except ValueError as error:
                    log.warning("InferenceModelRewrite %s: rules[%d] ignored: %s", name, index, error)
                    continue
                if not models and generic is None:
                    generic = rule
                for model in models:
                    exact.setdefault(model, rule)
        return cls(MappingProxyType(exact), generic)

    def __bool__(self) -> bool:
        return bool(self.exact) or self.generic is not None

    def rule_for(self, model: str) -> RewriteRule | None:
        """The rule that applies to requests for `model`, if any."""
        return self.exact.get(model) or self.generic


def _age_key(resource: Mapping[str, Any]) -> tuple[str, str]:
    # RFC 3339 timestamps in UTC ("2026-12-03T15:21:07Z") sort as text in time order.
    metadata = resource.get("metadata") or {}
    return str(metadata.get("creationTimestamp") or ""), str(metadata.get("name") or "")


def _rule(raw: Any, resource: str) -> tuple[tuple[str, ...], RewriteRule]:
    """(the exact model names the rule matches, the rule); no names: a generic rule."""
    if not isinstance(raw, Mapping):
        raise ValueError("not an object")
    models: list[str] = []
    for match in raw.get("matches") or ():
        model = match.get("model") if isinstance(match, Mapping) else None
        if not isinstance(model, Mapping) or not isinstance(model.get("value"), str) or not model["value"]:
            raise ValueError("a match needs model.value")
        if model.get("type", "Exact") != "Exact":
            raise ValueError(f"match type {model.get('type')!r} is not supported (only Exact)")
        models.append(model["value"])
    targets: list[RewriteTarget] = []
    for target in raw.get("targets") or ():
        name = target.get("modelRewrite") if isinstance(target, Mapping) else None
        weight = target.get("weight", 0) if isinstance(target, Mapping) else None
        if not isinstance(name, str) or not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
            raise ValueError("a target needs modelRewrite and a non-negative integer weight")
        targets.append(RewriteTarget(name, weight))
    return tuple(dict.fromkeys(models)), RewriteRule(resource, tuple(targets))
