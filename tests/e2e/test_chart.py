"""The chart, for default values and every documented option: `helm lint`, `helm template` piped
through `kubernetes-validate --strict`, and `helm install` into the real API server (no
controllers run, so the install creating every object is the check)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from picker.config.builtin_configs import BUILTIN_DIR, builtin_names
from picker.config.loader import build, parse_text
from picker.serve.flags import build_parser, serve_options
from tests.e2e.charts import (
    by_kind,
    chart_image,
    one,
    render,
    validate_strict,
    values_file,
)
from tests.e2e.conftest import CHART
from tests.e2e.helm_cli import helm
from tests.e2e.kube_resources import create_namespace

CUSTOM_CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""

SIDECAR = {
    "enabled": True,
    "name": "proxy",
    "image": "envoyproxy/envoy:v1.36.0",
    "imagePullPolicy": "Always",
    "command": "envoy",
    "args": ["-c", "/etc/envoy/envoy.yaml"],
    "env": [{"name": "LOG", "value": "info"}],
    "ports": [{"name": "http", "containerPort": 8081}],
    "livenessProbe": {"httpGet": {"path": "/ready", "port": 19001}},
    "readinessProbe": {"httpGet": {"path": "/ready", "port": 19001}},
    "resources": {"requests": {"cpu": "100m"}},
    "volumeMounts": [{"name": "envoy-config", "mountPath": "/etc/envoy"}],
    "volumes": [{"name": "envoy-config", "configMap": {"name": "{{ .Release.Name }}-envoy"}}],
    "configMap": {"name": "rel-envoy", "data": {"envoy.yaml": "static_resources: {}\n"}},
}

# Each case turns on documented options (values.yaml); together they cover all of them.
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "standalone": {"inferencePool": {"standalone": True, "targetPorts": [{"number": 8000}, {"number": 8001}]}},
    "legacy-pool": {"inferencePool": {"apiVersion": "inference.networking.x-k8s.io/v1alpha2"}},
    "existing-pool": {"inferencePool": {"create": False}},
    "eight-ranks-h2c": {
        "inferencePool": {
            "targetPorts": [{"number": 8000 + i} for i in range(8)],
            "targetPortNumber": 8000,
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
            "failureMode": "FailOpen",
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
    "prometheus-auth": {
        "inferenceExtension": {
            "monitoring": {
                "prometheus": {
                    "enabled": True,
                    "auth": {"enabled": True, "secretName": "scraper-token"},
                    "extraLabels": {"team": "ml"},
                },
                "gke": {"enabled": False},
            }
        }
    },
    "prometheus-no-auth": {
        "inferenceExtension": {"monitoring": {"prometheus": {"enabled": True, "auth": {"enabled": False}}}}
    },
    "tracing-sidecar-env-map": {
        "inferenceExtension": {
            "tracing": {
                "enabled": True,
                "otelExporterEndpoint": "http://otel-collector:4317",
                "sampling": {"sampler": "parentbased_traceidratio", "samplerArg": "0.5"},
            },
            "sidecar": SIDECAR,
            "env": {"FEATURE": "on"},
        }
    },
    "engine-trtllm-https-parser": {
        "inferenceExtension": {"metricsDataSource": {"scheme": "https", "insecureSkipVerify": False}},
        "inferencePool": {"modelServerType": "trtllm-serve", "parser": "openai-parser"},
    },
    "gke-http": {"provider": {"name": "gke"}},
    "gke-grpc": {"provider": {"name": "gke", "gke": {"modelServerProtocol": "grpc", "backendTimeoutSec": 600}}},
    "gke-monitoring-autopilot": {
        "provider": {"name": "gke", "gke": {"autopilot": True}},
        "inferenceExtension": {"monitoring": {"prometheus": {"enabled": True}}},
    },
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
    "istio-plaintext": {"provider": {"name": "istio"}, "inferenceExtension": {"secureServing": False}},
    "httproute-objectives": {
        "experimentalHttpRoute": {
            "enabled": True,
            "inferenceGatewayName": "gw",
            "requestTimeout": "120s",
            "baseModel": "llama",
            "headerMatches": [{"name": "x-model", "value": "llama", "type": "Exact"}],
        },
        "inferenceObjectives": [
            {"name": "interactive", "priority": 10},
            {"name": "batch", "priority": -1},
            {"name": "plain"},
        ],
    },
}


def picker_docs(helm_binary: Path, helm_env: dict[str, str], tmp_path: Path, values: dict[str, Any]) -> list[dict]:
    return render(helm_binary, helm_env, CHART, [values_file(tmp_path, values)])


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def flags(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The picker's arguments after `serve`, as {name: value}; each is rendered once."""
    args = container(docs)["args"]
    assert args[0] == "serve"
    pairs = [arg.removeprefix("--").split("=", 1) for arg in args[1:]]
    assert len({name for name, _ in pairs}) == len(pairs), args
    return dict(pairs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_template_validate_and_install(
    case, kube_cluster, admin_api, helm_binary, helm_env, third_party_crds, tmp_path
) -> None:
    values = values_file(tmp_path, CASES[case])
    helm(helm_binary, helm_env, "lint", "--strict", str(CHART), "-f", str(values))

    rendered = helm(helm_binary, helm_env, "template", "rel", str(CHART), "-n", "ns", "-f", str(values))
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(rendered)
    validate_strict(manifest)

    namespace = create_namespace(admin_api, f"chart-{case}")
    helm(helm_binary, helm_env, "install", "rel", str(CHART), "-n", namespace, "-f", str(values), kube=kube_cluster)
    deployment = client.AppsV1Api(admin_api).read_namespaced_deployment("rel-epp", namespace)
    assert deployment.spec.template.spec.containers[0].args[0] == "serve"


def test_default_deployment_matches_the_reference_shape(helm_binary, helm_env, tmp_path) -> None:
    docs = picker_docs(helm_binary, helm_env, tmp_path, {})
    assert {doc["kind"] for doc in docs} == {
        "ServiceAccount",
        "ConfigMap",
        "Role",
        "RoleBinding",
        "ClusterRole",  # metrics auth: TokenReview + SubjectAccessReview
        "ClusterRoleBinding",
        "Service",
        "Deployment",
        "InferencePool",
    }
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    epp = container(docs)
    assert flags(docs) == {
        "pool-name": "rel",
        "pool-namespace": "ns",
        "pool-group": "inference.networking.k8s.io",
        "config-map": "rel-epp",
        "grpc-port": "9002",
        "grpc-health-port": "9003",
        "metrics-port": "9090",
        "v": "2",
        "zap-encoder": "json",
        "secure-serving": "true",
        "tracing": "false",  # metrics auth is on by default; only =false is passed, as the reference
        "shutdown-delay": "5s",
        "shutdown-grace": "120s",
    }
    assert {p["name"]: p["containerPort"] for p in epp["ports"]} == {"grpc": 9002, "grpc-health": 9003, "metrics": 9090}
    assert epp["livenessProbe"]["grpc"] == {"port": 9003, "service": "inference-extension"}
    assert epp["readinessProbe"]["grpc"] == {"port": 9003, "service": "inference-extension"}
    assert epp["image"] == chart_image()
    assert epp["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert epp["resources"]["requests"]
    assert one(docs, "InferencePool")["spec"]["endpointPickerRef"] == {
        "name": "rel-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }


def test_several_replicas_elect_a_leader_and_probe_liveness_and_readiness(helm_binary, helm_env, tmp_path) -> None:
    docs = picker_docs(helm_binary, helm_env, tmp_path, {"inferenceExtension": {"replicas": 3}})
    assert flags(docs)["ha-enable-leader-election"] == "true"
    epp = container(docs)
    assert epp["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert epp["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    (election,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == "rel-epp-leader-election"]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"]}.items() <= election["rules"][0].items()
    (binding,) = [b for b in by_kind(docs, "RoleBinding") if b["roleRef"]["name"] == "rel-epp-leader-election"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-epp", "namespace": "ns"}]
    single = picker_docs(helm_binary, helm_env, tmp_path, {})
    assert "ha-enable-leader-election" not in flags(single)
    assert [r["metadata"]["name"] for r in by_kind(single, "Role")] == ["rel-epp"]


def test_workers_pass_the_flag_and_refuse_several_replicas(helm_binary, helm_env, tmp_path) -> None:
    assert "workers" not in flags(picker_docs(helm_binary, helm_env, tmp_path, {}))
    assert flags(picker_docs(helm_binary, helm_env, tmp_path, {"inferenceExtension": {"workers": 2}}))["workers"] == "2"
    values = values_file(tmp_path, {"inferenceExtension": {"workers": 2, "replicas": 2}})
    both = subprocess.run(
        [str(helm_binary), "template", "rel", str(CHART), "-f", str(values)],
        env=helm_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert both.returncode != 0 and "inferenceExtension.workers > 1 needs replicas: 1" in both.stderr


def test_flags_override_the_charts_own_and_keep_whole_numbers(helm_binary, helm_env, tmp_path) -> None:
    values = {"inferenceExtension": {"flags": {"v": 3, "max-body-bytes": 16777216, "tracing": True, "ratio": 0.5}}}
    rendered = flags(picker_docs(helm_binary, helm_env, tmp_path, values))
    assert rendered["v"] == "3"
    assert rendered["max-body-bytes"] == "16777216"
    assert rendered["tracing"] == "true"
    assert rendered["ratio"] == "0.5"


def test_a_reference_epp_image_is_replaced_by_the_pickers(helm_binary, helm_env, tmp_path) -> None:
    reference = {"registry": "registry.k8s.io", "repository": "gateway-api-inference-extension/epp", "tag": "v1.5.0"}
    epp = container(picker_docs(helm_binary, helm_env, tmp_path, {"inferenceExtension": {"image": reference}}))
    assert (epp["image"], epp["imagePullPolicy"]) == (chart_image(), "IfNotPresent")
    own = {"registry": "registry.example", "repository": "team/picker", "tag": "2.0", "pullPolicy": "Always"}
    epp = container(picker_docs(helm_binary, helm_env, tmp_path, {"inferenceExtension": {"image": own}}))
    assert (epp["image"], epp["imagePullPolicy"]) == ("registry.example/team/picker:2.0", "Always")


def test_istio_rule_uses_tls_only_while_the_picker_serves_tls(helm_binary, helm_env, tmp_path) -> None:
    def rule(values: dict[str, Any]) -> dict[str, Any]:
        return one(picker_docs(helm_binary, helm_env, tmp_path, values), "DestinationRule")["spec"]

    tls = rule({"provider": {"name": "istio"}})
    assert tls == {
        "host": "rel-epp.ns.svc.cluster.local",
        "trafficPolicy": {"tls": {"mode": "SIMPLE", "insecureSkipVerify": True}},
    }
    assert rule({"provider": {"name": "istio"}, "inferenceExtension": {"secureServing": False}}) == {
        "host": "rel-epp.ns.svc.cluster.local"
    }
    pool = {"http": {"http2MaxRequests": 10}}
    plaintext_pooled = rule(
        {
            "provider": {"name": "istio", "istio": {"destinationRule": {"trafficPolicy": {"connectionPool": pool}}}},
            "inferenceExtension": {"secureServing": False},
        }
    )
    assert plaintext_pooled["trafficPolicy"] == {"connectionPool": pool}


def test_metrics_auth_brings_its_rbac_and_the_monitor_its_token(helm_binary, helm_env, tmp_path) -> None:
    default = picker_docs(helm_binary, helm_env, tmp_path, {})
    role = one(default, "ClusterRole")
    assert role["metadata"]["name"] == "rel-ns-epp"
    assert {
        (tuple(r.get("apiGroups", ())), tuple(r.get("resources", r.get("nonResourceURLs")))) for r in role["rules"]
    } == {
        (("authentication.k8s.io",), ("tokenreviews",)),
        (("authorization.k8s.io",), ("subjectaccessreviews",)),
        ((), ("/metrics",)),
    }
    assert one(default, "ClusterRoleBinding")["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-epp", "namespace": "ns"}
    ]

    monitored = picker_docs(
        helm_binary, helm_env, tmp_path, {"inferenceExtension": {"monitoring": {"prometheus": {"enabled": True}}}}
    )
    secret = one(monitored, "Secret")
    assert secret["metadata"]["name"] == "inference-gateway-sa-metrics-reader-secret"
    assert secret["metadata"]["annotations"] == {"kubernetes.io/service-account.name": "rel-epp"}
    assert secret["type"] == "kubernetes.io/service-account-token"
    (endpoint,) = one(monitored, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "credentials": {"name": "inference-gateway-sa-metrics-reader-secret", "key": "token"}
    }
    assert endpoint["relabelings"] == [{"targetLabel": "inference_pool", "replacement": "rel"}]

    open_metrics = picker_docs(
        helm_binary,
        helm_env,
        tmp_path,
        {"inferenceExtension": {"monitoring": {"prometheus": {"enabled": True, "auth": {"enabled": False}}}}},
    )
    assert flags(open_metrics)["metrics-endpoint-auth"] == "false"
    assert not by_kind(open_metrics, "ClusterRole") and not by_kind(open_metrics, "Secret")
    assert "authorization" not in one(open_metrics, "ServiceMonitor")["spec"]["endpoints"][0]


@pytest.mark.parametrize("autopilot, collector_namespace", [(False, "gmp-system"), (True, "gke-gmp-system")])
def test_gke_scrapes_with_pod_monitoring_as_the_reference(
    autopilot, collector_namespace, helm_binary, helm_env, tmp_path
) -> None:
    values = {
        "provider": {"name": "gke", "gke": {"autopilot": autopilot}},
        "inferenceExtension": {"monitoring": {"prometheus": {"enabled": True}}},
    }
    docs = picker_docs(helm_binary, helm_env, tmp_path, values)
    assert not by_kind(docs, "ServiceMonitor")
    monitoring = one(docs, "PodMonitoring")["spec"]
    (endpoint,) = monitoring["endpoints"]
    assert endpoint["authorization"]["credentials"]["secret"] == {"name": "rel-metrics-reader-secret", "key": "token"}
    assert monitoring["selector"]["matchLabels"] == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    (reader,) = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"] == "rel-metrics-reader-secret"]
    assert reader["metadata"]["annotations"] == {"kubernetes.io/service-account.name": "rel-metrics-reader-sa"}
    (collector,) = [b for b in by_kind(docs, "RoleBinding") if b["roleRef"]["name"] == "rel-metrics-reader-secret-read"]
    assert collector["subjects"] == [{"kind": "ServiceAccount", "name": "collector", "namespace": collector_namespace}]


def test_default_config_is_the_reference_one_with_the_data_layer_values(helm_binary, helm_env, tmp_path) -> None:
    """The rendered default-plugins.yaml is accepted by `picker config validate`, and `show`
    has the engine, the scrape settings and the parser the values name."""
    cases = [
        ({}, "vllm", ("http", "/metrics", True), None),
        ({"inferencePool": {"modelServerType": "sglang"}}, "sglang", ("http", "/metrics", True), None),
        (
            {"inferencePool": {"modelServerType": "trtllm-serve"}},
            "trtllm-serve",
            ("http", "/prometheus/metrics", True),
            None,
        ),
        (
            {
                "inferencePool": {"modelServerType": "triton-tensorrt-llm", "parser": "openai-parser"},
                "inferenceExtension": {
                    "metricsDataSource": {"scheme": "https", "path": "/custom", "insecureSkipVerify": False}
                },
            },
            "triton-tensorrt-llm",
            ("https", "/custom", False),
            "openai-parser",
        ),
    ]
    for values, engine, (scheme, path, insecure), parser in cases:
        config = tmp_path / "default-plugins.yaml"
        config.write_text(one(picker_docs(helm_binary, helm_env, tmp_path, values), "ConfigMap")["data"][config.name])
        assert ("parser" in yaml.safe_load(config.read_text())) == (parser is not None)
        picker = [sys.executable, "-m", "picker.cli", "config"]
        subprocess.run([*picker, "validate", str(config)], check=True, capture_output=True, timeout=60)
        shown = yaml.safe_load(
            subprocess.run(
                [*picker, "show", "--config-file", str(config)], check=True, capture_output=True, text=True, timeout=60
            ).stdout
        )
        plugins = {p["type"]: p.get("parameters", {}) for p in shown["plugins"]}
        assert plugins["core-metrics-extractor"]["defaultEngine"] == engine
        assert plugins["metrics-data-source"] == {"scheme": scheme, "path": path, "insecureSkipVerify": insecure}
        assert shown["parser"] == {"pluginRef": parser or "openai-parser"}  # picker's default parser


def test_the_latency_predictor_values_give_the_reference_charts_latency_config(helm_binary, helm_env, tmp_path) -> None:
    """`latencyPredictor.enabled` renders the config the reference chart renders for it
    (tests/data/reference_configs/chart-latency-predictor.yaml), with the same meaning, and
    deploys no sidecar."""
    docs = picker_docs(helm_binary, helm_env, tmp_path, {"inferenceExtension": {"latencyPredictor": {"enabled": True}}})
    rendered = one(docs, "ConfigMap")["data"]["default-plugins.yaml"]
    reference = Path(__file__).parents[1] / "data" / "reference_configs" / "chart-latency-predictor.yaml"
    assert build(parse_text(rendered)).config == build(parse_text(reference.read_text())).config
    assert [c["name"] for c in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]] == ["epp"]


def test_the_grpc_protocol_values_give_the_reference_charts_grpc_config(helm_binary, helm_env, tmp_path) -> None:
    """`modelServerProtocol: grpc` renders the config the reference chart renders for vLLM's
    gRPC API (tests/data/reference_configs/chart-grpc.yaml) and an h2c pool, as the reference."""
    docs = picker_docs(helm_binary, helm_env, tmp_path, {"inferencePool": {"modelServerProtocol": "grpc"}})
    rendered = one(docs, "ConfigMap")["data"]["default-plugins.yaml"]
    reference = Path(__file__).parents[1] / "data" / "reference_configs" / "chart-grpc.yaml"
    assert build(parse_text(rendered)).config == build(parse_text(reference.read_text())).config
    assert one(docs, "InferencePool")["spec"]["appProtocol"] == "kubernetes.io/h2c"


def test_tracing_sets_the_standard_otel_variables(helm_binary, helm_env, tmp_path) -> None:
    values = {"inferenceExtension": {"tracing": {"enabled": True, "otelExporterEndpoint": "http://collector:4317"}}}
    docs = picker_docs(helm_binary, helm_env, tmp_path, values)
    env = {e["name"]: e.get("value") for e in container(docs)["env"]}
    assert flags(docs)["tracing"] == "true"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    assert (env["OTEL_TRACES_SAMPLER"], env["OTEL_TRACES_SAMPLER_ARG"]) == ("parentbased_traceidratio", "0.1")
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in {
        e["name"] for e in container(picker_docs(helm_binary, helm_env, tmp_path, {}))["env"]
    }


def test_the_sidecar_runs_beside_the_picker_with_its_files(helm_binary, helm_env, tmp_path) -> None:
    docs = picker_docs(helm_binary, helm_env, tmp_path, {"inferenceExtension": {"sidecar": SIDECAR}})
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    epp, proxy = pod["containers"]
    assert epp["name"] == "epp"
    assert proxy["name"] == "proxy" and proxy["image"] == SIDECAR["image"]
    assert proxy["command"] == ["envoy"] and proxy["args"] == SIDECAR["args"]
    for key in ("env", "ports", "livenessProbe", "readinessProbe", "resources", "volumeMounts"):
        assert proxy[key] == SIDECAR[key], key
    assert {"name": "envoy-config", "configMap": {"name": "rel-envoy"}} in pod["volumes"]
    (files,) = [c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"] == "rel-envoy"]
    assert files["data"] == SIDECAR["configMap"]["data"]


def test_env_may_be_a_list_or_a_map(helm_binary, helm_env, tmp_path) -> None:
    for env in ([{"name": "A", "value": "1"}], {"A": "1"}):
        rendered = container(picker_docs(helm_binary, helm_env, tmp_path, {"inferenceExtension": {"env": env}}))["env"]
        assert rendered[-1] == {"name": "A", "value": "1"}


def test_the_route_matches_the_base_model_and_leaves_the_timeout_to_gke(helm_binary, helm_env, tmp_path) -> None:
    route = {"enabled": True, "baseModel": "llama"}
    rule = one(picker_docs(helm_binary, helm_env, tmp_path, {"experimentalHttpRoute": route}), "HTTPRoute")["spec"][
        "rules"
    ][0]
    assert rule["matches"][0]["headers"] == [{"type": "Exact", "name": "X-Gateway-Base-Model-Name", "value": "llama"}]
    assert rule["timeouts"] == {"request": "300s"}
    gke = picker_docs(helm_binary, helm_env, tmp_path, {"experimentalHttpRoute": route, "provider": {"name": "gke"}})
    assert "timeouts" not in one(gke, "HTTPRoute")["spec"]["rules"][0]


def test_the_grafana_dashboard_configmap_carries_the_shipped_dashboard(helm_binary, helm_env, tmp_path) -> None:
    values = {"inferenceExtension": {"monitoring": {"grafanaDashboard": {"enabled": True}}}}
    docs = picker_docs(helm_binary, helm_env, tmp_path, values)
    (dashboard,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rel-epp-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["picker.json"]) == json.loads(
        (CHART / "dashboards" / "picker.json").read_text()
    )


def test_rbac_is_least_privilege_for_each_mode(helm_binary, helm_env, tmp_path) -> None:
    def rules(values: dict[str, Any]) -> list[dict[str, Any]]:
        docs = picker_docs(helm_binary, helm_env, tmp_path, values)
        (role,) = [d for d in by_kind(docs, "Role") if d["metadata"]["name"] == "rel-epp"]
        return role["rules"]

    def resources(values: dict[str, Any]) -> set[str]:
        return {resource for rule in rules(values) for resource in rule["resources"]}

    for rule in rules({}):
        assert set(rule["verbs"]) == {"get", "list", "watch"}, rule
    pool_kinds = {"inferencepools", "inferenceobjectives", "inferencemodelrewrites"}
    assert resources({}) == {"pods", *pool_kinds, "configmaps"}
    assert resources({"inferenceExtension": {"configSource": "file"}}) == {"pods", *pool_kinds}
    assert resources({"inferencePool": {"standalone": True}}) == {"pods", "configmaps"}
    legacy = rules({"inferencePool": {"apiVersion": "inference.networking.x-k8s.io/v1alpha2"}})
    assert [r["apiGroups"] for r in legacy if r["resources"] == ["inferencepools"]] == [
        ["inference.networking.x-k8s.io"]
    ]


def test_a_built_in_config_is_one_value_away_and_read_from_the_image(helm_binary, helm_env, tmp_path) -> None:
    """`pluginsConfigFile: picker-best.yaml` alone runs the image's built-in picker-best (no
    ConfigMap, no ConfigMap access, whatever configSource); a custom config of that name wins."""
    for source in ("api", "file"):
        values = {"inferenceExtension": {"pluginsConfigFile": "picker-best.yaml", "configSource": source}}
        docs = picker_docs(helm_binary, helm_env, tmp_path, values)
        args = flags(docs)
        assert args["config-file"] == "picker-best.yaml" and "config-map" not in args
        assert not [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "rel-epp"]
        (role,) = [d for d in by_kind(docs, "Role") if d["metadata"]["name"] == "rel-epp"]
        assert "configmaps" not in {resource for rule in role["rules"] for resource in rule["resources"]}
        pod = one(docs, "Deployment")["spec"]["template"]["spec"]
        assert [v["name"] for v in pod["volumes"]] == ["tmp"]
        assert [m["mountPath"] for m in container(docs)["volumeMounts"]] == ["/tmp"]
    # what the picker makes of that flag in its pod: the built-in config
    options = serve_options(
        build_parser().parse_args(["--endpoints", "10.0.0.1:8000", "--config-file", args["config-file"]])
    )
    assert options.scheduling.config_file == str(BUILTIN_DIR / "picker-best.yaml")
    custom = {
        "inferenceExtension": {
            "pluginsConfigFile": "picker-best.yaml",
            "pluginsCustomConfig": {"picker-best.yaml": CUSTOM_CONFIG},
        }
    }
    docs = picker_docs(helm_binary, helm_env, tmp_path, custom)
    assert flags(docs)["config-map"] == "rel-epp"
    assert one(docs, "ConfigMap")["data"]["picker-best.yaml"].strip() == CUSTOM_CONFIG.strip()


def test_the_charts_built_in_names_are_the_packages(helm_binary, helm_env, tmp_path) -> None:
    result = subprocess.run(
        [
            str(helm_binary),
            "template",
            "rel",
            str(CHART),
            "--set",
            "inferenceExtension.pluginsConfigFile=picker-bset.yaml",
        ],
        env=helm_env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode != 0
    listed = re.search(r"nor a built-in config \(([^)]*)\)", result.stderr)
    assert listed, result.stderr
    assert tuple(listed.group(1).split(", ")) == builtin_names()


@pytest.mark.parametrize(
    "values, message",
    [
        ({"inferencePool": {"targetPorts": [{"number": 8000 + i} for i in range(9)]}}, "maxItems"),
        ({"inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8000}]}}, "are equal"),
        ({"inferencePool": {"modelServers": {"matchLabels": None}}}, "matchLabels"),
        ({"inferencePool": {"targetPorts": [{"number": 0}]}}, "minimum"),
        ({"inferenceExtension": {"configSource": "etcd"}}, "configSource"),
        ({"inferenceExtension": {"pluginsConfigFile": "missing.yaml"}}, "pluginsCustomConfig"),
        ({"inferenceExtension": {"bogus": 1}}, "bogus"),
        ({"inferencePool": {"modelServerType": "tgi"}}, "modelServerType"),
        ({"inferencePool": {"targetPortNumber": 8001}}, "targetPortNumber (8001"),
        ({"inferenceExtension": {"sidecar": {"enabled": True, "name": "proxy"}}}, "name and image are required"),
        (
            {"inferenceExtension": {"sidecar": {"enabled": True}, "secureServing": False}},
            "the shipped Envoy config reaches the picker at 127.0.0.1:9002 over TLS",
        ),
        ({"inferenceExtension": {"sidecar": {"enabled": True}, "extProcPort": 9100}}, "keep extProcPort 9002"),
        ({"inferenceExtension": {"endpointsServer": {"targetPorts": [8000]}}}, "targetPorts"),
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


def test_state_store_values_pass_the_flag_and_the_password_from_a_secret(helm_binary, helm_env, tmp_path) -> None:
    assert "state-store" not in flags(picker_docs(helm_binary, helm_env, tmp_path, {}))
    store = {"url": "rediss://picker@redis.cache:6380/1", "passwordSecret": {"name": "redis-auth", "key": "pw"}}
    docs = picker_docs(helm_binary, helm_env, tmp_path, {"inferenceExtension": {"stateStore": store}})
    assert flags(docs)["state-store"] == "rediss://picker@redis.cache:6380/1"
    env = {e["name"]: e for e in container(docs)["env"]}
    assert env["PICKER_STATE_STORE_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "redis-auth", "key": "pw"}}
    # a password in the URL would sit in the pod spec: the schema refuses it
    values = values_file(tmp_path, {"inferenceExtension": {"stateStore": {"url": "redis://:secret@redis:6379"}}})
    refused = subprocess.run(
        [str(helm_binary), "template", "rel", str(CHART), "-f", str(values)],
        env=helm_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "stateStore" in refused.stderr
