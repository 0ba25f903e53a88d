"""Two models behind one Envoy, as manifests/examples/multi-model.yaml sets them up: its adapter
ConfigMaps, InferencePools and HTTPRoutes created on the real API server; `picker bbr` reading
the ConfigMaps; one Envoy running the HTTPRoutes (a route per base-model header value, each with
its own pool's `picker serve` as the route's ext_proc) in front of two fleets of simulated
vLLM pods, each fleet serving one base model and its LoRA adapters. A simulated pod answers 404
for a model it does not serve, so a 200 means the request reached a pod serving its model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client

from picker.bbr.adapters import parse_config_map
from picker_bench.bbr import PICKER_BBR, multi_model_envoy_config, start_bbr, start_envoy
from picker_bench.kube_resources import load_documents
from picker_bench.process import free_port, wait_until
from picker_bench.systems import FleetPod
from tests.e2e.bbr_stack import post
from tests.e2e.conftest import ROOT
from tests.e2e.kube_resources import create_namespace
from tests.sim_fixtures import start_sim, stop_process
from tests.stack import start_picker

EXAMPLE = ROOT / "manifests" / "examples" / "multi-model.yaml"
REQUESTS_PER_MODEL = 4


@dataclass(frozen=True, slots=True)
class Route:
    """One HTTPRoute of the example: the header it matches, the value, and its pool."""

    header: str
    base_model: str
    pool: str


def example_routes(docs: list[dict[str, Any]]) -> list[Route]:
    routes = []
    for doc in docs:
        if doc["kind"] == "HTTPRoute":
            (rule,) = doc["spec"]["rules"]
            (match,) = rule["matches"]
            (header,) = match["headers"]
            (backend,) = rule["backendRefs"]
            routes.append(Route(header["name"], header["value"], backend["name"]))
    return routes


def create_example(api: client.ApiClient, namespace: str, docs: list[dict[str, Any]]) -> None:
    """Every object of the example, in `namespace`, accepted by the API server."""
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
        if doc["kind"] == "ConfigMap":
            client.CoreV1Api(api).create_namespaced_config_map(namespace, doc)
        else:
            group, version = doc["apiVersion"].split("/")
            plural = doc["kind"].lower() + "s"
            client.CustomObjectsApi(api).create_namespaced_custom_object(group, version, namespace, plural, doc)


@pytest.fixture(scope="module")
def gateway(
    kube_cluster, admin_api, third_party_crds, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, list[str]]]]:
    """The Gateway's completions URL, and each base model's adapters."""
    log_dir = tmp_path_factory.mktemp("bbr-multi-model")
    docs = load_documents([EXAMPLE])
    namespace = create_namespace(admin_api, "multi-model")
    create_example(admin_api, namespace, docs)
    adapters = dict(parse_config_map(doc["data"]) for doc in docs if doc["kind"] == "ConfigMap")
    routes = example_routes(docs)
    (header,) = {route.header for route in routes}
    sims, processes = [], []
    try:
        epps: dict[str, tuple[str, int]] = {}
        for route in routes:
            served = sorted(adapters[route.base_model])
            sim, lines = start_sim(
                [
                    "--pods",
                    "2",
                    "--base-port",
                    "0",
                    "--profile",
                    "tiny",
                    "--time-scale",
                    "20",
                    "--max-loras",
                    str(len(served)),
                    "--model",
                    route.base_model,
                    "--lora-modules",
                    *served,
                ]
            )
            sims.append(sim)
            pods = [FleetPod.parse(line).address for line in lines]
            picker = start_picker(log_dir, "--endpoints", ",".join(pods), name=f"picker-{route.pool}", tls=False)
            processes.append(picker.process)
            epps[route.base_model] = ("127.0.0.1", picker.grpc_port)
        bbr_port = free_port()
        processes.append(
            start_bbr(
                PICKER_BBR, kube_cluster.admin_kubeconfig, bbr_port, log_dir, "picker-bbr", env={"NAMESPACE": namespace}
            )
        )
        config = multi_model_envoy_config(
            ("127.0.0.1", free_port()), ("127.0.0.1", bbr_port), header, epps, ("127.0.0.1", free_port())
        )
        envoy = start_envoy(config, log_dir, "envoy-multi-model")
        processes.append(envoy)
        url = envoy.url + "/v1/completions"
        some_adapter = next(iter(adapters[routes[0].base_model]))
        wait_until(
            lambda: post(url, completion(some_adapter)).status == 200, 30, "the router to read the adapters", 0.2
        )
        yield url, {base: sorted(names) for base, names in adapters.items()}
    finally:
        for process in reversed(processes):
            process.stop()
        for sim in sims:
            stop_process(sim)


def completion(model: str) -> bytes:
    return json.dumps({"model": model, "prompt": "Tell me about the mountains", "max_tokens": 4}).encode()


def test_every_model_and_adapter_reaches_a_pod_serving_it(gateway) -> None:
    url, adapters = gateway
    assert len(adapters) == 2 and all(adapters.values())
    for base_model, names in adapters.items():
        for model in (base_model, *names):
            for _ in range(REQUESTS_PER_MODEL):
                answer = post(url, completion(model))
                assert answer.status == 200, (model, answer.body[:200])
                assert json.loads(answer.body)["model"] == model


def test_an_unknown_model_gets_the_gateways_404(gateway) -> None:
    url, _ = gateway
    assert post(url, completion("no-such-model")).status == 404


def test_a_body_that_is_not_json_gets_a_400_from_the_router(gateway) -> None:
    url, _ = gateway
    answer = post(url, b'{"model": ')
    assert answer.status == 400
    assert json.loads(answer.body)["error"]["code"] == "BadRequest"
