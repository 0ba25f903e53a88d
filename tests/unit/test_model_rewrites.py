"""InferenceModelRewrite: the merged rules' precedence (the reference's, from its own director and
datastore tests' cases), the weighted split, and the director applying a rewrite before
scheduling (forwarded body, scorers, the rewrite header, metrics)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from typing import Any

import pytest
from prometheus_client import REGISTRY

from picker.config.model_rewrites import ModelRewrites, RewriteRule, RewriteTarget
from picker.config.runtime import RuntimeHolder
from picker.datastore.endpoint import Endpoint, EndpointMetrics
from picker.datastore.store import Datastore
from picker.discovery.kube_objects import pool_model_rewrites
from picker.request.openai import MODEL_REWRITE_HEADER, parse_request
from picker.requestcontrol.director import Director

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
DECISIONS = "inference_extension_model_rewrite_decisions_total"


def target(model: str, weight: int | None = None) -> dict[str, Any]:
    return {"modelRewrite": model} if weight is None else {"modelRewrite": model, "weight": weight}


def rule(*targets: dict[str, Any], models: tuple[str, ...] = ()) -> dict[str, Any]:
    body: dict[str, Any] = {"targets": list(targets)}
    if models:
        body["matches"] = [{"model": {"type": "Exact", "value": m}} for m in models]
    return body


def rewrite(name: str, created: str, *rules: dict[str, Any], pool: str = "pool") -> dict[str, Any]:
    """An InferenceModelRewrite as the API server returns it (`created`: its creationTimestamp)."""
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": {"poolRef": {"group": "inference.networking.k8s.io", "name": pool}, "rules": list(rules)},
    }


def chosen(rewrites: ModelRewrites, model: str, request_id: str = "r1") -> str | None:
    found = rewrites.rule_for(model)
    return None if found is None else found.choose(request_id)


# -- precedence ------------------------------------------------------------------------------

OLD = rewrite("rewrite-old", "2026-01-01T00:16:40Z", rule(target("model-a-old-tuned", 100), models=("model-a",)))
NEW = rewrite("rewrite-new", "2026-01-01T00:33:20Z", rule(target("model-a-new-tuned", 100), models=("model-a",)))
B = rewrite("rewrite-b", "2026-01-01T00:25:00Z", rule(target("model-b-tuned", 100), models=("model-b",)))


@pytest.mark.parametrize(
    "resources, model, expected",
    [
        ([], "model-x", None),
        ([B], "model-b", "model-b-tuned"),
        ([B], "model-x", None),
        ([NEW, OLD], "model-a", "model-a-old-tuned"),  # the oldest resource wins, whatever the order
        ([OLD, NEW], "model-a", "model-a-old-tuned"),
    ],
)
def test_the_reference_directors_cases(resources: list[dict[str, Any]], model: str, expected: str | None) -> None:
    assert chosen(ModelRewrites.of(resources), model) == expected


def test_an_exact_match_beats_an_older_generic_rule() -> None:
    generic = rewrite("catch-all", "2026-01-01T00:00:00Z", rule(target("fallback")))
    exact = rewrite("exact", "2026-06-01T00:00:00Z", rule(target("chat-v2"), models=("chat",)))
    rewrites = ModelRewrites.of([generic, exact])
    assert chosen(rewrites, "chat") == "chat-v2"
    assert chosen(rewrites, "anything-else") == "fallback"


def test_the_oldest_generic_rule_and_the_first_matching_rule_of_a_resource_win() -> None:
    first = rewrite(
        "first",
        "2026-01-01T00:00:00Z",
        rule(target("one-a"), models=("a", "b")),
        rule(target("one-b"), models=("b",)),
        rule(target("one-generic")),
        rule(target("one-second-generic")),
    )
    later = rewrite(
        "later", "2026-01-02T00:00:00Z", rule(target("later-generic")), rule(target("later-c"), models=("c",))
    )
    rewrites = ModelRewrites.of([later, first])
    assert [chosen(rewrites, m) for m in ("a", "b", "c", "z")] == ["one-a", "one-a", "later-c", "one-generic"]


def test_resources_created_in_the_same_second_are_ordered_by_name() -> None:
    stamp = "2026-01-01T00:00:00Z"
    zeta = rewrite("zeta", stamp, rule(target("from-zeta"), models=("m",)))
    alpha = rewrite("alpha", stamp, rule(target("from-alpha"), models=("m",)))
    assert chosen(ModelRewrites.of([zeta, alpha]), "m") == "from-alpha"


def test_a_rule_without_targets_matches_but_keeps_the_model() -> None:
    """It shadows a generic rule for its models, and forwards the model as requested (the
    reference would forward an empty model name, which every model server rejects)."""
    rewrites = ModelRewrites.of(
        [rewrite("r", "2026-01-01T00:00:00Z", {"matches": [{"model": {"value": "keep"}}]}, rule(target("x")))]
    )
    assert chosen(rewrites, "keep") is None
    assert chosen(rewrites, "other") == "x"


def test_a_malformed_rule_is_skipped_and_the_rest_kept() -> None:
    bad_match = {"matches": [{"model": {"value": "m", "type": "RegularExpression"}}], "targets": [target("no")]}
    bad_target = {"matches": [{"model": {"value": "m"}}], "targets": [{"weight": 5}]}
    rewrites = ModelRewrites.of(
        [rewrite("r", "2026-01-01T00:00:00Z", bad_match, bad_target, rule(target("yes"), models=("m",)))]
    )
    assert chosen(rewrites, "m") == "yes"


def test_only_this_pools_rewrites_by_name_and_group() -> None:
    mine = rewrite("mine", "2026-01-01T00:00:00Z", rule(target("x")))
    defaulted = rewrite("defaulted", "2026-01-01T00:00:00Z", rule(target("x")))
    del defaulted["spec"]["poolRef"]["group"]
    other_pool = rewrite("other-pool", "2026-01-01T00:00:00Z", rule(target("x")), pool="elsewhere")
    legacy = rewrite("legacy", "2026-01-01T00:00:00Z", rule(target("x")))
    legacy["spec"]["poolRef"]["group"] = "inference.networking.x-k8s.io"
    everything = [mine, defaulted, other_pool, legacy]
    names = [r["metadata"]["name"] for r in pool_model_rewrites(everything, "pool", "inference.networking.k8s.io")]
    assert names == ["defaulted", "mine"]
    legacy_names = pool_model_rewrites(everything, "pool", "inference.networking.x-k8s.io")
    assert [r["metadata"]["name"] for r in legacy_names] == ["legacy"]


# -- the weighted split ----------------------------------------------------------------------


def within_four_sigma(count: int, n: int, share: float) -> bool:
    return abs(count - n * share) <= 4 * math.sqrt(n * share * (1 - share))


def test_the_split_follows_the_weights_and_is_the_same_for_the_same_request_id() -> None:
    split = RewriteRule("canary", (RewriteTarget("chat-v1", 90), RewriteTarget("chat-v2", 10)))
    n = 10_000
    picks = Counter(split.choose(f"req-{i}") for i in range(n))
    assert set(picks) == {"chat-v1", "chat-v2"}
    assert within_four_sigma(picks["chat-v2"], n, 0.1), picks
    assert all(split.choose(f"req-{i}") == split.choose(f"req-{i}") for i in range(200))  # a retry lands alike


def test_without_weights_the_split_is_even_and_a_weightless_target_among_weighted_ones_gets_nothing() -> None:
    even = RewriteRule("even", (RewriteTarget("a"), RewriteTarget("b"), RewriteTarget("c")))
    n = 9_000
    picks = Counter(even.choose(str(i)) for i in range(n))
    assert all(within_four_sigma(picks[m], n, 1 / 3) for m in "abc"), picks
    mixed = RewriteRule("mixed", (RewriteTarget("a", 0), RewriteTarget("b", 7)))
    assert {mixed.choose(str(i)) for i in range(500)} == {"b"}


# -- in the director -------------------------------------------------------------------------


def director_with(resources: list[dict[str, Any]], *endpoints: tuple[Endpoint, EndpointMetrics]) -> Director:
    datastore = Datastore()
    datastore.set_endpoints([e for e, _ in endpoints])
    for endpoint, metrics in endpoints:
        datastore.set_metrics(endpoint.address, metrics)
    runtimes = RuntimeHolder(datastore)
    runtimes.load_text(HEADER + "plugins: [{type: lora-affinity-scorer}]\n")
    runtimes.set_model_rewrites(resources)
    return Director(datastore, runtimes)


async def test_the_rewritten_model_is_forwarded_scored_on_and_counted() -> None:
    """The LoRA-affinity scorer sees the target (only the second pod runs it), the body forwarded
    names it, everything else in the body is as sent, and the decision is counted."""
    rest = EndpointMetrics(active_models=frozenset({"other"}), max_active_models=1)
    holder = EndpointMetrics(active_models=frozenset({"chat-v2"}), max_active_models=1)
    director = director_with(
        [rewrite("canary", "2026-01-01T00:00:00Z", rule(target("chat-v2"), models=("chat",)))],
        (Endpoint("10.0.0.1", 8000), rest),
        (Endpoint("10.0.0.2", 8000), holder),
    )
    labels = {"model_rewrite_name": "canary", "model_name": "chat", "target_model": "chat-v2"}
    before = REGISTRY.get_sample_value(DECISIONS, labels) or 0.0
    sent = {"model": "chat", "prompt": "hello", "max_tokens": 3}
    for i in range(5):
        routed = await director.route(
            json.dumps(sent).encode(), {":path": "/v1/completions", "x-request-id": f"{i}"}, None
        )
        assert routed.targets == ["10.0.0.2:8000"]
        assert routed.request is not None and (routed.request.model, routed.request.target_model) == ("chat", "chat-v2")
        assert json.loads(routed.body) == {**sent, "model": "chat-v2"}
        routed.finish()
    assert REGISTRY.get_sample_value(DECISIONS, labels) == before + 5


async def test_a_matching_rule_overrides_the_rewrite_header_and_the_header_applies_otherwise() -> None:
    director = director_with(
        [rewrite("r", "2026-01-01T00:00:00Z", rule(target("by-rule"), models=("ruled",)))],
        (Endpoint("10.0.0.1", 8000), EndpointMetrics()),
    )

    async def forwarded_model(model: str) -> str:
        headers = {":path": "/v1/completions", MODEL_REWRITE_HEADER: "by-header"}
        routed = await director.route(json.dumps({"model": model, "prompt": "p"}).encode(), headers, None)
        routed.finish()
        return str(json.loads(routed.body)["model"])

    assert await forwarded_model("ruled") == "by-rule"
    assert await forwarded_model("unruled") == "by-header"


async def test_a_change_is_a_new_value_used_by_the_next_request() -> None:
    director = director_with([], (Endpoint("10.0.0.1", 8000), EndpointMetrics()))
    body, headers = b'{"model":"m","prompt":"p"}', {":path": "/v1/completions"}
    before = director.runtimes.model_rewrites
    director.runtimes.set_model_rewrites([rewrite("r", "2026-01-01T00:00:00Z", rule(target("m2")))])
    assert director.runtimes.model_rewrites is not before and not before  # the old value is untouched
    routed = await director.route(body, headers, None)
    routed.finish()
    assert json.loads(routed.body)["model"] == "m2"
    director.runtimes.set_model_rewrites([])
    routed = await director.route(body, headers, None)
    routed.finish()
    assert routed.body == body  # forwarded as it came


def test_a_request_with_another_target_model_is_otherwise_the_same() -> None:
    headers = {":path": "/v1/chat/completions", "x-tenant": "t"}
    body = b'{"model":"chat","messages":[{"role":"user","content":"hi"}],"stream":true,"cache_salt":"s"}'
    request = parse_request(body, headers, "id-1", "x-tenant")
    rewritten = request.with_target_model("chat-v2")
    assert rewritten == dataclasses.replace(request, target_model="chat-v2")
    assert (rewritten.body, rewritten.headers) == (request.body, request.headers)  # not compared by ==
    assert request.target_model == "chat"
