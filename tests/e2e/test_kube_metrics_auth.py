"""`--metrics-endpoint-auth` (on by default with the pool) against the real API server: the
picker reviews each caller's bearer token (TokenReview) and its right to GET the path
(SubjectAccessReview on the non-resource URL), with the chart's RBAC.

The chart's monitoring identity is the picker's ServiceAccount (its token Secret is what the
ServiceMonitor sends). No token controller runs here to fill that Secret, so the test asks the
TokenRequest API for a token of the same ServiceAccount: the same identity."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from kubernetes import client

from picker.config import cli as config_cli
from tests.e2e.kube_resources import service_account_token
from tests.e2e.kube_stack import serve_args
from tests.stack import Picker, start_picker


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=15) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def picker(picker_release: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Picker]:
    """`picker serve` as the chart runs it: metrics auth left at its default."""
    process = start_picker(
        tmp_path_factory.mktemp("metrics-auth"),
        *serve_args(picker_release, metrics_auth=True),
        "--enable-debug-decisions",
        name="picker-metrics-auth",
        tls=False,
    )
    yield process
    process.stop()


def test_metrics_answer_only_the_monitoring_identity(admin_api, kube_cluster, picker_release, picker, capsys) -> None:
    ns = picker_release["namespace"]
    client.CoreV1Api(admin_api).create_namespaced_service_account(
        ns, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="no-rights"))
    )
    stranger = service_account_token(admin_api, ns, "no-rights")
    monitoring = service_account_token(admin_api, ns, "pool-epp")  # the chart's ServiceMonitor identity
    metrics = f"http://127.0.0.1:{picker.metrics_port}/metrics"

    assert get(metrics)[0] == 401
    assert get(metrics, "not-a-token")[0] == 401
    status, body = get(metrics, stranger)
    assert (status, body.strip()) == (
        403,
        f"Authorization denied for user system:serviceaccount:{ns}:no-rights".encode(),
    )
    status, body = get(metrics, monitoring)
    assert status == 200 and b"picker_config_info" in body
    # Again, from the cache (the reference caches allowed answers for 5 minutes).
    assert get(metrics, monitoring)[0] == 200
    assert get(metrics, stranger)[0] == 403

    # Every path of the metrics port is reviewed as its own non-resource URL: the chart grants
    # the monitoring identity /metrics only.
    base = f"http://127.0.0.1:{picker.metrics_port}"
    for path in ("/config", "/debug/decisions"):
        assert get(base + path)[0] == 401
        assert get(base + path, monitoring)[0] == 403
    # An identity granted /config reads it.
    rbac = client.RbacAuthorizationV1Api(admin_api)
    rbac.create_cluster_role(
        {"metadata": {"name": f"{ns}-config-reader"}, "rules": [{"nonResourceURLs": ["/config"], "verbs": ["get"]}]}
    )
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": f"{ns}-config-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{ns}-config-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "no-rights", "namespace": ns}],
        }
    )
    status, body = get(base + "/config", stranger)
    assert status == 200 and b"sha256" in body
    # `picker config show --live` with that identity's token, and without one.
    assert config_cli.main(["show", "--live", base, "--token", stranger]) == 0
    assert "sha256: " in capsys.readouterr().out
    assert config_cli.main(["show", "--live", base, "--token", ""]) == 1
    assert "401" in capsys.readouterr().err
