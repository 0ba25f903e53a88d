"""The CRDs in manifests/crds, applied to the real API server: valid objects (the examples in
manifests/examples among them, the reference's own InferenceModelRewrites, and the status a
multi-cluster controller writes on an InferencePoolImport) are accepted, invalid ones rejected by
the schema's validation."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from kubernetes import client

from picker_bench.gobuild import GoModuleUnavailableError
from picker_bench.kube_resources import load_documents, pool_body
from picker_bench.reference_epp import reference_dir
from tests.e2e.conftest import ROOT
from tests.e2e.kube_resources import create_namespace

V1 = ("inference.networking.k8s.io", "v1", "inferencepools")
LEGACY = ("inference.networking.x-k8s.io", "v1alpha2", "inferencepools")
OBJECTIVES = ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives")
REWRITES = ("inference.networking.x-k8s.io", "v1alpha2", "inferencemodelrewrites")
IMPORTS = ("inference.networking.x-k8s.io", "v1alpha1", "inferencepoolimports")


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
    for doc in load_documents(
        [
            examples / "inferencepool.yaml",
            examples / "inferenceobjectives.yaml",
            examples / "inferencemodelrewrite.yaml",
        ]
    ):
        group, version = doc["apiVersion"].split("/")
        plural = doc["kind"].lower() + "s"
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


def reference_rewrites() -> list[dict[str, Any]]:
    """The reference's InferenceModelRewrites: its hermetic test data's and the adapter rollout
    guide's (the whole resources among its YAML blocks)."""
    try:
        root = reference_dir()
    except GoModuleUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)
    docs = load_documents([root / "test" / "testdata" / "inferencepool-with-model-hermetic.yaml"])
    guide = (root / "site-src" / "guides" / "adapter-rollout.md").read_text()
    docs += [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", guide, re.DOTALL)]
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == "InferenceModelRewrite"]


def test_the_references_model_rewrites_are_accepted_with_its_defaults(admin_api, namespace) -> None:
    rewrites = reference_rewrites()
    assert len(rewrites) == 3  # the test data's, and the guide's first two steps
    for i, doc in enumerate(rewrites):
        doc["metadata"] = {"name": f"reference-{i}"}
        created = create(admin_api, namespace, REWRITES, doc)
        assert created["spec"]["poolRef"]["group"] == "inference.networking.k8s.io"
        assert created["spec"]["poolRef"]["kind"] == "InferencePool"
        assert {m["model"]["type"] for r in created["spec"]["rules"] for m in r["matches"]} == {"Exact"}


@pytest.mark.parametrize(
    "name, spec, expected",
    [
        ("no-rules", {"poolRef": {"name": "p"}}, "spec.rules: Required value"),
        ("no-pool", {"rules": []}, "spec.poolRef: Required value"),
        ("no-targets", {"poolRef": {"name": "p"}, "rules": [{"targets": []}]}, "should have at least 1 items"),
        (
            "zero-weight",
            {"poolRef": {"name": "p"}, "rules": [{"targets": [{"modelRewrite": "m", "weight": 0}]}]},
            "greater than or equal to 1",
        ),
        (
            "prefix-match",
            {"poolRef": {"name": "p"}, "rules": [{"matches": [{"model": {"type": "Prefix", "value": "m"}}]}]},
            "Unsupported value",
        ),
        (
            "empty-match",
            {"poolRef": {"name": "p"}, "rules": [{"matches": [{"model": {"value": ""}}]}]},
            "at least 1 chars",
        ),
        (
            "no-target-model",
            {"poolRef": {"name": "p"}, "rules": [{"targets": [{"weight": 5}]}]},
            "modelRewrite: Required value",
        ),
    ],
)
def test_invalid_model_rewrites_are_rejected(admin_api, namespace, name, spec, expected) -> None:
    body = {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceModelRewrite"}
    with pytest.raises(client.ApiException) as info:
        create(admin_api, namespace, REWRITES, {**body, "metadata": {"name": name}, "spec": spec})
    assert info.value.status == 422
    assert expected in info.value.body, info.value.body


def import_status(**controller: Any) -> dict[str, Any]:
    """An InferencePoolImport status with one controller: an exporting cluster and a Gateway
    that accepted the import, overridden by `controller`."""
    condition = {
        "type": "Accepted",
        "status": "True",
        "reason": "Accepted",
        "message": "",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    entry = {
        "name": "example.net/import-controller",
        "exportingClusters": [{"name": "cluster-a"}],
        "parents": [{"parentRef": {"name": "inference-gateway"}, "conditions": [condition]}],
        "conditions": [condition],
    }
    return {"controllers": [{**entry, **controller}]}


def create_import(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    body = {"apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "InferencePoolImport"}
    return create(api, namespace, IMPORTS, {**body, "metadata": {"name": name}})


def write_import_status(api: client.ApiClient, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
    group, version, plural = IMPORTS
    custom = client.CustomObjectsApi(api)
    return custom.patch_namespaced_custom_object_status(group, version, namespace, plural, name, {"status": status})


def test_a_pool_import_is_accepted_and_its_controller_writes_its_status(admin_api, namespace) -> None:
    created = create_import(admin_api, namespace, "imported")
    assert "status" not in created  # a controller writes it, through the status subresource
    written = write_import_status(admin_api, namespace, "imported", import_status())
    (controller,) = written["status"]["controllers"]
    assert controller["exportingClusters"] == [{"name": "cluster-a"}]
    parent_ref = controller["parents"][0]["parentRef"]
    assert (parent_ref["group"], parent_ref["kind"]) == ("gateway.networking.k8s.io", "Gateway")


@pytest.mark.parametrize(
    "name, status, expected",
    [
        ("no-controllers", {}, "status.controllers: Required value"),
        ("controller-no-path", import_status(name="example.net"), "should match"),
        ("cluster-no-name", import_status(exportingClusters=[{}]), "name: Required value"),
        ("nine-controllers", {"controllers": [{"name": f"example.net/c{i}"} for i in range(9)]}, "at most 8 items"),
        ("same-controller", {"controllers": [{"name": "example.net/c"}] * 2}, "Duplicate value"),
        (
            "bad-condition",
            import_status(conditions=[{**import_status()["controllers"][0]["conditions"][0], "status": "Maybe"}]),
            "Unsupported value",
        ),
    ],
)
def test_invalid_pool_import_statuses_are_rejected(admin_api, namespace, name, status, expected) -> None:
    create_import(admin_api, namespace, name)
    with pytest.raises(client.ApiException) as info:
        write_import_status(admin_api, namespace, name, status)
    assert info.value.status == 422
    assert expected in info.value.body, info.value.body
