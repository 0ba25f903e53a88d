"""The chart, for default values and every documented option: `helm lint`, `helm template` piped
through `kubernetes-validate --strict`, and `helm install` into the real API server (no
controllers run, so the install creating every object is the check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.e2e.conftest import CHART
from tests.e2e.helm_cli import helm
from tests.e2e.kube_resources import (
    apply_manifests,
    create_namespace,
    wait_crds_established,
)

CUSTOM_CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""

# Each case turns on documented options (values.yaml); together they cover all of them.
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "standalone": {"inferencePool": {"standalone": True, "targetPorts": [{"number": 8000}, {"number": 8001}]}},
    "legacy-pool": {"inferencePool": {"apiVersion": "inference.networking.x-k8s.io/v1alpha2"}},
    "existing-pool": {"inferencePool": {"create": False}},
    "eight-ranks-h2c": {
        "inferencePool": {
            "targetPorts": [{"number": 8000 + i} for i in range(8)],
            "appProtocol": "kubernetes.io/h2c",
            "modelServers": {"matchLabels": {"app": "m", "tier": "gpu"}},
        }
    },
    "config-file-custom": {
        "inferenceExtension": {
            "configSource": "file",
            "pluginsConfigFile": "mine.yaml",
            "pluginsCustomConfig": {"mine.yaml": CUSTOM_CONFIG},
        }
    },
    "tls-and-pod-options": {
        "inferenceExtension": {
            "secureServing": True,
            "certSecret": "picker-tls",
            "failureMode": "FailClose",
            "logVerbosity": 4,
            "logEncoder": "console",
            "image": {
                "registry": "registry.example",
                "repository": "team/picker",
                "tag": "1.2.3",
                "pullPolicy": "Always",
            },
            "imagePullSecrets": [{"name": "regcred"}],
            "flags": {"refresh-metrics-interval": "100ms", "tenant-header": "x-tenant"},
            "env": [{"name": "EXTRA", "value": "1"}],
            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
            "nodeSelector": {"pool": "cpu"},
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cpu"]}]}
                        ]
                    }
                }
            },
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "system-cluster-critical",
            "podAnnotations": {"example.com/a": "b"},
            "podLabels": {"team": "ml"},
            "extraContainerPorts": [{"name": "debug", "containerPort": 9100}],
            "extraServicePorts": [{"name": "debug", "port": 9100, "targetPort": "debug"}],
            "volumes": [{"name": "extra", "emptyDir": {}}],
            "volumeMounts": [{"name": "extra", "mountPath": "/extra"}],
            "extProcPort": 9102,
            "healthPort": 9103,
            "metricsPort": 9190,
        }
    },
    "ha-pdb-min": {"inferenceExtension": {"replicas": 2, "podDisruptionBudget": {"enabled": True, "minAvailable": 1}}},
    "pdb-max": {"inferenceExtension": {"podDisruptionBudget": {"enabled": True, "maxUnavailable": 1}}},
    "service-monitor": {
        "inferenceExtension": {
            "monitoring": {
                "interval": "15s",
                "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                "grafanaDashboard": {"enabled": True},
            }
        }
    },
    "gke-http": {"provider": {"name": "gke"}},
    "gke-grpc": {"provider": {"name": "gke", "gke": {"modelServerProtocol": "grpc", "backendTimeoutSec": 600}}},
    "istio": {
        "provider": {
            "name": "istio",
            "istio": {
                "destinationRule": {
                    "host": "picker.example.svc.cluster.local",
                    "trafficPolicy": {"connectionPool": {"http": {"http2MaxRequests": 1000}}},
                }
            },
        }
    },
    "httproute-objectives": {
        "experimentalHttpRoute": {
            "enabled": True,
            "inferenceGatewayName": "gw",
            "requestTimeout": "120s",
            "headerMatches": [{"name": "x-model", "value": "llama", "type": "Exact"}],
        },
        "inferenceObjectives": [
            {"name": "interactive", "priority": 10},
            {"name": "batch", "priority": -1},
            {"name": "plain"},
        ],
    },
}

# Kinds other projects own, which some options render; the bare test API server gets
# schema-less CRDs for them so that `helm install` can create the objects.
THIRD_PARTY_KINDS = [
    ("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors"),
    ("networking.gke.io", "v1", "HealthCheckPolicy", "healthcheckpolicies"),
    ("networking.gke.io", "v1", "GCPBackendPolicy", "gcpbackendpolicies"),
    ("networking.istio.io", "v1", "DestinationRule", "destinationrules"),
    ("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes"),
    ("gateway.networking.k8s.io", "v1", "Gateway", "gateways"),
]


def stub_crd(group: str, version: str, kind: str, plural: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": f"{plural}.{group}"}
    if group.endswith((".k8s.io", ".kubernetes.io")):  # protected groups need this to be accepted
        metadata["annotations"] = {"api-approved.kubernetes.io": "unapproved, test stand-in"}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": metadata,
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def third_party_crds(admin_api: client.ApiClient) -> None:
    apply_manifests(admin_api, [stub_crd(*kind) for kind in THIRD_PARTY_KINDS])
    wait_crds_established(admin_api, [f"{plural}.{group}" for group, _, _, plural in THIRD_PARTY_KINDS])


def values_file(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def render(helm_binary: Path, helm_env: dict[str, str], values: Path, namespace: str = "ns") -> list[dict[str, Any]]:
    text = helm(helm_binary, helm_env, "template", "rel", str(CHART), "-n", namespace, "-f", str(values))
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_template_validate_and_install(
    case, kube_cluster, admin_api, helm_binary, helm_env, third_party_crds, tmp_path
) -> None:
    values = values_file(tmp_path, CASES[case])
    helm(helm_binary, helm_env, "lint", "--strict", str(CHART), "-f", str(values))

    rendered = helm(helm_binary, helm_env, "template", "rel", str(CHART), "-n", "ns", "-f", str(values))
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(rendered)
    validate = subprocess.run(
        [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "--no-warn", str(manifest)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert validate.returncode == 0, f"kubernetes-validate rejected {case}:\n{validate.stdout}\n{validate.stderr}"

    namespace = create_namespace(admin_api, f"chart-{case}")
    helm(helm_binary, helm_env, "install", "rel", str(CHART), "-n", namespace, "-f", str(values), kube=kube_cluster)
    deployment = client.AppsV1Api(admin_api).read_namespaced_deployment("rel-epp", namespace)
    assert deployment.spec.template.spec.containers[0].args[0] == "serve"


def test_default_deployment_matches_the_reference_shape(helm_binary, helm_env, tmp_path) -> None:
    docs = render(helm_binary, helm_env, values_file(tmp_path, {}))
    by_kind = {doc["kind"]: doc for doc in docs}
    assert set(by_kind) == {
        "ServiceAccount",
        "ConfigMap",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
        "InferencePool",
    }
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"][:4] == [
        "serve",
        "--pool-name=rel",
        "--pool-namespace=ns",
        "--pool-group=inference.networking.k8s.io",
    ]
    assert "--config-map=rel-epp" in container["args"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
    }
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["resources"]["requests"]
    assert by_kind["InferencePool"]["spec"]["endpointPickerRef"] == {
        "name": "rel-epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }


def test_the_grafana_dashboard_configmap_carries_the_shipped_dashboard(helm_binary, helm_env, tmp_path) -> None:
    values = {"inferenceExtension": {"monitoring": {"grafanaDashboard": {"enabled": True}}}}
    docs = render(helm_binary, helm_env, values_file(tmp_path, values))
    (dashboard,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rel-epp-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["picker.json"]) == json.loads(
        (CHART / "dashboards" / "picker.json").read_text()
    )


def test_rbac_is_least_privilege_for_each_mode(helm_binary, helm_env, tmp_path) -> None:
    def rules(values: dict[str, Any]) -> list[dict[str, Any]]:
        docs = render(helm_binary, helm_env, values_file(tmp_path, values))
        (role,) = [d for d in docs if d["kind"] == "Role"]
        return role["rules"]

    for rule in rules({}):
        assert set(rule["verbs"]) == {"get", "list", "watch"}, rule
    assert {r["resources"][0] for r in rules({})} == {"pods", "inferencepools", "inferenceobjectives", "configmaps"}
    assert {r["resources"][0] for r in rules({"inferenceExtension": {"configSource": "file"}})} == {
        "pods",
        "inferencepools",
        "inferenceobjectives",
    }
    assert {r["resources"][0] for r in rules({"inferencePool": {"standalone": True}})} == {"pods", "configmaps"}
    legacy = rules({"inferencePool": {"apiVersion": "inference.networking.x-k8s.io/v1alpha2"}})
    assert [r["apiGroups"] for r in legacy if r["resources"] == ["inferencepools"]] == [
        ["inference.networking.x-k8s.io"]
    ]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"inferencePool": {"targetPorts": [{"number": 8000 + i} for i in range(9)]}}, "maxItems"),
        ({"inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8000}]}}, "are equal"),
        ({"inferencePool": {"modelServers": {"matchLabels": None}}}, "matchLabels"),
        ({"inferencePool": {"targetPorts": [{"number": 0}]}}, "minimum"),
        ({"inferenceExtension": {"configSource": "etcd"}}, "configSource"),
        ({"inferenceExtension": {"pluginsConfigFile": "missing.yaml"}}, "pluginsCustomConfig"),
        (
            {
                "inferencePool": {
                    "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                    "targetPorts": [{"number": 8000}, {"number": 8001}],
                }
            },
            "exactly one target port",
        ),
    ],
)
def test_invalid_values_are_rejected_with_a_clear_error(values, message, helm_binary, helm_env, tmp_path) -> None:
    result = subprocess.run(
        [str(helm_binary), "template", "rel", str(CHART), "-f", str(values_file(tmp_path, values))],
        env=helm_env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
