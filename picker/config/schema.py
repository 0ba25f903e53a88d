"""The EndpointPickerConfig document as typed values, decoded strictly.

Field names follow the reference (`apix/config/v1alpha1`). Decoding rejects unknown fields
and wrong types with messages naming the place (`schedulingProfiles[0].plugins[1].weight:
must be a number`); all problems found are reported together in one `ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from picker.config.quantity import parse_quantity
from picker.framework.durations import parse_duration

API_VERSIONS = ("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1")
KIND = "EndpointPickerConfig"
FEATURE_GATES = ("dataLayer", "enableLegacyMetrics", "flowControl")


class ConfigError(ValueError):
    """An invalid config; `errors` lists every problem, each naming its place."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


@dataclass(frozen=True, slots=True)
class PluginSpec:
    name: str
    type: str
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProfilePluginRef:
    plugin_ref: str
    weight: float | None = None  # scorers only; None means the default weight 1


@dataclass(frozen=True, slots=True)
class SchedulingProfileSpec:
    name: str
    plugins: tuple[ProfilePluginRef, ...] = ()


@dataclass(frozen=True, slots=True)
class PluginRef:
    plugin_ref: str


@dataclass(frozen=True, slots=True)
class DataSourceSpec:
    plugin_ref: str
    extractors: tuple[PluginRef, ...] = ()


@dataclass(frozen=True, slots=True)
class DataLayerSpec:
    sources: tuple[DataSourceSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class PriorityBandSpec:
    priority: int | None = None
    max_bytes: int | None = None
    max_requests: int | None = None
    fairness_policy_ref: str | None = None
    ordering_policy_ref: str | None = None


@dataclass(frozen=True, slots=True)
class FlowControlSpec:
    """The `flowControl` section as written (quantities already numbers); in force only with the
    `flowControl` feature gate (`picker.flowcontrol.settings` resolves its defaults)."""

    max_bytes: int | None = None
    max_requests: int | None = None
    default_request_ttl: str | None = None
    max_affinity_wait: str | None = None  # the picker's own (see FlowControlSettings)
    default_priority_band: PriorityBandSpec | None = None
    priority_bands: tuple[PriorityBandSpec, ...] = ()
    usage_limit_policy_plugin_ref: str | None = None


@dataclass(frozen=True, slots=True)
class EndpointPickerConfig:
    api_version: str = API_VERSIONS[0]
    kind: str = KIND
    feature_gates: tuple[str, ...] = ()
    plugins: tuple[PluginSpec, ...] = ()
    scheduling_profiles: tuple[SchedulingProfileSpec, ...] = ()
    saturation_detector: PluginRef | None = None
    parser: PluginRef | None = None
    data_layer: DataLayerSpec | None = None
    flow_control: FlowControlSpec | None = None


class _Decoder:
    """Walks the raw document, collecting errors instead of stopping at the first."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}" if path else message)

    def mapping(self, value: Any, path: str, known: tuple[str, ...]) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.fail(path, f"must be a mapping, got {_kind(value)}")
            return {}
        for key in value:
            if key not in known:
                hint = _RENAMED.get(str(key))
                self.fail(_join(path, str(key)), f"unknown field (did you mean {hint}?)" if hint else "unknown field")
        return value

    def sequence(self, value: Any, path: str) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.fail(path, f"must be a list, got {_kind(value)}")
            return []
        return value

    def string(self, value: Any, path: str, *, required: bool = False) -> str | None:
        if value is None:
            if required:
                self.fail(path, "is required")
            return None
        if not isinstance(value, str):
            self.fail(path, f"must be a string, got {_kind(value)}")
            return None
        text: str = value
        if required and not text:
            self.fail(path, "must not be empty")
        return text

    def integer(self, value: Any, path: str) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"must be an integer, got {_kind(value)}")
            return None
        return value

    def number(self, value: Any, path: str) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, f"must be a number, got {_kind(value)}")
            return None
        return float(value)

    def plugin_ref(self, value: Any, path: str, *, optional: bool = False) -> PluginRef | None:
        """A `{pluginRef: name}` section; with `optional`, an empty name means the default (None)."""
        raw = self.mapping(value, path, ("pluginRef",))
        if value is None:
            return None
        ref = self.string(raw.get("pluginRef"), _join(path, "pluginRef"), required=not optional)
        if optional and not ref:
            return None
        return PluginRef(ref or "")

    def document(self, raw: Any) -> EndpointPickerConfig:
        top = self.mapping(
            raw,
            "",
            (
                "apiVersion",
                "kind",
                "featureGates",
                "plugins",
                "schedulingProfiles",
                "saturationDetector",
                "parser",
                "dataLayer",
                "flowControl",
            ),
        )
        if raw is not None and not isinstance(raw, Mapping):
            return EndpointPickerConfig()
        api_version = self.string(top.get("apiVersion"), "apiVersion", required=True) or ""
        if api_version and api_version not in API_VERSIONS:
            self.fail("apiVersion", f'must be one of {", ".join(API_VERSIONS)}, got "{api_version}"')
        kind = self.string(top.get("kind"), "kind", required=True) or ""
        if kind and kind != KIND:
            self.fail("kind", f'must be {KIND}, got "{kind}"')
        gates = []
        for i, gate in enumerate(self.sequence(top.get("featureGates"), "featureGates")):
            name = self.string(gate, f"featureGates[{i}]", required=True)
            if name and name not in FEATURE_GATES:
                self.fail(f"featureGates[{i}]", f'unknown feature gate "{name}" (known: {", ".join(FEATURE_GATES)})')
            elif name:
                gates.append(name)
        return EndpointPickerConfig(
            api_version=api_version,
            kind=kind,
            feature_gates=tuple(gates),
            plugins=tuple(
                self.plugin(p, f"plugins[{i}]") for i, p in enumerate(self.sequence(top.get("plugins"), "plugins"))
            ),
            scheduling_profiles=tuple(
                self.profile(p, f"schedulingProfiles[{i}]")
                for i, p in enumerate(self.sequence(top.get("schedulingProfiles"), "schedulingProfiles"))
            ),
            # The reference: an empty saturationDetector.pluginRef means utilization-detector.
            saturation_detector=self.plugin_ref(top.get("saturationDetector"), "saturationDetector", optional=True),
            parser=self.plugin_ref(top.get("parser"), "parser"),
            # `dataLayer: null` is the same as no section (the default data layer), `{}` turns it off.
            data_layer=self.data_layer(top["dataLayer"], "dataLayer") if top.get("dataLayer") is not None else None,
            flow_control=(
                self.flow_control(top["flowControl"], "flowControl") if top.get("flowControl") is not None else None
            ),
        )

    def plugin(self, value: Any, path: str) -> PluginSpec:
        raw = self.mapping(value, path, ("name", "type", "parameters"))
        plugin_type = self.string(raw.get("type"), _join(path, "type"), required=True) or ""
        name = self.string(raw.get("name"), _join(path, "name")) or plugin_type
        parameters = raw.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            self.fail(_join(path, "parameters"), f"must be a mapping, got {_kind(parameters)}")
            parameters = None
        return PluginSpec(name, plugin_type, dict(parameters or {}))

    def profile(self, value: Any, path: str) -> SchedulingProfileSpec:
        raw = self.mapping(value, path, ("name", "plugins"))
        name = self.string(raw.get("name"), _join(path, "name"), required=True) or ""
        refs = []
        for i, item in enumerate(self.sequence(raw.get("plugins"), _join(path, "plugins"))):
            item_path = f"{path}.plugins[{i}]"
            entry = self.mapping(item, item_path, ("pluginRef", "weight"))
            ref = self.string(entry.get("pluginRef"), _join(item_path, "pluginRef"), required=True) or ""
            weight = self.number(entry.get("weight"), _join(item_path, "weight"))
            if weight is not None and weight < 0:
                self.fail(_join(item_path, "weight"), f"must be >= 0, got {weight:g}")
            refs.append(ProfilePluginRef(ref, weight))
        return SchedulingProfileSpec(name, tuple(refs))

    def data_layer(self, value: Any, path: str) -> DataLayerSpec:
        raw = self.mapping(value, path, ("sources",))
        sources = []
        for i, item in enumerate(self.sequence(raw.get("sources"), _join(path, "sources"))):
            item_path = f"{path}.sources[{i}]"
            entry = self.mapping(item, item_path, ("pluginRef", "extractors"))
            ref = self.string(entry.get("pluginRef"), _join(item_path, "pluginRef"), required=True) or ""
            extractors = tuple(
                self.plugin_ref(e, f"{item_path}.extractors[{j}]") or PluginRef("")
                for j, e in enumerate(self.sequence(entry.get("extractors"), _join(item_path, "extractors")))
            )
            sources.append(DataSourceSpec(ref, extractors))
        return DataLayerSpec(tuple(sources))

    def priority_band(self, value: Any, path: str, *, needs_priority: bool) -> PriorityBandSpec:
        raw = self.mapping(
            value, path, ("priority", "maxBytes", "maxRequests", "fairnessPolicyRef", "orderingPolicyRef")
        )
        priority = self.integer(raw.get("priority"), _join(path, "priority"))
        if needs_priority and priority is None:
            self.fail(_join(path, "priority"), "is required")
        return PriorityBandSpec(
            priority=priority,
            max_bytes=self.quantity(raw.get("maxBytes"), _join(path, "maxBytes")),
            max_requests=self.quantity(raw.get("maxRequests"), _join(path, "maxRequests")),
            fairness_policy_ref=self.string(raw.get("fairnessPolicyRef"), _join(path, "fairnessPolicyRef")),
            ordering_policy_ref=self.string(raw.get("orderingPolicyRef"), _join(path, "orderingPolicyRef")),
        )

    def non_negative(self, value: Any, path: str) -> int | None:
        number = self.integer(value, path)
        if number is not None and number < 0:
            self.fail(path, f"must be >= 0, got {number}")
        return number

    def quantity(self, value: Any, path: str) -> int | None:
        """A non-negative integer or Kubernetes quantity string ("10Gi", "500M"), as a number."""
        if not isinstance(value, str):
            return self.non_negative(value, path)
        try:
            number = parse_quantity(value)
        except ValueError as error:
            self.fail(path, str(error))
            return None
        if number < 0:
            self.fail(path, f'must be >= 0, got "{value}"')
            return None
        return number

    def duration(self, value: Any, path: str) -> str | None:
        """A Go duration string, checked."""
        text = self.string(value, path)
        if text:
            try:
                parse_duration(text)
            except ValueError as error:
                self.fail(path, str(error))
        return text

    def flow_control(self, value: Any, path: str) -> FlowControlSpec:
        raw = self.mapping(
            value,
            path,
            (
                "maxBytes",
                "maxRequests",
                "defaultRequestTTL",
                "maxAffinityWait",
                "defaultPriorityBand",
                "priorityBands",
                "usageLimitPolicyPluginRef",
            ),
        )
        ttl = self.duration(raw.get("defaultRequestTTL"), _join(path, "defaultRequestTTL"))
        affinity_wait = self.duration(raw.get("maxAffinityWait"), _join(path, "maxAffinityWait"))
        default_band = raw.get("defaultPriorityBand")
        bands = tuple(
            self.priority_band(b, f"{path}.priorityBands[{i}]", needs_priority=True)
            for i, b in enumerate(self.sequence(raw.get("priorityBands"), _join(path, "priorityBands")))
        )
        seen: set[int] = set()
        for i, band in enumerate(bands):
            if band.priority is None:
                continue
            if band.priority in seen:
                self.fail(f"{path}.priorityBands[{i}].priority", f"duplicate priority {band.priority}")
            seen.add(band.priority)
        return FlowControlSpec(
            max_bytes=self.quantity(raw.get("maxBytes"), _join(path, "maxBytes")),
            max_requests=self.quantity(raw.get("maxRequests"), _join(path, "maxRequests")),
            default_request_ttl=ttl,
            max_affinity_wait=affinity_wait,
            default_priority_band=(
                self.priority_band(default_band, _join(path, "defaultPriorityBand"), needs_priority=False)
                if default_band is not None
                else None
            ),
            priority_bands=bands,
            usage_limit_policy_plugin_ref=self.string(
                raw.get("usageLimitPolicyPluginRef"), _join(path, "usageLimitPolicyPluginRef")
            ),
        )


# Field names the reference's docs use but its decoder rejects, with the name it reads.
_RENAMED = {"data": "dataLayer"}


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    return "a list" if isinstance(value, list) else "a mapping" if isinstance(value, Mapping) else repr(value)


def decode(raw: Any) -> EndpointPickerConfig:
    """The typed config for a parsed YAML/JSON document; raises ConfigError on any problem."""
    decoder = _Decoder()
    config = decoder.document(raw)
    if decoder.errors:
        raise ConfigError(decoder.errors)
    return config
