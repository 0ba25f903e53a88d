"""The reference's config rules the picker follows beyond its shipped examples (the examples
themselves: test_reference_configs.py), and the reference plugin types added for them."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from picker.config import cli
from picker.config.loader import build, parse_text, to_yaml
from picker.config.quantity import parse_quantity
from picker.config.runtime import RuntimeHolder
from picker.config.schema import ConfigError
from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.plugins import REGISTRY, UNSUPPORTED_REFERENCE_TYPES
from picker.request.passthrough import PassthroughParser
from picker.requestcontrol.director import Director
from picker.scheduling.concurrency import ConcurrencyDetector
from tests.unit.test_scheduling_plugins import request, state

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def loaded(body: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    result = build(parse_text(HEADER + body))
    return yaml.safe_load(to_yaml(result.config)), result.notes


def errors_of(body: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        build(parse_text(HEADER + body))
    return caught.value.errors


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("10Gi", 10 << 30), ("500M", 500_000_000), ("1k", 1000), ("1e3", 1000), ("1.5Ki", 1536)],
)
def test_quantities_read_as_apimachinery_does(text: str, value: int) -> None:
    assert parse_quantity(text) == value


def test_flow_control_limits_take_quantities_and_reject_garbage() -> None:
    document, _ = loaded(
        "flowControl: {maxBytes: 1Gi, maxRequests: 2k, priorityBands: [{priority: 1, maxBytes: '5'}]}\n"
    )
    assert document["flowControl"]["maxBytes"] == 1 << 30 and document["flowControl"]["maxRequests"] == 2000
    assert document["flowControl"]["priorityBands"][0]["maxBytes"] == 5
    assert errors_of("flowControl: {maxBytes: lots}\n") == [
        'flowControl.maxBytes: must be a quantity such as "10Gi", "500M" or "1024", got "lots"'
    ]


def test_prefix_scorer_parameters_configure_the_producer_added_for_it_else_are_noted_unused() -> None:
    document, notes = loaded(
        "plugins: [{type: prefix-cache-scorer, parameters: {blockSizeTokens: 8}},"
        " {name: second, type: prefix-cache-scorer, parameters: {blockSizeTokens: 32}}]\n"
    )
    producer = next(p for p in document["plugins"] if p["type"] == "approx-prefix-cache-producer")
    assert producer["parameters"]["blockSizeTokens"] == 32  # the last scorer's, as the reference does
    assert [n.split(":")[0] for n in notes] == ['plugins[1] "second"', 'plugins[0] "prefix-cache-scorer"']
    assert "are not used" in notes[1]

    document, notes = loaded(
        "plugins: [{type: approx-prefix-cache-producer}, {type: prefix-cache-scorer, parameters: {blockSizeTokens: 8}}]\n"
    )
    producer = next(p for p in document["plugins"] if p["type"] == "approx-prefix-cache-producer")
    assert producer["parameters"]["blockSizeTokens"] == 16  # the configured producer's own
    assert len(notes) == 1 and "are not used" in notes[0]
    assert errors_of("plugins: [{type: prefix-cache-scorer, parameters: {blockSizeToken: 8}}]\n") == [
        "plugins[0].parameters.blockSizeToken: unknown parameter"
    ]


def test_defaults_are_found_by_name_and_a_profile_without_picker_takes_the_first_picker() -> None:
    document, _ = loaded(
        "plugins: [{name: mine, type: utilization-detector, parameters: {queueDepthThreshold: 9}},"
        " {type: queue-scorer}, {name: lucky, type: random-picker}]\n"
        "schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer}]}]\n"
        "saturationDetector: {}\n"  # an empty pluginRef means utilization-detector, by name
    )
    names = [p["name"] for p in document["plugins"]]
    assert "utilization-detector" in names and document["saturationDetector"] == {"pluginRef": "utilization-detector"}
    assert document["schedulingProfiles"][0]["plugins"][-1] == {"pluginRef": "lucky"}
    assert "max-score-picker" not in names


def test_plugins_outside_scheduling_may_sit_in_a_profile_with_a_note() -> None:
    document, notes = loaded(
        "plugins: [{type: queue-scorer}, {type: openai-parser}]\n"
        "schedulingProfiles: [{name: a, plugins: [{pluginRef: openai-parser}, {pluginRef: queue-scorer}]}]\n"
    )
    assert document["schedulingProfiles"][0]["plugins"][0] == {"pluginRef": "openai-parser"}
    assert notes == (
        'schedulingProfiles[0].plugins[0].pluginRef: "openai-parser" is not a filter, scorer or picker: '
        "it takes no part in scheduling (as in the reference)",
    )


def test_flow_control_names_the_default_policies_without_declaring_them_but_not_other_kinds() -> None:
    document, _ = loaded(
        "flowControl: {usageLimitPolicyPluginRef: static-usage-limit-policy,"
        " priorityBands: [{priority: 1, orderingPolicyRef: fcfs-ordering-policy}]}\n"
    )
    assert {"static-usage-limit-policy", "fcfs-ordering-policy"} <= {p["name"] for p in document["plugins"]}
    assert errors_of(
        "plugins: [{type: queue-scorer}]\nflowControl: {priorityBands: [{priority: 1, orderingPolicyRef: queue-scorer}]}\n"
    ) == [
        'flowControl.priorityBands[0].orderingPolicyRef: plugin "queue-scorer" (type "queue-scorer") '
        "is not an ordering policy"
    ]
    document, _ = loaded("plugins: [{type: static-usage-limit-policy, parameters: {threshold: 0.5}}]\n")
    assert document["plugins"][0]["parameters"] == {"threshold": 0.5}


def test_null_sections_mean_absent() -> None:
    document, _ = loaded("plugins: [{type: queue-scorer}]\ndataLayer: null\nflowControl: null\n")
    assert document["dataLayer"]["sources"][0]["pluginRef"] == "metrics-data-source"  # the default data layer
    assert "flowControl" not in document


def test_every_reference_type_is_known_or_refused_with_its_reason() -> None:
    reference_types = {  # cmd/epp/runner/runner.go registerInTreePlugins, v1.5.0
        "prefix-cache-scorer", "max-score-picker", "random-picker", "weighted-random-picker",
        "single-profile-handler", "kv-cache-utilization-scorer", "queue-scorer",
        "running-requests-size-scorer", "lora-affinity-scorer", "token-load-scorer",
        "global-strict-fairness-policy", "round-robin-fairness-policy", "fcfs-ordering-policy",
        "edf-ordering-policy", "slo-deadline-ordering-policy", "static-usage-limit-policy",
        "approx-prefix-cache-producer", "predicted-latency-scorer", "predicted-latency-producer",
        "latency-slo-admitter", "prefix-cache-affinity-filter", "slo-headroom-tier-filter",
        "latency-scorer", "inflight-load-producer", "header-based-testing-filter",
        "destination-endpoint-served-verifier", "metrics-data-source", "core-metrics-extractor",
        "k8s-notification-source", "endpoint-notification-source", "request-attribute-reporter",
        "openai-parser", "vllmgrpc-parser", "passthrough-parser", "concurrency-detector",
        "utilization-detector",
    }  # fmt: skip
    for plugin_type in reference_types:
        assert (REGISTRY.lookup(plugin_type) is None) == (plugin_type in UNSUPPORTED_REFERENCE_TYPES), plugin_type
    assert set(UNSUPPORTED_REFERENCE_TYPES) <= reference_types
    assert errors_of("plugins: [{type: queue-scorer}, {name: x, type: predicted-latency-scorer}]\n") == [
        'plugins[1].type: the picker does not support the reference type "predicted-latency-scorer": '
        + UNSUPPORTED_REFERENCE_TYPES["predicted-latency-scorer"]
    ]


def test_concurrency_detector_counts_in_flight_requests_or_tokens() -> None:
    detector = ConcurrencyDetector.create("c", {"maxConcurrency": 4, "headroom": 0.5}, Handle())
    busy, idle = state(1, in_flight=6), state(2, in_flight=1)
    assert detector.saturation([busy, idle]) == pytest.approx(7 / 8)
    assert detector.saturation([]) == 1.0
    assert [c.address for c in detector.filter(request(), CycleState(), [busy, idle])] == [idle.address]  # limit 6
    tokens = ConcurrencyDetector.create("t", {"concurrencyMode": "tokens", "maxTokenConcurrency": 100}, Handle())
    assert tokens.saturation([state(1, tokens=150), state(2, tokens=50)]) == 1.0
    assert tokens.filter(request(), CycleState(), [state(1, tokens=150)]) == []  # none left: the profile fails
    with pytest.raises(Exception, match="concurrencyMode: must be one of requests, tokens"):
        ConcurrencyDetector.create("c", {"concurrencyMode": "bytes"}, Handle())


async def test_a_passthrough_request_is_routed_with_its_body_unchanged() -> None:
    store = Datastore()
    store.set_endpoints([Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)])
    holder = RuntimeHolder(store)
    holder.load_text(
        HEADER + "plugins: [{type: queue-scorer}, {type: prefix-cache-scorer}, {type: passthrough-parser}]\n"
        "parser: {pluginRef: passthrough-parser}\n"
    )
    body = b"\x08\x96\x01 a protobuf, not JSON"
    routed = await Director(store, holder).route(
        body, {":path": "/generate", "x-gateway-model-name-rewrite": "x"}, None
    )
    assert routed.targets[0] in {"10.0.0.1:8000", "10.0.0.2:8000"} and routed.body == body
    routed.finish()


def test_passthrough_parser_reads_nothing_from_the_body() -> None:
    parser = PassthroughParser.create("p", {}, Handle())
    parsed = parser.parse(
        b"\x00not json",
        {":path": "/v1/chat/completions", "x-gateway-inference-objective": "batch", "x-tenant": "t1"},
        "id-1",
        "X-Tenant",
    )
    assert (parsed.model, parsed.target_model, parsed.objective, parsed.tenant) == ("", "", "batch", "t1")
    assert parsed.prompt_chars() == 0 and parsed.size_bytes == 9


def test_config_show_prints_notes_as_comments_and_validate_passes_them_on(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(HEADER + "featureGates: [dataLayer]\nplugins: [{type: queue-scorer}]\n")
    assert cli.main(["validate", str(path)]) == 0
    assert capsys.readouterr().out == (
        '# note: featureGates: "dataLayer" is obsolete: the data layer is always on (as in the reference)\nvalid\n'
    )
    assert cli.main(["show", "--config-file", str(path)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("# note: featureGates") and yaml.safe_load(shown)["featureGates"] == ["dataLayer"]
