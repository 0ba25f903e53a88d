"""The CRDs in manifests/crds, applied to the real API server: valid objects (the examples in
manifests/examples among them) are accepted, invalid ones rejected by the schema's validation."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from picker_bench.kube_resources import load_documents, pool_body
from tests.e2e.conftest import ROOT
from tests.e2e.kube_resources import create_namespace

V1 = ("inference.networking.k8s.io", "v1", "inferencepools")
LEGACY = ("inference.networking.x-k8s.io", "v1alpha2", "inferencepools")
OBJECTIVES = ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives")


@pytest.fixture(scope="module")
def namespace(admin_api: client.ApiClient) -> str:
    return create_namespace(admin_api, "crds")


def create(
    api: client.ApiClient, namespace: str, resource: tuple[str, str, str], body: dict[str, Any]
) -> dict[str, Any]:
    group, version, plural = resource
    return client.CustomObjectsApi(api).create_namespaced_custom_object(group, version, namespace, plural, body)


def v1_pool(name: str, **spec: Any) -> dict[str, Any]:
    body = pool_body(name, {"app": "m"}, [8000])
    body["spec"].update(spec)
    return body


def test_example_pool_and_objectives_are_accepted(admin_api, namespace) -> None:
    examples = ROOT / "manifests" / "examples"
    for doc in load_documents([examples / "inferencepool.yaml", examples / "inferenceobjectives.yaml"]):
        group, version = doc["apiVersion"].split("/")
        plural = "inferencepools" if doc["kind"] == "InferencePool" else "inferenceobjectives"
        doc["metadata"].pop("namespace", None)
        create(admin_api, namespace, (group, version, plural), doc)


def test_valid_pool_gets_defaults(admin_api, namespace) -> None:
    created = create(admin_api, namespace, V1, v1_pool("eight", targetPorts=[{"number": 8000 + i} for i in range(8)]))
    ref = created["spec"]["endpointPickerRef"]
    assert (ref["group"], ref["kind"], ref["failureMode"]) == ("", "Service", "FailClose")
    legacy = create(admin_api, namespace, LEGACY, pool_body("old", {"app": "m"}, [8000], legacy=True))
    assert legacy["spec"]["extensionRef"]["kind"] == "Service"


@pytest.mark.parametrize(
    "name, spec, expected",
    [
        ("nine-ports", {"targetPorts": [{"number": 8000 + i} for i in range(9)]}, "must have at most 8 items"),
        ("no-ports", {"targetPorts": []}, "should have at least 1 items"),
        ("dup-ports", {"targetPorts": [{"number": 8000}, {"number": 8000}]}, "port numbers must be unique"),
        ("port-zero", {"targetPorts": [{"number": 0}]}, "should be greater than or equal to 1"),
        ("no-selector", {"selector": None}, "spec.selector: Required value"),
        ("empty-selector", {"selector": {"matchLabels": {}}}, "should have at least 1 properties"),
        ("bad-label-key", {"selector": {"matchLabels": {"bad key!": "x"}}}, "label keys must be valid"),
        ("service-no-port", {"endpointPickerRef": {"name": "epp"}}, "port is required when kind is Service"),
        (
            "bad-failure-mode",
            {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "Maybe"}},
            "Unsupported value",
        ),
        ("bad-protocol", {"appProtocol": "grpc"}, "Unsupported value"),
    ],
)
def test_invalid_v1_pools_are_rejected(admin_api, namespace, name, spec, expected) -> None:
    body = v1_pool(name, **spec)
    body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
    with pytest.raises(client.ApiException) as info:
        create(admin_api, namespace, V1, body)
    assert info.value.status == 422
    assert expected in info.value.body, info.value.body


def test_invalid_legacy_pool_and_objective_are_rejected(admin_api, namespace) -> None:
    body = pool_body("legacy-bad", {"app": "m"}, [70000], legacy=True)
    with pytest.raises(client.ApiException) as info:
        create(admin_api, namespace, LEGACY, body)
    assert info.value.status == 422 and "targetPortNumber" in info.value.body
    objective = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": "no-pool"},
        "spec": {"priority": 1},
    }
    with pytest.raises(client.ApiException) as info:
        create(admin_api, namespace, OBJECTIVES, objective)
    assert info.value.status == 422 and "poolRef" in info.value.body


def test_crd_files_are_one_crd_each() -> None:
    for path in (ROOT / "manifests" / "crds").glob("*.yaml"):
        (doc,) = load_documents([path])
        assert doc["kind"] == "CustomResourceDefinition" and doc["metadata"]["name"] == path.stem
