"""InferenceModelRewrite end to end: the reference's LoRA adapter rollout guide
(site-src/guides/adapter-rollout.md), played against the real API server, through Envoy and
`picker serve` (the chart's credentials, its ConfigMap) to simulated vLLM pods that serve two
adapters, `chat-v1` and `chat-v2`, and answer 404 for the name clients use, `chat`.

A model server names the model it served in its answer, so what the pods received is what the
test counts."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from picker.config.model_rewrites import RewriteRule, RewriteTarget
from picker_bench.process import wait_until
from tests.e2e.kube_stack import release_gateway, sim_pool
from tests.e2e.test_kube_routing import CHANGE_DEADLINE
from tests.stack import Picker

REWRITES = ("inference.networking.x-k8s.io", "v1alpha2", "inferencemodelrewrites")
SPLIT_REQUESTS = 400
ADAPTERS = ("chat-v1", "chat-v2")


@pytest.fixture(scope="module")
def pods(admin_api, picker_release) -> Iterator[list[str]]:
    """Two simulated vLLM pods (base model `base`, both adapters loadable) in the chart's pool."""
    sim_flags = ("--profile", "tiny", "--time-scale", "100", "--model", "base", "--max-loras", "2", "--lora-modules")
    with sim_pool(admin_api, picker_release, "rewrite", *sim_flags, *ADAPTERS) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def gateway(picker_release, pods, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Picker, str]]:
    """The picker for the pool, behind Envoy."""
    with release_gateway(picker_release, tmp_path_factory.mktemp("gateway-rewrite"), "rewrite") as gateway:
        yield gateway


def served_model(url: str, model: str = "chat", request_id: str | None = None) -> tuple[int, str | None]:
    """(status, the model the pod says it served) for one completion request through Envoy."""
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 2}).encode()
    headers = {"content-type": "application/json", "x-request-id": request_id or str(uuid.uuid4())}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=10) as answer:
            return answer.status, json.loads(answer.read())["model"]
    except urllib.error.HTTPError as error:
        return error.code, None


def rollout_step(admin_api, picker_release, targets: list[dict[str, Any]]) -> None:
    """Create the guide's InferenceModelRewrite, or replace its targets (one step of the rollout)."""
    group, version, plural = REWRITES
    ns, custom = picker_release["namespace"], client.CustomObjectsApi(admin_api)
    spec = {
        "poolRef": {"group": "inference.networking.k8s.io", "name": picker_release["pool"]},
        "rules": [{"matches": [{"model": {"type": "Exact", "value": "chat"}}], "targets": targets}],
    }
    try:
        custom.patch_namespaced_custom_object(group, version, ns, plural, "chat-rewrite", {"spec": spec})
    except client.ApiException as error:
        if error.status != 404:
            raise
        body = {"apiVersion": f"{group}/{version}", "kind": "InferenceModelRewrite"}
        custom.create_namespaced_custom_object(
            group, version, ns, plural, {**body, "metadata": {"name": "chat-rewrite"}, "spec": spec}
        )


def decisions(picker: Picker) -> dict[str, float]:
    """The picker's rewrite decisions for `chat`, by target model."""
    with urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {
        sample.labels["target_model"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "inference_extension_model_rewrite_decisions"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["model_name"] == "chat"
    }


def test_the_adapter_rollout_guide(admin_api, picker_release, gateway) -> None:
    picker, url = gateway
    wait_until(lambda: served_model(url, "base") == (200, "base"), 10.0, "the pool serving its base model")
    assert served_model(url) == (404, None)  # no pod serves `chat` itself

    # Step 1: `chat` is an alias of chat-v1.
    rollout_step(admin_api, picker_release, [{"modelRewrite": "chat-v1"}])
    wait_until(lambda: served_model(url) == (200, "chat-v1"), CHANGE_DEADLINE, "chat served by chat-v1")

    # Step 2: 90 / 10. A request id the split sends to chat-v2 shows when it is in force; the
    # same id keeps landing there (a retry lands alike).
    split = [{"modelRewrite": "chat-v1", "weight": 90}, {"modelRewrite": "chat-v2", "weight": 10}]
    rule = RewriteRule("chat-rewrite", tuple(RewriteTarget(t["modelRewrite"], t["weight"]) for t in split))
    canary_id = next(i for i in map(str, range(1000)) if rule.choose(i) == "chat-v2")
    rollout_step(admin_api, picker_release, split)
    wait_until(lambda: served_model(url, request_id=canary_id) == (200, "chat-v2"), CHANGE_DEADLINE, "the 90/10 split")
    assert {served_model(url, request_id=canary_id) for _ in range(5)} == {(200, "chat-v2")}

    before = decisions(picker)
    with ThreadPoolExecutor(8) as pool:
        answers = Counter(pool.map(lambda _: served_model(url), range(SPLIT_REQUESTS)))
    assert set(answers) == {(200, "chat-v1"), (200, "chat-v2")}, answers
    canary = answers[(200, "chat-v2")]
    expected, sigma = SPLIT_REQUESTS * 0.1, math.sqrt(SPLIT_REQUESTS * 0.1 * 0.9)
    assert abs(canary - expected) <= 4 * sigma, f"{canary} of {SPLIT_REQUESTS} to chat-v2, expected {expected}"
    after = decisions(picker)
    counted = {m: after.get(m, 0.0) - before.get(m, 0.0) for m in ADAPTERS}
    assert counted == {"chat-v1": SPLIT_REQUESTS - canary, "chat-v2": canary}  # the reference's metric

    # Step 3: all traffic to chat-v2.
    rollout_step(admin_api, picker_release, [{"modelRewrite": "chat-v2", "weight": 100}])
    wait_until(
        lambda: {served_model(url) for _ in range(5)} == {(200, "chat-v2")}, CHANGE_DEADLINE, "chat served by chat-v2"
    )

    # Deleted: `chat` is an unknown model again.
    group, version, plural = REWRITES
    client.CustomObjectsApi(admin_api).delete_namespaced_custom_object(
        group, version, picker_release["namespace"], plural, "chat-rewrite"
    )
    wait_until(lambda: served_model(url) == (404, None), CHANGE_DEADLINE, "no rewrite once deleted")
