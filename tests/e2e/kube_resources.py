"""Creating and changing API objects only the e2e tests need (admin credentials, real API
server); those the bench's reference EPP needs too are in picker_bench.kube_resources."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kubernetes import client

from picker_bench.kube_cluster import KubeCluster, kubeconfig


def create_namespace(api: client.ApiClient, prefix: str) -> str:
    body = client.V1Namespace(metadata=client.V1ObjectMeta(generate_name=f"{prefix}-"))
    metadata = client.CoreV1Api(api).create_namespace(body).metadata
    assert metadata is not None and metadata.name is not None  # the API server named it
    return metadata.name


def delete_pod(api: client.ApiClient, namespace: str, name: str) -> None:
    # Grace period 0: with no kubelet, a graceful delete would only set deletionTimestamp.
    client.CoreV1Api(api).delete_namespaced_pod(name, namespace, grace_period_seconds=0)


def patch_config_map(api: client.ApiClient, namespace: str, name: str, data: Mapping[str, str]) -> None:
    client.CoreV1Api(api).patch_namespaced_config_map(name, namespace, {"data": dict(data)})


def service_account_kubeconfig(
    api: client.ApiClient, cluster: KubeCluster, namespace: str, name: str, path: Path
) -> Path:
    """A kubeconfig holding a TokenRequest token for ServiceAccount namespace/name."""
    token = service_account_token(api, namespace, name)
    path.write_text(
        kubeconfig(cluster.server, cluster.ca_file, token, f"system:serviceaccount:{namespace}:{name}", namespace)
    )
    return path


def service_account_token(api: client.ApiClient, namespace: str, name: str) -> str:
    """A TokenRequest token (one hour) for ServiceAccount namespace/name."""
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))
    answer = client.CoreV1Api(api).create_namespaced_service_account_token(name, namespace, request)
    assert answer.status is not None and answer.status.token is not None  # the API server issued it
    return answer.status.token
