"""InferenceModelRewrite checked against the reference EPP v1.5.0 (`~/.cache/picker/bin/epp-v1.5.0`,
built from its Go module): the reference's own cases (its hermetic test data, its director
test's precedence cases, its adapter rollout guide's split) through picker and through the
reference binary, each behind its own Envoy, to the same pool of echoing model servers
(tests/backends.py) on the real API server. What counts is the model each request reached the
model server with (the reference also rewrites the model name in the response back to the one
the client asked for; picker does not, so the response's own `model` is not compared)."""

from __future__ import annotations

import calendar
import json
import math
import random
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kubernetes import client

from picker.request.openai import MODEL_REWRITE_HEADER
from picker_bench.gobuild import GoModuleUnavailableError
from picker_bench.kube_resources import create_pod, put_pool, set_pod_ready
from picker_bench.process import free_port, wait_until
from picker_bench.reference_epp import reference_epp_binary, start_reference_epp
from tests.e2e.kube_stack import release_gateway, shared_port
from tests.stack import start_backends, start_envoy

REWRITES = ("inference.networking.x-k8s.io", "v1alpha2", "inferencemodelrewrites")
SPLIT_REQUESTS = 2000
SETTLE_DEADLINE = 10.0  # both pickers following a change, on a shared 2-core machine

Row = tuple[str, str | None, str]  # (model asked for, rewrite header, model the server must receive)


@pytest.fixture(scope="module")
def pool(admin_api, picker_release, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Two echoing model servers as the Ready pods of the chart's pool."""
    first = random.randrange(20, 200)
    hosts = [f"127.0.0.{first}", f"127.0.0.{first + 1}"]
    port = shared_port(hosts)
    backends = start_backends([f"{h}:{port}" for h in hosts], tmp_path_factory.mktemp("rewrite-backends"))
    try:
        ns, labels = picker_release["namespace"], {"app": "rewrite-echo"}
        for i, host in enumerate(hosts):
            create_pod(admin_api, ns, f"echo-{i}", labels)
            set_pod_ready(admin_api, ns, f"echo-{i}", host)
        put_pool(admin_api, ns, picker_release["pool"], labels, [port])
        yield
    finally:
        backends.stop()


@pytest.fixture(scope="module")
def urls(kube_cluster, picker_release, pool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The completions URL through picker and through the reference EPP, for the same pool."""
    try:
        binary = reference_epp_binary()  # built from its Go module the first time
    except GoModuleUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)
    log_dir, grpc_port = tmp_path_factory.mktemp("reference-rewrite"), free_port()
    ns, name = picker_release["namespace"], picker_release["pool"]
    epp = start_reference_epp(binary, kube_cluster.admin_kubeconfig, name, ns, grpc_port, False, log_dir)
    try:
        # Full duplex, as the reference chart's gateways run it: in BUFFERED mode v1.5.0 never answers.
        envoy = start_envoy("duplex", grpc_port, log_dir, tls=False, name="envoy-reference-rewrite")
        try:
            with release_gateway(picker_release, log_dir, "rewrite-table") as (_, picker_url):
                yield {"picker": picker_url, "reference": envoy.url + "/v1/completions"}
        finally:
            envoy.stop()
    finally:
        epp.stop()


def received_model(url: str, model: str, rewrite_header: str | None = None) -> str | None:
    """The model one completion request reached the model server with (None: it did not)."""
    body = json.dumps({"model": model, "prompt": "hello"}).encode()
    headers = {"content-type": "application/json", "x-request-id": str(uuid.uuid4())}
    if rewrite_header is not None:
        headers[MODEL_REWRITE_HEADER] = rewrite_header
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=10) as answer:
            return json.loads(answer.read())["received_model"]
    except OSError:  # an HTTP error status, or no answer
        return None


def exact(model: str, *targets: dict[str, Any]) -> dict[str, Any]:
    return {"matches": [{"model": {"value": model}}], "targets": list(targets)}


def create_rewrite(api, release, name: str, *rules: dict[str, Any]) -> float:
    """Create an InferenceModelRewrite of the release's pool; returns its creation time (epoch s)."""
    group, version, plural = REWRITES
    body = {
        "apiVersion": f"{group}/{version}",
        "kind": "InferenceModelRewrite",
        "metadata": {"name": name},
        "spec": {"poolRef": {"name": release["pool"]}, "rules": list(rules)},
    }
    created = client.CustomObjectsApi(api).create_namespaced_custom_object(
        group, version, release["namespace"], plural, body
    )
    return calendar.timegm(time.strptime(created["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ"))


def delete_rewrites(api, release) -> None:
    group, version, plural = REWRITES
    client.CustomObjectsApi(api).delete_collection_namespaced_custom_object(
        group, version, release["namespace"], plural
    )


def both_answer(urls: dict[str, str], table: list[Row]) -> None:
    """Wait until every request of `table` reaches the model server with the expected model, through
    both (the rewrites just changed); fail naming what each sent last."""
    expected = [model for _, _, model in table]
    last: dict[str, list[str | None]] = {}

    def settled() -> bool:
        for name, url in urls.items():
            last[name] = [received_model(url, model, header) for model, header, _ in table]
        return all(received == expected for received in last.values())

    try:
        wait_until(settled, SETTLE_DEADLINE, "the new rewrites")
    except TimeoutError:
        raise AssertionError(f"expected {expected}, received {last}") from None


def canaries(url: str, n: int) -> int:
    """How many of `n` requests for `chat` (fresh request ids) reached the server as chat-v2."""
    with ThreadPoolExecutor(8) as pool:
        received = Counter(pool.map(lambda _: received_model(url, "chat"), range(n)))
    assert set(received) == {"chat-v1", "chat-v2"}, received
    return received["chat-v2"]


def test_the_same_requests_reach_the_model_server_with_the_same_model(admin_api, picker_release, urls) -> None:
    delete_rewrites(admin_api, picker_release)

    # The reference's test data (test/testdata/inferencepool-with-model-hermetic.yaml), with the
    # rewrite header beside it: a rule wins over the header, which applies where no rule does.
    create_rewrite(
        admin_api, picker_release, "rewrite-test", exact("model-to-be-rewritten", {"modelRewrite": "rewritten-model"})
    )
    both_answer(
        urls,
        [
            ("model-to-be-rewritten", None, "rewritten-model"),
            ("model-to-be-rewritten", "by-header", "rewritten-model"),
            ("unmatched", "by-header", "by-header"),
            ("unmatched", None, "unmatched"),
        ],
    )
    delete_rewrites(admin_api, picker_release)

    # Its director test's precedence: the oldest resource wins for a model; the first matching
    # rule of a resource wins; an exact match wins over a generic rule, which takes the rest.
    old = create_rewrite(
        admin_api, picker_release, "rewrite-old", exact("model-a", {"modelRewrite": "model-a-old-tuned"})
    )
    wait_until(lambda: time.time() >= old + 1.0, 2.0, "the next second")  # creation times have 1 s resolution
    create_rewrite(admin_api, picker_release, "rewrite-new", exact("model-a", {"modelRewrite": "model-a-new-tuned"}))
    create_rewrite(
        admin_api,
        picker_release,
        "rewrite-b",
        exact("model-b", {"modelRewrite": "model-b-tuned"}),
        exact("model-b", {"modelRewrite": "model-b-second"}),
    )
    create_rewrite(admin_api, picker_release, "catch-all", {"targets": [{"modelRewrite": "fallback"}]})
    both_answer(
        urls,
        [
            ("model-a", None, "model-a-old-tuned"),
            ("model-b", None, "model-b-tuned"),
            ("model-to-be-rewritten", None, "fallback"),
            ("anything", "by-header", "fallback"),
        ],
    )
    delete_rewrites(admin_api, picker_release)

    # The guide's 90/10 split (site-src/guides/adapter-rollout.md), 2,000 requests through each.
    both_answer(urls, [("anything", None, "anything")])  # the catch-all is gone
    split = [{"modelRewrite": "chat-v1", "weight": 90}, {"modelRewrite": "chat-v2", "weight": 10}]
    create_rewrite(admin_api, picker_release, "chat-split", exact("chat", *split))
    for url in urls.values():  # created whole: any rewritten request shows the split in force
        wait_until(lambda url=url: received_model(url, "chat") != "chat", SETTLE_DEADLINE, "the split")
    share, sigma = 0.1, math.sqrt(SPLIT_REQUESTS * 0.1 * 0.9)
    counts = {name: canaries(url, SPLIT_REQUESTS) for name, url in urls.items()}
    for name, count in counts.items():
        assert abs(count - SPLIT_REQUESTS * share) <= 4 * sigma, f"{name}: {count} of {SPLIT_REQUESTS} to chat-v2"
    assert abs(counts["picker"] - counts["reference"]) <= 4 * math.sqrt(2) * sigma, counts
    delete_rewrites(admin_api, picker_release)
