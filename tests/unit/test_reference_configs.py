"""Every EndpointPickerConfig in the reference EPP v1.5.0's docs and test data (one file each in
tests/data/reference_configs/, naming where it comes from): what the reference accepts, the
picker accepts with the same meaning, as `picker config show` prints it; what the reference
rejects, the picker rejects with an error naming the place. (The reference types the picker
does not have are refused naming the type and why: test_config_reference_rules.py.)

The expected meanings were read from the reference itself: epp v1.5.0 run with `--config-file F
--pool-name x` and a kubeconfig naming an unreachable server logs its "Effective raw
configuration" (or its error) and exits, and that is what each row restates. Not extracted: the
loader unit tests' configs that name types only those tests register (test-plugin, test-scorer,
...), and exact duplicates (the file holding one names both sources). Fragments of a page are
completed with the apiVersion and kind lines only, and say so. Two differences are by design:
the reference always adds its three
default flow-control policies (fcfs-ordering-policy, global-strict-fairness-policy,
static-usage-limit-policy) even with flow control off; the picker, which does not implement flow
control, adds one only where the flowControl section names it. And the reference creates the
approx-prefix-cache-producer of a prefix-cache-scorer without listing it (it logs its
parameters); the picker lists it with its effective parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.config import cli
from picker.config.loader import build, parse_text

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "reference_configs"
SOURCE_LINE = "# Source: gateway-api-inference-extension v1.5.0, "

SYSTEM = ("single-profile-handler", "max-score-picker", "openai-parser", "utilization-detector")
DATA = ("metrics-data-source", "core-metrics-extractor")
PRODUCER = ("approx-prefix-cache-producer",)
DEFAULT_SOURCES = [("metrics-data-source", ["core-metrics-extractor"])]
# The reference's approx-prefix-cache-producer defaults, as it logs them ("Prefix PrepareData initialized").
PRODUCER_DEFAULTS = {
    "autoTune": True,
    "blockSizeTokens": 16,
    "maxPrefixBlocksToMatch": 256,
    "lruCapacityPerServer": 31250,
}
CHART_SCORERS = ("queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer")
CHART_PROFILE = [("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0), ("prefix-cache-scorer", 3.0)]
MAX_SCORE = ("max-score-picker", None)


def named(*entries: str | tuple[str, str]) -> dict[str, str]:
    """Plugin name → type; a bare string is a plugin named after its type."""
    return dict((entry, entry) if isinstance(entry, str) else entry for entry in entries)


@dataclass(frozen=True)
class Accepted:
    """The meaning the reference gives a config it accepts. `plugins` is every plugin of the
    effective config; `parameters` a subset of some plugins' effective parameters; `notes`
    substrings of the notes `config show` prints."""

    plugins: Mapping[str, str]
    profile: Sequence[tuple[str, float | None]]
    parser: str = "openai-parser"
    saturation_detector: str = "utilization-detector"
    data_layer: list[tuple[str, list[str]]] | None = field(default_factory=lambda: DEFAULT_SOURCES)
    feature_gates: Sequence[str] = ()
    flow_control: Mapping[str, Any] | None = None
    parameters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: Sequence[str] = ()


@dataclass(frozen=True)
class Rejected:
    """The reference rejects the config; the picker too, with this error (naming the place)."""

    error: str


FLOW_NOTE = 'flowControl: the section is ignored while the "flowControl" feature gate is off'
FORWARDED = 'its parameters configure the "approx-prefix-cache-producer" added for it'
EXTRACTOR_ENGINES = [
    {
        "name": "vllm",
        "queuedRequestsSpec": "vllm:num_requests_waiting",
        "runningRequestsSpec": "vllm:num_requests_running",
        "kvUsageSpec": "vllm:kv_cache_usage_perc",
        "loraSpec": "vllm:lora_requests_info",
        "cacheInfoSpec": "vllm:cache_config_info",
    },
]


CASES: dict[str, Accepted | Rejected] = {
    "chart-default.yaml": Accepted(
        named(*CHART_SCORERS, *DATA, *SYSTEM, *PRODUCER),
        [*CHART_PROFILE, MAX_SCORE],
        parameters={
            "metrics-data-source": {"scheme": "http", "path": "/metrics", "insecureSkipVerify": True},
            "core-metrics-extractor": {"defaultEngine": "vllm"},
            "approx-prefix-cache-producer": PRODUCER_DEFAULTS,
        },
    ),
    "chart-triton.yaml": Accepted(
        named(*CHART_SCORERS, *DATA, *SYSTEM, *PRODUCER),
        [*CHART_PROFILE, MAX_SCORE],
        parameters={"core-metrics-extractor": {"defaultEngine": "triton-tensorrt-llm"}},
    ),
    "chart-grpc.yaml": Accepted(
        named(*CHART_SCORERS, *DATA, "vllmgrpc-parser", *SYSTEM[:2], SYSTEM[3], *PRODUCER),
        [*CHART_PROFILE, MAX_SCORE],
        parser="vllmgrpc-parser",
    ),
    "chart-latency-predictor.yaml": Accepted(
        named(
            *CHART_SCORERS,
            *DATA,
            "predicted-latency-producer",
            ("strict-affinity-filter", "prefix-cache-affinity-filter"),
            ("loose-affinity-filter", "prefix-cache-affinity-filter"),
            "latency-scorer",
            "weighted-random-picker",
            "slo-headroom-tier-filter",
            "latency-slo-admitter",
            "single-profile-handler",
            "openai-parser",
            "utilization-detector",
            *PRODUCER,
        ),
        [
            ("predicted-latency-producer", None),
            ("strict-affinity-filter", None),
            ("slo-headroom-tier-filter", None),
            ("loose-affinity-filter", None),
            ("latency-scorer", 1.0),
            ("weighted-random-picker", None),
        ],
        parameters={
            "predicted-latency-producer": {
                "samplingMean": 1000.0,
                "maxDecodeTokenSamplesForPrediction": 0,
                "sloBufferFactor": 1.0,
                "streamingMode": False,
                "endpointRoleLabel": "",
                "predictInPrepareData": True,
                "contextTTL": "300s",
            },
            "strict-affinity-filter": {"affinityThreshold": 0.99, "explorationProbability": 0.01},
            "loose-affinity-filter": {"affinityThreshold": 0.8, "maxTTFTPenaltyMs": 5000.0},
            "latency-scorer": {"ttftWeight": 0.8, "tpotWeight": 0.2, "headroomSelectionStrategy": "least"},
            "slo-headroom-tier-filter": {"epsilonExploreNeg": 0.01},
        },
        notes=['"predicted-latency-producer" is not a filter, scorer or picker'],
    ),
    "chart-custom-scorer.yaml": Rejected('plugins[0].type: unknown plugin type "custom-scorer"'),
    "config-text-complete.yaml": Accepted(
        named("prefix-cache-scorer", *SYSTEM, *DATA, *PRODUCER),
        [("prefix-cache-scorer", 50.0), MAX_SCORE],
        parameters={
            "prefix-cache-scorer": {"blockSizeTokens": 5, "maxPrefixBlocksToMatch": 256, "lruCapacityPerServer": 31250},
            "approx-prefix-cache-producer": {**PRODUCER_DEFAULTS, "blockSizeTokens": 5},
        },
        notes=[FORWARDED],
    ),
    "config-text-defaults-applied.yaml": Accepted(
        named("prefix-cache-scorer", *SYSTEM, *DATA, *PRODUCER),
        [("prefix-cache-scorer", 50.0), MAX_SCORE],
        parameters={"approx-prefix-cache-producer": {**PRODUCER_DEFAULTS, "blockSizeTokens": 5}},
        notes=[FORWARDED],
    ),
    "config-text-saturation-detector.yaml": Accepted(
        named(*SYSTEM, *DATA),
        [("utilization-detector", None), MAX_SCORE],  # a filter too: the default profile takes it
        parameters={"utilization-detector": {"queueDepthThreshold": 8, "kvCacheUtilThreshold": 0.8}},
    ),
    "config-text-flow-control.yaml": Accepted(
        named(*SYSTEM, *DATA, "fcfs-ordering-policy", "global-strict-fairness-policy"),
        [MAX_SCORE],
        flow_control={
            "maxBytes": 10 << 30,
            "defaultRequestTTL": "60s",
            "defaultPriorityBand": {"maxBytes": 10 << 30, "maxRequests": 5000},
            "priorityBands": [
                {
                    "priority": 100,
                    "maxBytes": 5 << 30,
                    "maxRequests": 500,
                    "fairnessPolicyRef": "global-strict-fairness-policy",
                    "orderingPolicyRef": "fcfs-ordering-policy",
                }
            ],
        },
        notes=[FLOW_NOTE],
    ),
    "config-text-data-minimal.yaml": Rejected("data: unknown field (did you mean dataLayer?)"),
    "config-text-disable-lora.yaml": Accepted(
        named(*SYSTEM, *DATA),
        [MAX_SCORE],
        parameters={"core-metrics-extractor": {"engineConfigs": [{**EXTRACTOR_ENGINES[0], "loraSpec": ""}]}},
    ),
    "config-text-extractor-parameters.yaml": Accepted(
        named(*SYSTEM, *DATA),
        [MAX_SCORE],
        parameters={
            "core-metrics-extractor": {
                "defaultEngine": "vllm",
                "engineLabelKey": "inference.networking.k8s.io/engine-type",
                "engineConfigs": [
                    *EXTRACTOR_ENGINES,
                    {
                        "name": "sglang",
                        "queuedRequestsSpec": "sglang:num_queue_reqs",
                        "runningRequestsSpec": "sglang:num_running_reqs",
                        "kvUsageSpec": "sglang:token_usage",
                        "loraSpec": "",
                        "cacheInfoSpec": "",
                    },
                ],
            }
        },
    ),
    "config-text-data-source-parameters.yaml": Accepted(
        named(*SYSTEM, *DATA),
        [MAX_SCORE],
        parameters={"metrics-data-source": {"scheme": "http", "path": "/metrics", "insecureSkipVerify": True}},
    ),
    "config-text-feature-gates.yaml": Accepted(
        named(*SYSTEM, *DATA),
        [MAX_SCORE],
        feature_gates=["dataLayer", "flowControl"],
        notes=['"dataLayer" is obsolete'],
    ),
    "vllmgrpc-parser.yaml": Accepted(
        named(("maxScore", "max-score-picker"), ("vllmgrpcParser", "vllmgrpc-parser"), SYSTEM[0], SYSTEM[3], *DATA),
        [("maxScore", None)],
        parser="vllmgrpcParser",
    ),
    "model-servers-default-engine.yaml": Accepted(
        named(*SYSTEM, *DATA),
        [MAX_SCORE],
        feature_gates=["dataLayer"],
        parameters={"core-metrics-extractor": {"defaultEngine": "sglang"}},
    ),
    "model-servers-custom-engine.yaml": Accepted(
        named(*SYSTEM, *DATA),
        [MAX_SCORE],
        feature_gates=["dataLayer"],
        parameters={
            "core-metrics-extractor": {
                "defaultEngine": "vllm",
                "engineConfigs": [
                    *EXTRACTOR_ENGINES,
                    {
                        "name": "sglang",
                        "queuedRequestsSpec": "sglang:num_queue_reqs",
                        "runningRequestsSpec": "sglang:num_running_reqs",
                        "kvUsageSpec": "sglang:token_usage",
                    },
                    {
                        "name": "triton",
                        "queuedRequestsSpec": "nv_trt_llm_request_metrics{request_type=waiting}",
                        "kvUsageSpec": "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}",
                    },
                ],
            }
        },
    ),
    "flow-control-enable.yaml": Rejected("apiVersion: must be one of inference.networking.x-k8s.io/v1alpha1"),
    "flow-control-utilization-detector.yaml": Accepted(
        named(*SYSTEM, *DATA),
        [("utilization-detector", None), MAX_SCORE],
        parameters={"utilization-detector": {"queueDepthThreshold": 2, "kvCacheUtilThreshold": 0.85}},
    ),
    "flow-control-concurrency-detector.yaml": Accepted(
        named("concurrency-detector", "single-profile-handler", "max-score-picker", "openai-parser", *DATA),
        [("concurrency-detector", None), MAX_SCORE],  # a filter too, as in the reference
        saturation_detector="concurrency-detector",
        parameters={"concurrency-detector": {"concurrencyMode": "requests", "maxConcurrency": 110, "headroom": 0.0}},
    ),
    "flow-control-priority-bands.yaml": Accepted(
        named(*SYSTEM, *DATA, "fcfs-ordering-policy", "global-strict-fairness-policy"),
        [MAX_SCORE],
        flow_control={
            "maxBytes": 1_000_000_000,
            "defaultRequestTTL": "30s",
            "priorityBands": [
                {
                    "priority": 100,
                    "maxBytes": 500_000_000,
                    "fairnessPolicyRef": "global-strict-fairness-policy",
                    "orderingPolicyRef": "fcfs-ordering-policy",
                }
            ],
        },
        notes=[FLOW_NOTE],
    ),
    "troubleshooting-prefix-cache.yaml": Accepted(
        named(*CHART_SCORERS, *SYSTEM, *DATA, *PRODUCER),
        [*CHART_PROFILE, MAX_SCORE],
        # blockSize (characters, deprecated) is ignored by the reference's producer: 16-token blocks.
        parameters={"approx-prefix-cache-producer": {**PRODUCER_DEFAULTS, "maxPrefixBlocksToMatch": 512}},
        notes=[FORWARDED],
    ),
    "troubleshooting-latency.yaml": Rejected('featureGates[0]: unknown feature gate "prepareDataPlugins"'),
    "request-attribute-reporter-readme.yaml": Rejected("apiVersion: must be one of"),
    "notification-source-gvk.yaml": Rejected("data: unknown field (did you mean dataLayer?)"),
    "notification-source-endpoint.yaml": Rejected("data: unknown field (did you mean dataLayer?)"),
    "e2e-inferencepool.yaml": Accepted(
        named(*CHART_SCORERS, *SYSTEM, *DATA, *PRODUCER),
        [("queue-scorer", 1.0), ("kv-cache-utilization-scorer", 1.0), ("prefix-cache-scorer", 1.0), MAX_SCORE],
        parameters={"approx-prefix-cache-producer": PRODUCER_DEFAULTS},
    ),
    "configloader-test-types.yaml": Rejected("saturationDetector.metricsStalenessThreshold: unknown field"),
    "integration-default.yaml": Accepted(
        named(*CHART_SCORERS, "lora-affinity-scorer", *SYSTEM, *PRODUCER),
        [
            ("queue-scorer", 1.0),
            ("kv-cache-utilization-scorer", 1.0),
            ("prefix-cache-scorer", 1.0),
            ("lora-affinity-scorer", 1.0),
            MAX_SCORE,
        ],
        data_layer=None,  # enableLegacyMetrics: metrics come the legacy way, from the flags
        feature_gates=["enableLegacyMetrics"],
    ),
    "integration-datalayer.yaml": Rejected('plugins[5].type: unknown plugin type "mock-metrics-source"'),
    "integration-request-attribute-reporter.yaml": Accepted(
        named("openai-parser", ("total-tokens-cost-reporter", "request-attribute-reporter"), *SYSTEM[:2], SYSTEM[3]),
        # Plugins that take no part in scheduling may be named in a profile: the reference keeps them.
        [("openai-parser", None), ("total-tokens-cost-reporter", None), MAX_SCORE],
        data_layer=None,
        feature_gates=["enableLegacyMetrics"],
        parameters={
            "total-tokens-cost-reporter": {
                "attributes": [
                    {
                        "key": {"namespace": "envoy.lb", "name": "x-gateway-inference-request-cost"},
                        "expression": "usage.completion_tokens\n",
                        "condition": "has(usage.completion_tokens)",
                    }
                ]
            }
        },
        notes=['"total-tokens-cost-reporter" is not a filter, scorer or picker'],
    ),
    "integration-passthrough-parser.yaml": Accepted(
        named("queue-scorer", "kv-cache-utilization-scorer", "passthrough-parser", *SYSTEM[:2], "utilization-detector"),
        [("queue-scorer", 1.0), ("kv-cache-utilization-scorer", 1.0), MAX_SCORE],
        parser="passthrough-parser",
        data_layer=None,
        feature_gates=["enableLegacyMetrics"],
    ),
    "integration-vllmgrpc-parser.yaml": Accepted(
        named(*CHART_SCORERS, "lora-affinity-scorer", "vllmgrpc-parser", *SYSTEM[:2], SYSTEM[3], *PRODUCER),
        [
            ("queue-scorer", 1.0),
            ("kv-cache-utilization-scorer", 1.0),
            ("prefix-cache-scorer", 1.0),
            ("lora-affinity-scorer", 1.0),
            MAX_SCORE,
        ],
        parser="vllmgrpc-parser",
        data_layer=None,
        feature_gates=["enableLegacyMetrics"],
    ),
    "loader-max-score-only.yaml": Accepted(
        named(
            ("maxScore", "max-score-picker"), "single-profile-handler", "openai-parser", "utilization-detector", *DATA
        ),
        [("maxScore", None)],
    ),
    "loader-flow-control.yaml": Accepted(
        named(
            ("maxScore", "max-score-picker"), "single-profile-handler", "openai-parser", "utilization-detector", *DATA
        ),
        [("maxScore", None)],
        feature_gates=["flowControl"],
        flow_control={"maxBytes": 1024, "defaultRequestTTL": "1m"},
    ),
    "loader-flow-control-disabled.yaml": Accepted(
        named(
            ("maxScore", "max-score-picker"), "single-profile-handler", "openai-parser", "utilization-detector", *DATA
        ),
        [("maxScore", None)],
        flow_control={"maxBytes": 1024},
    ),
    "loader-flow-control-policies.yaml": Accepted(
        named(
            ("maxScore", "max-score-picker"),
            ("customFCFS", "fcfs-ordering-policy"),
            ("customFairness", "global-strict-fairness-policy"),
            "single-profile-handler",
            "openai-parser",
            "utilization-detector",
            *DATA,
        ),
        [("maxScore", None)],
        feature_gates=["flowControl"],
        flow_control={
            "priorityBands": [
                {"priority": 100, "orderingPolicyRef": "customFCFS", "fairnessPolicyRef": "customFairness"}
            ]
        },
    ),
    "loader-parser.yaml": Accepted(
        named(
            ("maxScore", "max-score-picker"), "openai-parser", "single-profile-handler", "utilization-detector", *DATA
        ),
        [("maxScore", None)],
    ),
    "loader-parser-named.yaml": Accepted(
        named(
            ("maxScore", "max-score-picker"),
            ("openaiParser", "openai-parser"),
            "single-profile-handler",
            "utilization-detector",
            *DATA,
        ),
        [("maxScore", None)],
        parser="openaiParser",
    ),
    "loader-legacy-metrics.yaml": Accepted(
        named(("maxScore", "max-score-picker"), "single-profile-handler", "openai-parser", "utilization-detector"),
        [("maxScore", None)],
        data_layer=None,
        feature_gates=["enableLegacyMetrics"],
    ),
    "loader-data-layer-empty.yaml": Accepted(
        named(("maxScore", "max-score-picker"), "single-profile-handler", "openai-parser", "utilization-detector"),
        [("maxScore", None)],
        data_layer=[],  # an explicit empty section: no metrics collection
    ),
    "loader-two-profile-handlers.yaml": Rejected("plugins: only one profile handler may be configured"),
    "loader-no-profile-handler.yaml": Rejected("plugins: 2 scheduling profiles need a profile handler"),
    "loader-single-handler-two-profiles.yaml": Rejected(
        "schedulingProfiles: single-profile-handler needs exactly one profile, found 2"
    ),
    "loader-missing-policy.yaml": Rejected(
        'flowControl.priorityBands[0].orderingPolicyRef: no plugin named "non-existent-policy"'
    ),
    "loader-parser-wrong-type.yaml": Rejected(
        'parser.pluginRef: plugin "maxScore" (type "max-score-picker") is not a request parser'
    ),
    "loader-parser-wrong-name.yaml": Rejected('parser.pluginRef: no plugin named "wrongParser"'),
    "loader-bad-yaml.yaml": Rejected("plugins[0]: must be a mapping"),
    "loader-plugin-without-type.yaml": Rejected("plugins[0].type: is required"),
}


def test_every_extracted_config_names_its_source_and_has_a_row() -> None:
    files = sorted(path.name for path in CONFIGS.glob("*.yaml"))
    assert files == sorted(CASES)
    for name in files:
        assert (CONFIGS / name).read_text().startswith(SOURCE_LINE), name


def config_show(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["show", "--config-file", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", sorted(n for n, case in CASES.items() if isinstance(case, Accepted)))
def test_accepted_with_the_reference_meaning(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    expected = CASES[name]
    assert isinstance(expected, Accepted)
    code, shown, errors = config_show(CONFIGS / name, capsys)
    assert code == 0, errors
    document = yaml.safe_load(shown)
    assert {p["name"]: p["type"] for p in document["plugins"]} == dict(expected.plugins)
    (profile,) = document["schedulingProfiles"]
    assert profile["name"] == "default"
    assert [(r["pluginRef"], r.get("weight")) for r in profile["plugins"]] == list(expected.profile)
    assert document["parser"] == {"pluginRef": expected.parser}
    assert document["saturationDetector"] == {"pluginRef": expected.saturation_detector}
    sources = document.get("dataLayer", {}).get("sources") if "dataLayer" in document else None
    if expected.data_layer is None:
        assert sources is None
    else:
        assert [(s["pluginRef"], [e["pluginRef"] for e in s["extractors"]]) for s in sources] == expected.data_layer
    assert document.get("featureGates", []) == list(expected.feature_gates)
    assert document.get("flowControl") == expected.flow_control
    parameters = {p["name"]: p.get("parameters", {}) for p in document["plugins"]}
    for plugin, subset in expected.parameters.items():
        assert {key: parameters[plugin].get(key) for key in subset} == dict(subset), plugin
    notes = [line.removeprefix("# note: ") for line in shown.splitlines() if line.startswith("# note: ")]
    for note in expected.notes:
        assert any(note in line for line in notes), (note, notes)
    # What `show` prints is itself a config, with the same meaning.
    assert build(parse_text(shown)).config == build(parse_text((CONFIGS / name).read_text())).config


@pytest.mark.parametrize("name", sorted(n for n, case in CASES.items() if not isinstance(case, Accepted)))
def test_rejected_naming_the_place(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    expected = CASES[name]
    assert isinstance(expected, Rejected)
    code, shown, errors = config_show(CONFIGS / name, capsys)
    assert code == 1 and shown == ""
    assert any(line.startswith(expected.error) for line in errors.splitlines()), errors
