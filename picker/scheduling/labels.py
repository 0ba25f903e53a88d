"""llm-d's label filters: `by-label`, `by-label-selector`, and its P/D role filters.

Endpoints carry their pod's labels (`Endpoint.labels`; statically configured endpoints have
none). llm-d marks a pod's part in prefill/decode disaggregation with the label `llm-d.ai/role`
(`prefill`, `decode` or `both`): `prefill-filter` keeps the `prefill` pods only, while
`decode-filter` keeps `decode` and `both` pods and also those without the label, so a fleet that
is not disaggregated (or has no labels at all) serves every request in its decode profile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters, PluginConfigError
from picker.framework.plugin import Filter
from picker.framework.request import InferenceRequest

ROLE_LABEL = "llm-d.ai/role"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_BOTH = "both"


class ByLabel(Filter):
    """`by-label` (llm-d): keep the endpoints whose label `label` has one of `validValues`, and,
    with `allowsNoLabel`, those without the label."""

    plugin_type = "by-label"

    def __init__(self, name: str, label: str, valid_values: frozenset[str], allows_no_label: bool) -> None:
        super().__init__(name)
        self.label = label
        self.valid_values = valid_values
        self.allows_no_label = allows_no_label

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> ByLabel:
        p = Parameters(parameters)
        label = p.string("label", "")
        valid_values = p.strings("validValues", ())
        allows_no_label = p.boolean("allowsNoLabel", False)
        effective = p.finish()
        if not label:
            raise PluginConfigError("label: must be specified")
        if not valid_values and not allows_no_label:
            raise PluginConfigError("validValues: must be non-empty unless allowsNoLabel is true")
        plugin = cls(name, label, frozenset(valid_values), allows_no_label)
        plugin.parameters = effective
        return plugin

    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        label, valid = self.label, self.valid_values
        kept = []
        for candidate in candidates:
            value = candidate.endpoint.labels.get(label)
            if self.allows_no_label if value is None else value in valid:
                kept.append(candidate)
        return kept


class PrefillFilter(ByLabel):
    """`prefill-filter` (llm-d): the pods labelled `llm-d.ai/role: prefill`; no parameters."""

    plugin_type = "prefill-filter"

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> ByLabel:
        Parameters(parameters).finish()
        return cls(name, ROLE_LABEL, frozenset({ROLE_PREFILL}), allows_no_label=False)


class DecodeFilter(ByLabel):
    """`decode-filter` (llm-d): the pods labelled `llm-d.ai/role` `decode` or `both`, and those
    without the label; no parameters."""

    plugin_type = "decode-filter"

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> ByLabel:
        Parameters(parameters).finish()
        return cls(name, ROLE_LABEL, frozenset({ROLE_DECODE, ROLE_BOTH}), allows_no_label=True)


_SET_OPERATORS = ("In", "NotIn")
_EXISTENCE_OPERATORS = ("Exists", "DoesNotExist")


@dataclass(frozen=True, slots=True)
class Requirement:
    """One of a Kubernetes label selector's `matchExpressions` (or a `matchLabels` pair as `In`)."""

    key: str
    operator: str
    values: frozenset[str]

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.operator == "In":
            return value is not None and value in self.values
        if self.operator == "NotIn":
            return value is None or value not in self.values
        if self.operator == "Exists":
            return value is not None
        return value is None


def _requirement(place: str, raw: Mapping[str, Any]) -> Requirement:
    p = Parameters(raw)
    try:
        key = p.string("key", "")
        operator = p.string("operator", "", choices=_SET_OPERATORS + _EXISTENCE_OPERATORS)
        values = p.strings("values", ())
        p.finish()
    except PluginConfigError as error:
        raise PluginConfigError(f"{place}.{error}") from None
    if not key:
        raise PluginConfigError(f"{place}.key: must be specified")
    if operator in _SET_OPERATORS and not values:
        raise PluginConfigError(f"{place}.values: must be non-empty for operator {operator}")
    if operator in _EXISTENCE_OPERATORS and values:
        raise PluginConfigError(f"{place}.values: must be empty for operator {operator}")
    return Requirement(key, operator, frozenset(values))


class ByLabelSelector(Filter):
    """`by-label-selector` (llm-d): keep the endpoints a Kubernetes label selector matches; its
    parameters are the selector (`matchLabels`, `matchExpressions` with operators In, NotIn,
    Exists, DoesNotExist). An empty selector keeps every endpoint, as in Kubernetes."""

    plugin_type = "by-label-selector"

    def __init__(self, name: str, requirements: Sequence[Requirement]) -> None:
        super().__init__(name)
        self.requirements = tuple(requirements)

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> ByLabelSelector:
        p = Parameters(parameters)
        match_labels = p.mapping("matchLabels")
        expressions = p.mappings("matchExpressions")
        requirements = []
        for key, value in match_labels.items():
            if not isinstance(value, str):
                raise PluginConfigError(f"matchLabels.{key}: must be a string, got {value!r}")
            requirements.append(Requirement(str(key), "In", frozenset({value})))
        requirements.extend(_requirement(f"matchExpressions[{i}]", raw) for i, raw in enumerate(expressions))
        plugin = cls(name, requirements)
        plugin.parameters = p.finish()
        return plugin

    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        return [c for c in candidates if all(r.matches(c.endpoint.labels) for r in self.requirements)]
