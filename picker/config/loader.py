"""From YAML text to an effective config with its plugin instances.

`build()` instantiates every configured plugin (each validating its own parameters), then
applies the reference's system defaults (§3.4): a profile handler, a picker per profile, the
parser, the saturation detector, the data layer and default producers for consumed data keys.
The returned `LoadedConfig.config` is the effective config with every default written out, and
`LoadedConfig.notes` says where the picker's meaning needs a word (a reference rule applied,
something accepted that the picker does not act on).
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
from picker.flowcontrol.policies import DEFAULT_POLICIES, FairnessPolicy, OrderingPolicy, StaticUsageLimitPolicy
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
from picker.plugins import REGISTRY, UNSUPPORTED_REFERENCE_TYPES

DEFAULT_PROFILE = "default"
DEFAULT_SCORER_WEIGHT = 1.0


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """An effective config and its plugins by name; producers in dependency order; notes for
    the operator (`picker config show` prints them, the server logs them on install)."""

    config: EndpointPickerConfig
    plugins: Mapping[str, Plugin]
    producers: tuple[DataProducer, ...]
    notes: tuple[str, ...] = ()


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
        self.notes: list[str] = []
        self.specs: list[PluginSpec] = []
        self.places: dict[str, str] = {}  # plugin name → where it was configured (or added)
        self.forwarded: set[str] = set()  # plugins whose parameters configured a default producer
        self.producer_donors: set[str] = set()  # plugins whose producer_parameters one took
        self.plugins: dict[str, Plugin] = {}

    # -- plugins -------------------------------------------------------------------------

    def instantiate(self, spec: PluginSpec, place: str) -> None:
        self.specs.append(spec)
        self.places[spec.name] = place
        registration = REGISTRY.lookup(spec.type)
        if registration is None:
            reason = UNSUPPORTED_REFERENCE_TYPES.get(spec.type)
            if reason is not None:
                self.errors.append(
                    f'{place}.type: the picker does not support the reference type "{spec.type}": {reason}'
                )
            else:
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
        self.notes += [f'{place} "{spec.name}": {note}' for note in plugin.notes]
        self.handle.add_plugin(plugin)

    def ensure(self, plugin_type: str, parameters: Mapping[str, Any] | None = None) -> str:
        """`plugin_type` as a plugin name: the plugin of that name, else a new one of that type
        (with `parameters`, else defaults), as the reference adds its defaults by name."""
        existing = next((spec for spec in self.specs if spec.name == plugin_type), None)
        if existing is None:
            spec = PluginSpec(plugin_type, plugin_type, dict(parameters or {}))
            self.instantiate(spec, f'default plugin "{plugin_type}"')
        elif existing.type != plugin_type:
            self.errors.append(
                f'{self.places[plugin_type]}.name: cannot add the default plugin "{plugin_type}": '
                f'a plugin of type "{existing.type}" has its name'
            )
        return plugin_type

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
        self.unused_producer_parameters()
        self.undelivered_producer_parameters()
        producers = self.ordered_producers()
        if self.errors:
            raise ConfigError(self.errors)
        self.notes += _feature_notes(config)
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
        return LoadedConfig(effective, dict(self.plugins), producers, tuple(self.notes))

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
                plugin = self.check_ref(ref.plugin_ref, ref_place, Plugin, "a plugin")
                if plugin is not None and not isinstance(plugin, (Filter, Scorer, Picker)):
                    self.notes.append(
                        f'{ref_place}: "{ref.plugin_ref}" is not a filter, scorer or picker: '
                        "it takes no part in scheduling (as in the reference)"
                    )
                if isinstance(plugin, Picker):
                    pickers.append(ref.plugin_ref)
                weight = ref.weight if ref.weight is not None else DEFAULT_SCORER_WEIGHT
                refs.append(ProfilePluginRef(ref.plugin_ref, weight if isinstance(plugin, Scorer) else None))
            if len(pickers) > 1:
                self.errors.append(f"{place}: more than one picker ({_quoted(pickers)})")
            if not pickers:
                refs.append(ProfilePluginRef(self.default_picker()))
            result.append(SchedulingProfileSpec(profile.name, tuple(refs)))
        return tuple(result)

    def default_picker(self) -> str:
        """The picker of a profile that names none: the first configured picker, else a
        max-score-picker (the reference's rule)."""
        for spec in self.specs:
            if isinstance(self.plugins.get(spec.name), Picker):
                return spec.name
        return self.ensure("max-score-picker")

    def profile_handler(self, profiles: tuple[SchedulingProfileSpec, ...]) -> None:
        handlers = [name for name, p in self.plugins.items() if isinstance(p, ProfileHandler)]
        if len(handlers) > 1:
            self.errors.append(f"plugins: only one profile handler may be configured, found {_quoted(handlers)}")
            return
        if not handlers and any(spec.name not in self.plugins for spec in self.specs):
            return  # a plugin that failed to build (its error is reported) may be the handler
        if not handlers and len(profiles) > 1:
            self.errors.append(
                f"plugins: {len(profiles)} scheduling profiles need a profile handler; none is configured"
            )
            return
        if not handlers:
            handlers = [self.ensure("single-profile-handler")]
        handler = self.plugins.get(handlers[0])
        if handler is not None and handler.plugin_type == "single-profile-handler" and len(profiles) > 1:
            self.errors.append(
                f"schedulingProfiles: single-profile-handler needs exactly one profile, found {len(profiles)}"
            )

    def single_ref(self, ref: PluginRef | None, place: str, default_type: str, kind: type[Plugin], what: str) -> str:
        """The plugin a `{pluginRef}` section names; the default type's name (also when the
        section is absent) is added with defaults when no plugin has it, as in the reference."""
        name = ref.plugin_ref if ref is not None else default_type
        if name == default_type:
            self.ensure(default_type)
        else:
            self.check_ref(name, f"{place}.pluginRef", kind, what)
        return name

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
        """Every policy the flowControl section names must be a configured policy; the
        reference's default policies (`DEFAULT_POLICIES`) are added when named and absent."""
        flow = self.config.flow_control
        if flow is None:
            return
        bands = [("flowControl.defaultPriorityBand", flow.default_priority_band)] if flow.default_priority_band else []
        bands += [(f"flowControl.priorityBands[{i}]", band) for i, band in enumerate(flow.priority_bands)]
        refs: list[tuple[str, str | None, type[Plugin], str]] = [
            (
                "flowControl.usageLimitPolicyPluginRef",
                flow.usage_limit_policy_plugin_ref,
                StaticUsageLimitPolicy,
                "a usage-limit policy",
            )
        ]
        for place, band in bands:
            refs += [(f"{place}.fairnessPolicyRef", band.fairness_policy_ref, FairnessPolicy, "a fairness policy")]
            refs += [(f"{place}.orderingPolicyRef", band.ordering_policy_ref, OrderingPolicy, "an ordering policy")]
        for place, ref, kind, what in refs:
            if ref in DEFAULT_POLICIES:
                self.ensure(ref)
            if ref is not None:
                self.check_ref(ref, place, kind, what)

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
                elif not any(spec.name == producer_type for spec in self.specs):
                    self.ensure(producer_type, self.producer_parameters(key, producer_type))

    def producer_parameters(self, key: str, producer_type: str) -> Mapping[str, Any]:
        """The parameters of the default producer added for `key`: those of the last configured
        plugin consuming `key` whose type configures it (the reference's rule), else none; with
        the `producer_parameters` of the plugins consuming `key` (which must not disagree)."""
        parameters = dict(self.donor_parameters(key, producer_type))
        for spec in self.specs:
            plugin = self.plugins.get(spec.name)
            if plugin is None or not plugin.producer_parameters or key not in {k.name for k in plugin.consumes}:
                continue
            self.producer_donors.add(spec.name)
            for name, value in plugin.producer_parameters.items():
                if parameters.get(name, value) != value:
                    self.errors.append(
                        f'{self.places[spec.name]} "{spec.name}": its {name} for the "{producer_type}" added for it '
                        "differ from another plugin's"
                    )
                parameters[name] = value
            self.notes.append(
                f'{self.places[spec.name]} "{spec.name}": it gives the "{producer_type}" added for it its '
                f"{', '.join(plugin.producer_parameters)}"
            )
        return parameters

    def donor_parameters(self, key: str, producer_type: str) -> Mapping[str, Any]:
        """The parameters of the last configured plugin consuming `key` whose type configures the
        default producer (the reference's rule), noted; else none."""
        donors = [spec for spec in self.specs if self.configures_producer(spec, key)]
        if not donors:
            return {}
        donor = donors[-1]
        self.forwarded.add(donor.name)
        if donor.parameters:
            self.notes.append(
                f'{self.places[donor.name]} "{donor.name}": its parameters configure the "{producer_type}" '
                "added for it (as in the reference)"
            )
        return donor.parameters

    def configures_producer(self, spec: PluginSpec, key: str) -> bool:
        registration = REGISTRY.lookup(spec.type)
        plugin = self.plugins.get(spec.name)
        return (
            registration is not None
            and registration.configures_default_producer
            and plugin is not None
            and key in {k.name for k in plugin.consumes}
        )

    def unused_producer_parameters(self) -> None:
        """Note the parameters of plugins whose type configures a default producer, where they
        configured none: one was configured, or a later plugin's parameters were used."""
        for spec in self.specs:
            registration = REGISTRY.lookup(spec.type)
            if (
                spec.parameters
                and registration is not None
                and registration.configures_default_producer
                and spec.name not in self.forwarded
            ):
                self.notes.append(
                    f'{self.places[spec.name]} "{spec.name}": its parameters are not used: they configure only '
                    "the producer added for it, and none was (one is configured, or a later plugin's parameters "
                    "configured it), as in the reference"
                )

    def undelivered_producer_parameters(self) -> None:
        """A plugin's `producer_parameters` need the default producer: refuse them where the
        producer of its data is configured (they would be lost)."""
        for spec in self.specs:
            plugin = self.plugins.get(spec.name)
            if plugin is not None and plugin.producer_parameters and spec.name not in self.producer_donors:
                self.errors.append(
                    f'{self.places[spec.name]} "{spec.name}": its {", ".join(plugin.producer_parameters)} would '
                    "configure the producer added for it, and one is configured: give them to that one"
                )

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


def _feature_notes(config: EndpointPickerConfig) -> list[str]:
    """What the feature gates and the flowControl section mean to the picker."""
    notes = []
    if "dataLayer" in config.feature_gates:
        notes.append('featureGates: "dataLayer" is obsolete: the data layer is always on (as in the reference)')
    if config.flow_control is not None and "flowControl" not in config.feature_gates:
        notes.append(
            'flowControl: the section is ignored while the "flowControl" feature gate is off (as in the '
            "reference): a sheddable request (priority < 0) is rejected while the pool is saturated"
        )
    return notes


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
        "maxAffinityWait": flow.max_affinity_wait,
        "defaultPriorityBand": band(flow.default_priority_band) if flow.default_priority_band else None,
        "priorityBands": [band(b) for b in flow.priority_bands] or None,
        "usageLimitPolicyPluginRef": flow.usage_limit_policy_plugin_ref,
    }
    return {k: v for k, v in fields.items() if v is not None}


def to_yaml(config: EndpointPickerConfig) -> str:
    return yaml.safe_dump(to_document(config), sort_keys=False)
