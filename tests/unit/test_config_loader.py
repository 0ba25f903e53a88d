"""EndpointPickerConfig decoding, defaults (gie-epp.md §3.4, §3.5), error paths and the CLI."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.config import cli
from picker.config.loader import build, default_config, parse_file, parse_text, to_yaml
from picker.config.schema import ConfigError
from picker.datastore.endpoint import EndpointState
from picker.framework import registry
from picker.framework.cycle_state import CycleState, StateKey
from picker.framework.handle import Handle
from picker.framework.plugin import DataProducer, Scorer
from picker.framework.request import InferenceRequest
from picker.plugins import REGISTRY
from picker.scheduling.saturation import UtilizationDetector

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"

REFERENCE_EXAMPLE = (
    HEADER
    + """
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: utilization-detector
  parameters: {queueDepthThreshold: 8}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
saturationDetector:
  pluginRef: utilization-detector
"""
)


def effective(text: str) -> dict[str, Any]:
    return yaml.safe_load(to_yaml(build(parse_text(text)).config))


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        build(parse_text(text))
    return caught.value.errors


def test_reference_example_gets_system_defaults() -> None:
    loaded = build(parse_text(REFERENCE_EXAMPLE))
    document = yaml.safe_load(to_yaml(loaded.config))
    types = [p["type"] for p in document["plugins"]]
    assert types == [
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "utilization-detector",
        "max-score-picker",
        "single-profile-handler",
        "openai-parser",
        "metrics-data-source",
        "core-metrics-extractor",
    ]
    assert document["schedulingProfiles"] == [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "queue-scorer", "weight": 2.0},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2.0},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ]
    assert document["saturationDetector"] == {"pluginRef": "utilization-detector"}
    assert document["parser"] == {"pluginRef": "openai-parser"}
    assert document["dataLayer"] == {
        "sources": [{"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]}]
    }
    assert document["plugins"][2]["parameters"] == {  # every parameter default written out
        "queueDepthThreshold": 8,
        "kvCacheUtilThreshold": 0.8,
        "metricsStalenessThreshold": "200ms",
        "headroom": 0.0,
    }
    detector = loaded.plugins["utilization-detector"]
    assert isinstance(detector, UtilizationDetector) and detector.queue_depth_threshold == 8
    # The effective config is itself a valid config that loads to the same thing.
    assert build(parse_text(to_yaml(loaded.config))).config == loaded.config


def test_weights_default_to_one_and_empty_profiles_reference_every_filter_scorer_picker() -> None:
    document = effective(
        HEADER + "plugins: [{type: header-based-testing-filter}, {type: queue-scorer},"
        " {name: lucky, type: random-picker}, {type: metrics-data-source}]\n"
    )
    assert document["schedulingProfiles"] == [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "header-based-testing-filter"},
                {"pluginRef": "queue-scorer", "weight": 1.0},
                {"pluginRef": "lucky"},
            ],
        }
    ]


def test_default_config_is_the_reference_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(REGISTRY.registrations, "prefix-cache-scorer", raising=False)
    profile = default_config().scheduling_profiles[0]
    assert [(r.plugin_ref, r.weight) for r in profile.plugins] == [
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
    ]
    build(default_config())


PREFIX_MATCH = StateKey("test-prefix-match", bool)


class PrefixMatchScorer(Scorer):
    plugin_type = "prefix-cache-scorer"
    consumes = frozenset({PREFIX_MATCH})

    def score(self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]):
        return [0.0] * len(candidates)


class PrefixProducer(DataProducer):
    plugin_type = "test-prefix-producer"
    produces = frozenset({PREFIX_MATCH})

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        cycle_state[PREFIX_MATCH] = True


def _factory(cls: type) -> registry.PluginFactory:
    def create(name: str, parameters: Mapping[str, Any], handle: Handle) -> Any:
        return cls(name)

    return create


def test_prefix_scorer_joins_the_default_and_its_producer_is_auto_created(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        REGISTRY.registrations,
        "prefix-cache-scorer",
        registry.Registration("prefix-cache-scorer", _factory(PrefixMatchScorer)),
    )
    monkeypatch.setitem(
        REGISTRY.registrations,
        "test-prefix-producer",
        registry.Registration("test-prefix-producer", _factory(PrefixProducer), frozenset({"test-prefix-match"})),
    )
    config = default_config()
    assert [(r.plugin_ref, r.weight) for r in config.scheduling_profiles[0].plugins][-1] == ("prefix-cache-scorer", 3.0)
    loaded = build(config)
    assert [p.name for p in loaded.producers] == ["test-prefix-producer"]
    assert "test-prefix-producer" in [p.type for p in loaded.config.plugins]


def test_consumed_key_without_any_producer_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        REGISTRY.registrations,
        "prefix-cache-scorer",
        registry.Registration("prefix-cache-scorer", _factory(PrefixMatchScorer)),
    )
    monkeypatch.setattr(REGISTRY, "default_producer", lambda key: None)
    assert errors_of(HEADER + "plugins: [{type: prefix-cache-scorer}]\n") == [
        'plugin "prefix-cache-scorer" consumes "test-prefix-match" but no plugin produces it'
    ]


def test_legacy_metrics_gate_skips_the_default_data_layer_and_explicit_empty_sources_stay() -> None:
    legacy = effective(HEADER + "featureGates: [enableLegacyMetrics]\nplugins: [{type: queue-scorer}]\n")
    assert "dataLayer" not in legacy
    assert "metrics-data-source" not in [p["type"] for p in legacy["plugins"]]
    off = effective(HEADER + "plugins: [{type: queue-scorer}]\ndataLayer: {sources: []}\n")
    assert off["dataLayer"] == {"sources": []}


def test_token_load_config_naming_the_reference_producer_loads() -> None:
    document = effective(HEADER + "plugins: [{type: inflight-load-producer}, {type: token-load-scorer}]\n")
    assert document["schedulingProfiles"][0]["plugins"][0] == {"pluginRef": "token-load-scorer", "weight": 1.0}


def test_llm_d_api_version_is_accepted() -> None:
    build(parse_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: [{type: queue-scorer}]\n"))


def test_flow_control_section_is_validated() -> None:
    document = effective(
        HEADER
        + """featureGates: [flowControl]
plugins: [{type: queue-scorer}, {type: fcfs-ordering-policy}, {type: global-strict-fairness-policy}]
flowControl:
  maxBytes: 1000
  defaultRequestTTL: 30s
  priorityBands:
  - {priority: 1, maxRequests: 10, orderingPolicyRef: fcfs-ordering-policy, fairnessPolicyRef: global-strict-fairness-policy}
"""
    )
    assert document["flowControl"]["priorityBands"][0]["priority"] == 1
    assert errors_of(
        HEADER
        + """plugins: [{type: queue-scorer}]
flowControl:
  defaultRequestTTL: soon
  priorityBands: [{maxBytes: -1, orderingPolicyRef: nope}, {priority: 2}, {priority: 2}]
"""
    ) == [
        'flowControl.defaultRequestTTL: invalid duration "soon" (expected e.g. "200ms", "1.5s", "1m")',
        "flowControl.priorityBands[0].priority: is required",
        "flowControl.priorityBands[0].maxBytes: must be >= 0, got -1",
        "flowControl.priorityBands[2].priority: duplicate priority 2",
    ]
    assert errors_of(
        HEADER
        + "plugins: [{type: queue-scorer}]\nflowControl: {priorityBands: [{priority: 1, orderingPolicyRef: nope}]}\n"
    ) == ['flowControl.priorityBands[0].orderingPolicyRef: no plugin named "nope"']


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("kind: EndpointPickerConfig\n", ["apiVersion: is required"]),
        (
            "apiVersion: v1\nkind: Other\n",
            [
                'apiVersion: must be one of inference.networking.x-k8s.io/v1alpha1, llm-d.ai/v1alpha1, got "v1"',
                'kind: must be EndpointPickerConfig, got "Other"',
            ],
        ),
        (HEADER + "extra: 1\n", ["extra: unknown field"]),
        (
            HEADER + "featureGates: [dataLayer, warpDrive]\n",
            ['featureGates[1]: unknown feature gate "warpDrive" (known: dataLayer, enableLegacyMetrics, flowControl)'],
        ),
        (HEADER + "plugins: {type: queue-scorer}\n", ["plugins: must be a list, got a mapping"]),
        (HEADER + "plugins: [{name: x}]\n", ["plugins[0].type: is required"]),
        (HEADER + "plugins: [{type: queue-scorer, params: {}}]\n", ["plugins[0].params: unknown field"]),
        (
            HEADER + "plugins: [{type: queue-scorer, parameters: [1]}]\n",
            ["plugins[0].parameters: must be a mapping, got a list"],
        ),
        (
            HEADER + "schedulingProfiles: [{plugins: [{pluginRef: a, weight: heavy}]}]\n",
            [
                "schedulingProfiles[0].name: is required",
                "schedulingProfiles[0].plugins[0].weight: must be a number, got 'heavy'",
            ],
        ),
        (
            HEADER + "schedulingProfiles: [{name: p, plugins: [{pluginRef: a, weight: -1}]}]\n",
            [
                "schedulingProfiles[0].plugins[0].weight: must be >= 0, got -1",
            ],
        ),
        (
            HEADER + "saturationDetector: {plugin: x}\n",
            [
                "saturationDetector.plugin: unknown field",
            ],
        ),
        (
            HEADER + "dataLayer: {sources: [{extractors: [{}]}]}\n",
            [
                "dataLayer.sources[0].pluginRef: is required",
                "dataLayer.sources[0].extractors[0].pluginRef: is required",
            ],
        ),
        ("- just a list\n", ["must be a mapping, got a list"]),
    ],
)
def test_decoding_errors_name_their_place(text: str, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_text(text)
    assert caught.value.errors == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "plugins: [{type: queue-scorer}, {type: queue-scorer}]\n",
            ['plugins[1].name: duplicate plugin name "queue-scorer"'],
        ),
        (
            "plugins: [{type: queue-scorer}, {type: kv-cache-utilization-scorer}, {type: foo}]\n",
            ['plugins[2].type: unknown plugin type "foo"'],
        ),
        (
            "plugins: [{type: utilization-detector, parameters: {queueDepthThreshold: -2}}]\n",
            ["plugins[0].parameters.queueDepthThreshold: must be >= 1, got -2"],
        ),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer}, {pluginRef: x}]}]\n",
            ['schedulingProfiles[0].plugins[1].pluginRef: no plugin named "x"'],
        ),
        (
            "plugins: [{type: random-picker}, {type: max-score-picker}]\n"
            "schedulingProfiles: [{name: a, plugins: [{pluginRef: random-picker}, {pluginRef: max-score-picker}]}]\n",
            ['schedulingProfiles[0]: more than one picker ("random-picker", "max-score-picker")'],
        ),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer}]},"
            " {name: a, plugins: [{pluginRef: queue-scorer}]}]\n",
            [
                'schedulingProfiles[1].name: duplicate profile name "a"',
                "plugins: 2 scheduling profiles need a profile handler; none is configured",
            ],
        ),
        (
            "plugins: [{type: single-profile-handler}, {type: queue-scorer}]\n"
            "schedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer}]}, {name: b}]\n",
            ["schedulingProfiles: single-profile-handler needs exactly one profile, found 2"],
        ),
        (
            "plugins: [{type: single-profile-handler}, {name: other, type: single-profile-handler}]\n",
            ['plugins: only one profile handler may be configured, found "single-profile-handler", "other"'],
        ),
        (
            "plugins: [{type: queue-scorer}]\nsaturationDetector: {pluginRef: queue-scorer}\n",
            ['saturationDetector.pluginRef: plugin "queue-scorer" (type "queue-scorer") is not a saturation detector'],
        ),
        (
            "plugins: [{type: queue-scorer}]\nparser: {pluginRef: vllmgrpc-parser}\n",
            ['parser.pluginRef: no plugin named "vllmgrpc-parser"'],
        ),
        (
            "plugins: [{type: queue-scorer}, {type: metrics-data-source}]\n"
            "dataLayer: {sources: [{pluginRef: queue-scorer, extractors: [{pluginRef: metrics-data-source}]}]}\n",
            [
                'dataLayer.sources[0].pluginRef: plugin "queue-scorer" (type "queue-scorer") is not a data source',
                'dataLayer.sources[0].extractors[0].pluginRef: plugin "metrics-data-source" (type "metrics-data-source") '
                "is not an extractor",
            ],
        ),
        (
            "plugins: [{name: max-score-picker, type: queue-scorer}]\n",
            [
                'plugins[0].name: cannot add the default plugin "max-score-picker": '
                'a plugin of type "queue-scorer" has its name'
            ],
        ),
    ],
)
def test_build_errors_name_their_place(body: str, expected: list[str]) -> None:
    assert errors_of(HEADER + body) == expected


def test_data_layer_engine_errors_come_from_the_data_layer_and_name_the_plugin() -> None:
    (error,) = errors_of(HEADER + "plugins: [{type: core-metrics-extractor, parameters: {defaultEngine: tgi}}]\n")
    assert error.startswith("plugins[0].parameters.defaultEngine") and "tgi" in error


def test_yaml_and_file_errors() -> None:
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse_text("plugins: [unclosed\n")
    with pytest.raises(ConfigError, match="the config is empty"):
        parse_text("")
    with pytest.raises(ConfigError, match="cannot read /nonexistent/config.yaml"):
        parse_file("/nonexistent/config.yaml")


def test_plugin_factory_crash_becomes_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(name: str, parameters: Mapping[str, Any], handle: Handle) -> Any:
        raise KeyError("bug")

    monkeypatch.setitem(REGISTRY.registrations, "test-crash", registry.Registration("test-crash", crash))
    assert errors_of(HEADER + "plugins: [{type: test-crash}]\n") == [
        "plugins[0]: plugin \"test-crash\" failed to start: KeyError: 'bug'"
    ]


def test_cli_validate_and_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(REFERENCE_EXAMPLE)
    assert cli.main(["validate", str(good)]) == 0
    assert capsys.readouterr().out == "valid\n"

    bad = tmp_path / "bad.yaml"
    bad.write_text(HEADER + "plugins: [{type: foo}]\n")
    assert cli.main(["validate", str(bad)]) == 1
    assert capsys.readouterr().err == 'plugins[0].type: unknown plugin type "foo"\n'

    assert cli.main(["show", "--config-file", str(good)]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["parser"] == {"pluginRef": "openai-parser"}

    assert cli.main(["show", "--config-text", HEADER + "plugins: [{type: token-load-scorer}]\n"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["schedulingProfiles"][0]["plugins"][0]["weight"] == 1.0

    assert cli.main(["show"]) == 0
    out = capsys.readouterr().out
    default = yaml.safe_load(out)
    assert default["schedulingProfiles"][0]["plugins"][0] == {"pluginRef": "queue-scorer", "weight": 2.0}
    # The narrowing filter every profile ends with is said, though the profile does not name it.
    assert '# implied: schedulingProfiles "default" ends with a "candidate-narrowing-filter"' in out

    named = "plugins: [{type: queue-scorer}, {type: candidate-narrowing-filter, parameters: {maxCandidates: 0}}]\n"
    assert cli.main(["show", "--config-text", HEADER + named]) == 0
    assert "implied:" not in capsys.readouterr().out


def test_runtime_exposes_the_data_layer_sources_for_the_collector() -> None:
    from picker.config.runtime import RuntimeHolder

    holder = RuntimeHolder()
    (source,) = holder.current.data_sources or ()
    assert (source.source.scheme, source.source.path) == ("http", "/metrics")
    assert source.extractors[0].catalog.default_engine == "vllm"
    holder.load_text(HEADER + "featureGates: [enableLegacyMetrics]\nplugins: [{type: queue-scorer}]\n")
    assert holder.current.data_sources is None
    holder.load_text(HEADER + "plugins: [{type: queue-scorer}]\ndataLayer: {sources: []}\n")
    assert holder.current.data_sources == ()


class CyclicProducer(DataProducer):
    def __init__(self, name: str, produces: str, consumes: str) -> None:
        super().__init__(name)
        self.produces = frozenset({StateKey(produces, bool)})
        self.consumes = frozenset({StateKey(consumes, bool)})

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        cycle_state[next(iter(self.produces))] = True


def test_producers_that_depend_on_each_other_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for plugin_type, produces, consumes in (("test-a", "x", "y"), ("test-b", "y", "x")):
        factory = lambda name, parameters, handle, p=produces, c=consumes: CyclicProducer(name, p, c)  # noqa: E731
        monkeypatch.setitem(REGISTRY.registrations, plugin_type, registry.Registration(plugin_type, factory))
    (error,) = errors_of(HEADER + "plugins: [{type: queue-scorer}, {type: test-a}, {type: test-b}]\n")
    assert error.startswith("plugins: data producers depend on each other in a cycle")
