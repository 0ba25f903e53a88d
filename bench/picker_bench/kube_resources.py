"""Creating and changing the API objects the reference EPP reads (admin credentials, real API
server); the e2e tests use them too, and tests/e2e/kube_resources.py has those only tests need."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, dynamic

from picker_bench.process import wait_until

POOL_V1 = ("inference.networking.k8s.io", "v1")
POOL_LEGACY = ("inference.networking.x-k8s.io", "v1alpha2")


def load_documents(paths: Iterable[Path]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in paths:
        docs.extend(d for d in yaml.safe_load_all(Path(path).read_text()) if d)
    return docs


# The kubernetes package's dynamic client is untyped.
dynamic_client: Callable[[client.ApiClient], Any] = dynamic.DynamicClient


def apply_manifests(
    api: client.ApiClient, paths_or_docs: Iterable[Path | Mapping[str, Any]], namespace: str | None = None
) -> None:
    """Create every object (any kind, CRDs included) through the dynamic client."""
    dyn = dynamic_client(api)
    items = list(paths_or_docs)
    docs = [d for d in items if isinstance(d, Mapping)]
    docs += load_documents(p for p in items if not isinstance(p, Mapping))
    for doc in docs:
        resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        if resource.namespaced:
            resource.create(body=doc, namespace=doc.get("metadata", {}).get("namespace") or namespace)
        else:
            resource.create(body=doc)


def wait_crds_established(api: client.ApiClient, names: Iterable[str]) -> None:
    ext = client.ApiextensionsV1Api(api)

    def established(name: str) -> bool:
        try:
            crd = ext.read_custom_resource_definition(name)
        except client.ApiException as exc:
            if exc.status == 404:  # not visible yet
                return False
            raise
        conditions = crd.status.conditions if crd.status else None
        return any(c.type == "Established" and c.status == "True" for c in conditions or ())

    for name in names:
        wait_until(functools.partial(established, name), 30, f"CRD {name} to be established")


def create_pod(
    api: client.ApiClient,
    namespace: str,
    name: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str] | None = None,
) -> None:
    """A Pod object only: no kubelet runs, so its status is whatever the test sets."""
    body = client.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=client.V1ObjectMeta(name=name, labels=dict(labels), annotations=dict(annotations or {})),
        spec=client.V1PodSpec(containers=[client.V1Container(name="model-server", image="vllm/vllm-openai:latest")]),
    )
    client.CoreV1Api(api).create_namespaced_pod(namespace, body)


def set_pod_ready(api: client.ApiClient, namespace: str, name: str, ip: str, ready: bool = True) -> None:
    """Write the pod's IP and Ready condition through the status subresource, as a kubelet would."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now}],
    }
    client.CoreV1Api(api).patch_namespaced_pod_status(name, namespace, {"status": status})


def pool_body(name: str, selector: Mapping[str, str], ports: list[int], legacy: bool = False) -> dict[str, Any]:
    if legacy:
        (port,) = ports
        return {
            "apiVersion": "/".join(POOL_LEGACY),
            "kind": "InferencePool",
            "metadata": {"name": name},
            "spec": {"selector": dict(selector), "targetPortNumber": port, "extensionRef": {"name": f"{name}-epp"}},
        }
    return {
        "apiVersion": "/".join(POOL_V1),
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
        },
    }


def put_pool(
    api: client.ApiClient,
    namespace: str,
    name: str,
    selector: Mapping[str, str],
    ports: list[int],
    legacy: bool = False,
) -> None:
    """Create the pool, or replace its spec if it exists."""
    group, version = POOL_LEGACY if legacy else POOL_V1
    custom = client.CustomObjectsApi(api)
    body = pool_body(name, selector, ports, legacy)
    try:
        current: dict[str, Any] = custom.get_namespaced_custom_object(  # type: ignore[assignment]
            group, version, namespace, "inferencepools", name
        )
    except client.ApiException as exc:
        if exc.status != 404:
            raise
        custom.create_namespaced_custom_object(group, version, namespace, "inferencepools", body)
        return
    current["spec"] = body["spec"]
    custom.replace_namespaced_custom_object(group, version, namespace, "inferencepools", name, current)
