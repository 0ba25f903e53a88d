"""From YAML text to an effective config with its plugin instances.

`build()` instantiates every configured plugin (each validating its own parameters), then
applies the reference's system defaults (§3.4): a profile handler, a picker per profile, the
parser, the saturation detector, the data layer and default producers for consumed data keys.
The returned `LoadedConfig.config` is the effective config with every default written out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from graphlib import CycleError, TopologicalSorter
from pathlib import Path
from typing import Any

import yaml

from picker.config.schema import (
    ConfigError,
    DataLayerSpec,
    DataSourceSpec,
    EndpointPickerConfig,
    FlowControlSpec,
    PluginRef,
    PluginSpec,
    PriorityBandSpec,
    ProfilePluginRef,
    SchedulingProfileSpec,
    decode,
)
from picker.datalayer.plugins import CoreMetricsExtractor, MetricsDataSource
from picker.framework.handle import Handle
from picker.framework.parameters import PluginConfigError
from picker.framework.plugin import (
    DataProducer,
    Filter,
    Parser,
    Picker,
    Plugin,
    ProfileHandler,
    SaturationDetector,
    Scorer,
)
from picker.plugins import REGISTRY

DEFAULT_PROFILE = "default"
DEFAULT_SCORER_WEIGHT = 1.0


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """An effective config and its plugins by name; producers in dependency order."""

    config: EndpointPickerConfig
    plugins: Mapping[str, Plugin]
    producers: tuple[DataProducer, ...]


def parse_text(text: str) -> EndpointPickerConfig:
    """Decode YAML (or JSON) text strictly; raises ConfigError."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError([f"invalid YAML: {error}"]) from None
    if raw is None:
        raise ConfigError(["the config is empty"])
    return decode(raw)


def parse_file(path: str | Path) -> EndpointPickerConfig:
    """Decode a config file strictly; raises ConfigError (also for an unreadable file)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError([f"cannot read {path}: {error}"]) from None
    return parse_text(text)


def default_config() -> EndpointPickerConfig:
    """The reference default (no config given): queue 2, kv-cache 2 and prefix-cache 3 (when
    registered), plus the data layer."""
    weighted = [("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0)]
    if REGISTRY.lookup("prefix-cache-scorer") is not None:
        weighted.append(("prefix-cache-scorer", 3.0))
    plugins = [PluginSpec(t, t) for t, _ in weighted]
    plugins += [PluginSpec(t, t) for t in ("metrics-data-source", "core-metrics-extractor")]
    profile = SchedulingProfileSpec(DEFAULT_PROFILE, tuple(ProfilePluginRef(t, w) for t, w in weighted))
    return EndpointPickerConfig(plugins=tuple(plugins), scheduling_profiles=(profile,))


class _Builder:
    def __init__(self, config: EndpointPickerConfig, handle: Handle) -> None:
        self.config = config
        self.handle = handle
        self.errors: list[str] = []
        self.specs: list[PluginSpec] = []
        self.plugins: dict[str, Plugin] = {}

    # -- plugins -------------------------------------------------------------------------

    def instantiate(self, spec: PluginSpec, place: str) -> None:
        self.specs.append(spec)
        registration = REGISTRY.lookup(spec.type)
        if registration is None:
            self.errors.append(f'{place}.type: unknown plugin type "{spec.type}"')
            return
        try:
            plugin = registration.factory(spec.name, spec.parameters, self.handle)
        except PluginConfigError as error:
            self.errors.append(f"{place}.parameters.{error}")
            return
        except Exception as error:  # a plugin's own bug must still give a config error, not a crash
            self.errors.append(f'{place}: plugin "{spec.type}" failed to start: {type(error).__name__}: {error}')
            return
        self.plugins[spec.name] = plugin
        self.handle.add_plugin(plugin)

    def ensure(self, plugin_type: str) -> str:
        """The name of a plugin of `plugin_type` (an existing one, else a new default one)."""
        for spec in self.specs:
            if spec.type == plugin_type:
                return spec.name
        name = plugin_type
        if any(spec.name == name for spec in self.specs):
            self.errors.append(f'plugins: cannot add default plugin "{plugin_type}": its name is taken')
            return name
        self.instantiate(PluginSpec(name, plugin_type), f'default plugin "{plugin_type}"')
        return name

    def check_ref(
        self, ref: str, place: str, kind: type[Plugin] | tuple[type[Plugin], ...], what: str
    ) -> Plugin | None:
        if not any(spec.name == ref for spec in self.specs):
            self.errors.append(f'{place}: no plugin named "{ref}"')
            return None
        plugin = self.plugins.get(ref)  # None if it failed to build: already reported
        if plugin is not None and not isinstance(plugin, kind):
            self.errors.append(f'{place}: plugin "{ref}" (type "{plugin.plugin_type}") is not {what}')
            return None
        return plugin

    # -- the whole config ---------------------------------------------------------------

    def build(self) -> LoadedConfig:
        config = self.config
        names: set[str] = set()
        for i, spec in enumerate(config.plugins):
            if spec.name in names:
                self.errors.append(f'plugins[{i}].name: duplicate plugin name "{spec.name}"')
                continue
            names.add(spec.name)
            self.instantiate(spec, f"plugins[{i}]")

        profiles = self.profiles()
        self.profile_handler(profiles)
        parser = self.single_ref(config.parser, "parser", "openai-parser", Parser, "a request parser")
        detector = self.single_ref(
            config.saturation_detector,
            "saturationDetector",
            "utilization-detector",
            SaturationDetector,
            "a saturation detector",
        )
        data_layer = self.data_layer()
        self.flow_control_refs()
        self.default_producers()
        producers = self.ordered_producers()
        if self.errors:
            raise ConfigError(self.errors)
        effective = replace(
            config,
            plugins=tuple(
                replace(spec, parameters=dict(self.plugins[spec.name].parameters or spec.parameters))
                for spec in self.specs
            ),
            scheduling_profiles=profiles,
            parser=PluginRef(parser),
            saturation_detector=PluginRef(detector),
            data_layer=data_layer,
        )
        return LoadedConfig(effective, dict(self.plugins), producers)

    def profiles(self) -> tuple[SchedulingProfileSpec, ...]:
        declared = self.config.scheduling_profiles
        if not declared:
            every = tuple(
                ProfilePluginRef(spec.name)
                for spec in self.specs
                if isinstance(self.plugins.get(spec.name), (Filter, Scorer, Picker))
            )
            declared = (SchedulingProfileSpec(DEFAULT_PROFILE, every),)
        result = []
        seen: set[str] = set()
        for i, profile in enumerate(declared):
            place = f"schedulingProfiles[{i}]"
            if profile.name in seen:
                self.errors.append(f'{place}.name: duplicate profile name "{profile.name}"')
            seen.add(profile.name)
            refs: list[ProfilePluginRef] = []
            pickers: list[str] = []
            for j, ref in enumerate(profile.plugins):
                ref_place = f"{place}.plugins[{j}].pluginRef"
                plugin = self.check_ref(
                    ref.plugin_ref, ref_place, (Filter, Scorer, Picker), "a filter, scorer or picker"
                )
                if isinstance(plugin, Picker):
                    pickers.append(ref.plugin_ref)
                weight = ref.weight if ref.weight is not None else DEFAULT_SCORER_WEIGHT
                refs.append(ProfilePluginRef(ref.plugin_ref, weight if isinstance(plugin, Scorer) else None))
            if len(pickers) > 1:
                self.errors.append(f"{place}: more than one picker ({_quoted(pickers)})")
            if not pickers:
                refs.append(ProfilePluginRef(self.ensure("max-score-picker")))
            result.append(SchedulingProfileSpec(profile.name, tuple(refs)))
        return tuple(result)

    def profile_handler(self, profiles: tuple[SchedulingProfileSpec, ...]) -> None:
        handlers = [name for name, p in self.plugins.items() if isinstance(p, ProfileHandler)]
        if len(handlers) > 1:
            self.errors.append(f"plugins: only one profile handler may be configured, found {_quoted(handlers)}")
            return
        if not handlers:
            handlers = [self.ensure("single-profile-handler")]
        handler = self.plugins.get(handlers[0])
        if handler is not None and handler.plugin_type == "single-profile-handler" and len(profiles) > 1:
            self.errors.append(
                f"schedulingProfiles: single-profile-handler needs exactly one profile, found {len(profiles)}"
            )

    def single_ref(self, ref: PluginRef | None, place: str, default_type: str, kind: type[Plugin], what: str) -> str:
        if ref is None:
            return self.ensure(default_type)
        self.check_ref(ref.plugin_ref, f"{place}.pluginRef", kind, what)
        return ref.plugin_ref

    def data_layer(self) -> DataLayerSpec | None:
        spec = self.config.data_layer
        if spec is None:
            if "enableLegacyMetrics" in self.config.feature_gates:
                return None
            source = self.ensure("metrics-data-source")
            extractor = self.ensure("core-metrics-extractor")
            return DataLayerSpec((DataSourceSpec(source, (PluginRef(extractor),)),))
        if len(spec.sources) > 1:
            self.errors.append(
                f"dataLayer.sources: the picker reads one metrics page per endpoint, found {len(spec.sources)} sources"
            )
        for i, data_source in enumerate(spec.sources):
            place = f"dataLayer.sources[{i}]"
            if len(data_source.extractors) > 1:
                self.errors.append(
                    f"{place}.extractors: one core-metrics-extractor reads every metric, "
                    f"found {len(data_source.extractors)}"
                )
            self.check_ref(data_source.plugin_ref, f"{place}.pluginRef", MetricsDataSource, "a data source")
            for j, extractor_ref in enumerate(data_source.extractors):
                self.check_ref(
                    extractor_ref.plugin_ref, f"{place}.extractors[{j}].pluginRef", CoreMetricsExtractor, "an extractor"
                )
        return spec

    def flow_control_refs(self) -> None:
        flow = self.config.flow_control
        if flow is None:
            return
        bands = [("flowControl.defaultPriorityBand", flow.default_priority_band)] if flow.default_priority_band else []
        bands += [(f"flowControl.priorityBands[{i}]", band) for i, band in enumerate(flow.priority_bands)]
        refs = [("flowControl.usageLimitPolicyPluginRef", flow.usage_limit_policy_plugin_ref)]
        for place, band in bands:
            refs += [(f"{place}.fairnessPolicyRef", band.fairness_policy_ref)]
            refs += [(f"{place}.orderingPolicyRef", band.ordering_policy_ref)]
        for place, ref in refs:
            if ref is not None and not any(spec.name == ref for spec in self.specs):
                self.errors.append(f'{place}: no plugin named "{ref}"')

    def default_producers(self) -> None:
        """Add the registered default producer of every consumed key nobody produces."""
        checked: set[tuple[str, str]] = set()
        while True:  # a new producer may itself consume keys
            produced = {key.name for p in self.plugins.values() if isinstance(p, DataProducer) for key in p.produces}
            missing = [
                (plugin.name, key)
                for plugin in self.plugins.values()
                for key in sorted({k.name for k in plugin.consumes} - produced)
                if (plugin.name, key) not in checked
            ]
            if not missing:
                return
            for name, key in missing:
                checked.add((name, key))
                producer_type = REGISTRY.default_producer(key)
                if producer_type is None:
                    self.errors.append(f'plugin "{name}" consumes "{key}" but no plugin produces it')
                else:
                    self.ensure(producer_type)

    def ordered_producers(self) -> tuple[DataProducer, ...]:
        producers = [p for p in self.plugins.values() if isinstance(p, DataProducer)]
        by_key: dict[str, list[str]] = {}
        for producer in producers:
            for key in producer.produces:
                by_key.setdefault(key.name, []).append(producer.name)
        graph = {
            p.name: {
                dependency for key in p.consumes for dependency in by_key.get(key.name, ()) if dependency != p.name
            }
            for p in producers
        }
        try:
            order = list(TopologicalSorter(graph).static_order())
        except CycleError as error:
            self.errors.append(f"plugins: data producers depend on each other in a cycle: {error.args[1]}")
            return ()
        by_name = {p.name: p for p in producers}
        return tuple(by_name[name] for name in order)


def _quoted(names: list[str]) -> str:
    return ", ".join(f'"{name}"' for name in names)


def build(config: EndpointPickerConfig, handle: Handle | None = None) -> LoadedConfig:
    """Apply defaults to `config` and instantiate its plugins; raises ConfigError."""
    return _Builder(config, handle or Handle()).build()


def to_document(config: EndpointPickerConfig) -> dict[str, Any]:
    """The config as a plain mapping with the reference's field names (for YAML output)."""
    document: dict[str, Any] = {"apiVersion": config.api_version, "kind": config.kind}
    if config.feature_gates:
        document["featureGates"] = list(config.feature_gates)
    document["plugins"] = [
        {"name": p.name, "type": p.type, **({"parameters": dict(p.parameters)} if p.parameters else {})}
        for p in config.plugins
    ]
    document["schedulingProfiles"] = [
        {
            "name": profile.name,
            "plugins": [
                {"pluginRef": r.plugin_ref, **({"weight": r.weight} if r.weight is not None else {})}
                for r in profile.plugins
            ],
        }
        for profile in config.scheduling_profiles
    ]
    if config.saturation_detector is not None:
        document["saturationDetector"] = {"pluginRef": config.saturation_detector.plugin_ref}
    if config.parser is not None:
        document["parser"] = {"pluginRef": config.parser.plugin_ref}
    if config.data_layer is not None:
        document["dataLayer"] = {
            "sources": [
                {"pluginRef": s.plugin_ref, "extractors": [{"pluginRef": e.plugin_ref} for e in s.extractors]}
                for s in config.data_layer.sources
            ]
        }
    if config.flow_control is not None:
        document["flowControl"] = _flow_control_document(config.flow_control)
    return document


def _flow_control_document(flow: FlowControlSpec) -> dict[str, Any]:
    def band(b: PriorityBandSpec) -> dict[str, Any]:
        fields = {
            "priority": b.priority,
            "maxBytes": b.max_bytes,
            "maxRequests": b.max_requests,
            "fairnessPolicyRef": b.fairness_policy_ref,
            "orderingPolicyRef": b.ordering_policy_ref,
        }
        return {k: v for k, v in fields.items() if v is not None}

    fields = {
        "maxBytes": flow.max_bytes,
        "maxRequests": flow.max_requests,
        "defaultRequestTTL": flow.default_request_ttl,
        "defaultPriorityBand": band(flow.default_priority_band) if flow.default_priority_band else None,
        "priorityBands": [band(b) for b in flow.priority_bands] or None,
        "usageLimitPolicyPluginRef": flow.usage_limit_policy_plugin_ref,
    }
    return {k: v for k, v in fields.items() if v is not None}


def to_yaml(config: EndpointPickerConfig) -> str:
    return yaml.safe_dump(to_document(config), sort_keys=False)
