"""llm-d's label filters and P/D / data-parallel handlers: their parameters as llm-d validates
them and their behaviour on labelled endpoints (the configs that use them route in
test_llmd_configs.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
import yaml

from picker.config.loader import build, parse_text
from picker.config.schema import ConfigError
from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.plugin import Filter, PreRequest, ProfileRunResult, SchedulingResult, Scorer
from picker.framework.request import Api, InferenceRequest, ResponseOutcome
from picker.prefix.plugins import PREFIX_MATCH_KEY, PrefixMatch
from picker.prefix.prompt_blocks import PromptBlocks
from picker.scheduling.active_requests import ActiveRequestScorer
from picker.scheduling.labels import ROLE_LABEL
from tests.unit.test_llmd_configs import director


def state(name: str, **labels: str) -> EndpointState:
    return EndpointState(Endpoint(f"10.0.0.{len(name)}", 8000, name, labels=labels), EndpointMetrics())


ROLES = [
    state("p", **{ROLE_LABEL: "prefill"}),
    state("dd", **{ROLE_LABEL: "decode"}),
    state("bbb", **{ROLE_LABEL: "both"}),
    state("nnnn"),
    state("ooooo", **{ROLE_LABEL: "other"}),
]
REQUEST = InferenceRequest("r", Api.COMPLETIONS, "m", "m", prompt_text="hi")


def plugin_config(plugin_type: str, parameters: Mapping[str, Any] | None = None) -> str:
    plugin: dict[str, Any] = {"type": plugin_type, "name": "under-test"}
    if parameters is not None:
        plugin["parameters"] = parameters
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [plugin],
        }
    )


def kept(plugin_type: str, parameters: Mapping[str, Any] | None = None) -> list[str]:
    plugin = build(parse_text(plugin_config(plugin_type, parameters))).plugins["under-test"]
    assert isinstance(plugin, Filter)
    return [c.endpoint.name for c in plugin.filter(REQUEST, CycleState(), ROLES)]


def refusal(plugin_type: str, parameters: Mapping[str, Any]) -> str:
    with pytest.raises(ConfigError) as error:
        build(parse_text(plugin_config(plugin_type, parameters)))
    return str(error.value)


def test_prefill_filter_keeps_prefill_pods_only() -> None:
    assert kept("prefill-filter") == ["p"]


def test_decode_filter_keeps_decode_both_and_unlabelled_pods() -> None:
    assert kept("decode-filter") == ["dd", "bbb", "nnnn"]


def test_by_label_keeps_valid_values_and_optionally_unlabelled() -> None:
    assert kept("by-label", {"label": ROLE_LABEL, "validValues": ["other", "prefill"]}) == ["p", "ooooo"]
    assert kept("by-label", {"label": ROLE_LABEL, "allowsNoLabel": True}) == ["nnnn"]


@pytest.mark.parametrize(
    ("parameters", "error"),
    [
        ({"validValues": ["a"]}, "label: must be specified"),
        ({"label": "x"}, "validValues: must be non-empty unless allowsNoLabel is true"),
        ({"label": "x", "allowsNoLabel": "yes"}, "allowsNoLabel: must be true or false"),
        ({"label": "x", "validValue": ["a"]}, "validValue: unknown parameter"),
    ],
)
def test_by_label_parameters(parameters: Mapping[str, Any], error: str) -> None:
    assert error in refusal("by-label", parameters)


def test_by_label_selector_matches_labels_and_expressions() -> None:
    assert kept("by-label-selector", {"matchLabels": {ROLE_LABEL: "decode"}}) == ["dd"]
    expression = {"key": ROLE_LABEL, "operator": "NotIn", "values": ["prefill", "other"]}
    assert kept("by-label-selector", {"matchExpressions": [expression]}) == ["dd", "bbb", "nnnn"]
    assert kept("by-label-selector", {"matchExpressions": [{"key": ROLE_LABEL, "operator": "DoesNotExist"}]}) == [
        "nnnn"
    ]
    assert kept("by-label-selector", {}) == ["p", "dd", "bbb", "nnnn", "ooooo"]


@pytest.mark.parametrize(
    ("parameters", "error"),
    [
        ({"matchExpressions": [{"key": "k", "operator": "Is"}]}, "matchExpressions[0].operator: must be one of"),
        ({"matchExpressions": [{"key": "k", "operator": "In"}]}, "matchExpressions[0].values: must be non-empty"),
        ({"matchExpressions": [{"key": "k", "operator": "Exists", "values": ["a"]}]}, "must be empty"),
        ({"matchLabels": {"k": 1}}, "matchLabels.k: must be a string"),
    ],
)
def test_by_label_selector_parameters(parameters: Mapping[str, Any], error: str) -> None:
    assert error in refusal("by-label-selector", parameters)


@pytest.mark.parametrize(
    ("plugin_type", "parameters", "error"),
    [
        ("pd-profile-handler", {"threshold": -1}, "threshold: must be >= 0"),
        ("pd-profile-handler", {"hashBlockSize": 0}, "hashBlockSize: must be >= 1"),
        ("pd-profile-handler", {"primaryPort": 70000}, "primaryPort: must be between 1 and 65535"),
        ("data-parallel-profile-handler", {"primaryPort": 0}, "primaryPort: must be between 1 and 65535"),
        ("prefill-header-handler", {"prefillProfile": 3}, "prefillProfile: must be a string"),
    ],
)
def test_handler_parameters(plugin_type: str, parameters: Mapping[str, Any], error: str) -> None:
    assert error in refusal(plugin_type, parameters)


def test_pd_profile_handler_defaults_are_llmds() -> None:
    plugin = build(parse_text(plugin_config("pd-profile-handler"))).plugins["under-test"]
    assert dict(plugin.parameters) == {
        "threshold": 0,
        "decodeProfile": "decode",
        "prefillProfile": "prefill",
        "prefixPluginName": "prefix-cache-scorer",
        "hashBlockSize": 64,
        "primaryPort": 0,
    }


def test_load_aware_scorer_halves_an_empty_queue_and_reaches_zero_at_the_threshold() -> None:
    config = plugin_config("load-aware-scorer", {"threshold": 10})
    plugin = build(parse_text(config)).plugins["under-test"]
    assert isinstance(plugin, Scorer)
    queues = [
        EndpointState(Endpoint(f"10.0.0.{q}", 8000), EndpointMetrics(waiting_queue_size=q)) for q in (0, 5, 10, 20)
    ]
    assert list(plugin.score(REQUEST, CycleState(), queues)) == [0.5, 0.25, 0.0, 0.0]
    # llm-d takes a threshold <= 0 as its default, 128.
    default = build(parse_text(plugin_config("load-aware-scorer", {"threshold": 0}))).plugins["under-test"]
    assert isinstance(default, Scorer)
    assert list(default.score(REQUEST, CycleState(), queues[:1] + [queues[3]])) == [0.5, 0.5 * (1 - 20 / 128)]


def routed(request_id: str, **picks: EndpointState) -> tuple[InferenceRequest, SchedulingResult]:
    """A request and its result, picking `picks[profile]` in each profile."""
    request = InferenceRequest(request_id, Api.COMPLETIONS, "m", "m", prompt_text="hi")
    runs = {profile: ProfileRunResult((target,)) for profile, target in picks.items()}
    return request, SchedulingResult(runs, next(iter(picks)))


def test_active_request_scorer_prefers_pods_with_fewer_requests_it_sent_and_saw_not_end() -> None:
    scorer = build(parse_text(plugin_config("active-request-scorer"))).plugins["under-test"]
    assert isinstance(scorer, ActiveRequestScorer) and scorer.request_timeout_s == 120.0  # llm-d's 2m
    a, b, c = state("a"), state("bb"), state("ccc")
    assert scorer.score(REQUEST, CycleState(), [a, b, c]) == [1.0, 1.0, 1.0]
    sent = [routed("r1", default=a), routed("r2", default=a), routed("r3", default=b)]
    for request, result in sent:
        scorer.pre_request(request, result)
    # (most - count) / most, the most of any pod: a 2, b 1, c none.
    assert scorer.score(REQUEST, CycleState(), [a, b, c]) == [0.0, 0.5, 1.0]
    assert scorer.score(REQUEST, CycleState(), [b, c]) == [0.5, 1.0]  # a's count still sets the most
    request, result = sent[0]
    scorer.response_complete(request, result, ResponseOutcome(a.address, 200))
    assert scorer.score(REQUEST, CycleState(), [a, b, c]) == [0.0, 0.0, 1.0]
    # A request id seen again counts once; its end is counted once.
    scorer.pre_request(*sent[2])
    scorer.response_complete(sent[2][0], sent[2][1], ResponseOutcome(b.address, 200))
    scorer.response_complete(sent[2][0], sent[2][1], ResponseOutcome(b.address, 200))
    assert (scorer.active(a.address), scorer.active(b.address)) == (1, 0)


def test_active_request_scorer_counts_a_pd_request_at_both_picks_until_it_ends() -> None:
    scorer = ActiveRequestScorer("active")
    prefill, decode = state("p", **{ROLE_LABEL: "prefill"}), state("dd", **{ROLE_LABEL: "decode"})
    request, result = routed("pd", decode=decode, prefill=prefill)
    scorer.pre_request(request, result)
    assert (scorer.active(prefill.address), scorer.active(decode.address)) == (1, 1)
    scorer.response_complete(request, result, ResponseOutcome(decode.address, 200))
    assert (scorer.active(prefill.address), scorer.active(decode.address)) == (0, 0)


def test_active_request_scorer_stops_counting_a_request_whose_end_is_not_seen_after_the_timeout() -> None:
    now = [100.0]
    scorer = ActiveRequestScorer("active", request_timeout_s=30.0, clock=lambda: now[0])
    a, b = state("a"), state("bb")
    scorer.pre_request(*routed("old", default=a))
    now[0] = 120.0
    scorer.pre_request(*routed("new", default=b))
    assert scorer.score(REQUEST, CycleState(), [a, b]) == [0.0, 0.0]
    now[0] = 130.0  # "old" has counted 30 s
    assert scorer.score(REQUEST, CycleState(), [a, b]) == [1.0, 0.0]
    now[0] = 150.0
    assert scorer.score(REQUEST, CycleState(), [a, b]) == [1.0, 1.0]


def test_active_request_scorer_parameters() -> None:
    config = plugin_config("active-request-scorer", {"requestTimeout": "30s"})
    loaded = build(parse_text(config))
    scorer = loaded.plugins["under-test"]
    assert isinstance(scorer, ActiveRequestScorer) and scorer.request_timeout_s == 30.0
    assert loaded.config.plugins[0].parameters == {"requestTimeout": "30s"}
    assert refusal("active-request-scorer", {"requestTimeout": "0s"}) == (
        "plugins[0].parameters.requestTimeout: must be positive, got '0s'"
    )
    assert "requestTimeout" in refusal("active-request-scorer", {"requestTimeout": "soon"})
    assert refusal("active-request-scorer", {"requestTimeout": 30}) == (
        'plugins[0].parameters.requestTimeout: must be a duration such as "2m", got 30'
    )
    assert refusal("active-request-scorer", {"timeout": "1m"}) == "plugins[0].parameters.timeout: unknown parameter"


def no_hit_lru_scores(scorer: Scorer, candidates: list[EndpointState], cold: bool) -> list[float]:
    """Score a request (cold: nothing cached anywhere), then route it to the best candidate."""
    cycle_state = CycleState()
    if not cold:
        blocks = PromptBlocks("chars", (1,), 16, 16, 0)
        cycle_state[PREFIX_MATCH_KEY] = PrefixMatch(blocks, {candidates[0].address: 1})
    scores = list(scorer.score(REQUEST, cycle_state, candidates))
    best = candidates[scores.index(max(scores))]
    assert isinstance(scorer, PreRequest)
    scorer.pre_request(REQUEST, SchedulingResult({"p": ProfileRunResult((best,))}, "p", cycle_state))
    return scores


def test_no_hit_lru_scorer_sends_cold_requests_to_the_least_recently_used() -> None:
    scorer = build(parse_text(plugin_config("no-hit-lru-scorer", {"lruSize": 8}))).plugins["under-test"]
    assert isinstance(scorer, Scorer)
    pods = [state("a"), state("bb"), state("ccc")]
    assert no_hit_lru_scores(scorer, pods, cold=True) == [1.0, 0.5, 0.0]  # none used yet: in order
    assert no_hit_lru_scores(scorer, pods, cold=True) == [0.0, 1.0, 0.5]  # "a" is now the most recent
    assert no_hit_lru_scores(scorer, pods, cold=False) == [0.5, 0.5, 0.5]  # a prefix hit: neutral
    assert no_hit_lru_scores(scorer, pods, cold=True) == [0.5, 0.0, 1.0]  # the hit did not count


async def test_active_request_scorer_follows_requests_through_the_director() -> None:
    """Wired as a picker runs it: the director's pick counts a request at its endpoint until the
    response ends, so a second request in flight goes to the other endpoint."""
    config = plugin_config("active-request-scorer").replace(
        "plugins:", "schedulingProfiles:\n- name: default\n  plugins: [{pluginRef: under-test}]\nplugins:"
    )
    d = director(config, [Endpoint("10.0.5.1", 8000), Endpoint("10.0.5.2", 8000)])
    scorer = d.runtimes.current.plugins["under-test"]
    assert isinstance(scorer, ActiveRequestScorer)
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8}).encode()
    first = await d.route(body, {":path": "/v1/completions"}, None)
    second = await d.route(body, {":path": "/v1/completions"}, None)
    assert {first.targets[0], second.targets[0]} == {"10.0.5.1:8000", "10.0.5.2:8000"}
    assert scorer.active(first.targets[0]) == 1
    first.finish()
    second.finish()
    assert scorer.active(first.targets[0]) == scorer.active(second.targets[0]) == 0
