"""The reference EPP's chart values (v1.5.0) in charts/picker, as a platform team migrating
would pass them: the reference inferencepool chart's own values.yaml, alone and with its epplib
library chart's values.

Each is linted, rendered, validated with `kubernetes-validate --strict` and installed with
`helm install` into the real API server; then `picker serve` runs with the installed
Deployment's own arguments and environment (as the kubelet would start the container: the
ServiceAccount's token, loopback ports in place of the pod's) and must answer every gRPC probe
the Deployment declares SERVING. The reference chart itself, rendered with the same values, is
the oracle for what picker's chart must render the same way (probes, ports, pool, RBAC,
monitoring, tracing, sidecar)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2
from kubernetes import client

from picker_bench.gobuild import GoModuleUnavailableError
from picker_bench.process import wait_until
from tests.e2e.charts import (
    by_kind,
    chart_image,
    epplib_values,
    lint_validate_install,
    one,
    reference_chart,
    reference_values,
    render,
    values_file,
)
from tests.e2e.conftest import CHART
from tests.e2e.helm_cli import helm
from tests.e2e.kube_resources import create_namespace, service_account_kubeconfig
from tests.e2e.kube_stack import run_like_the_kubelet
from tests.stack import health_status

SERVING = health_pb2.HealthCheckResponse.SERVING
PROBE_DEADLINE = 30.0


@pytest.fixture(scope="module")
def reference_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The reference values files: inferencepool's values.yaml as it is; epplib's values.yaml as
    it is (its keys at the top level, where a user passing it would put them) and as the
    reference chart reads it (under inferenceExtension, its alias)."""
    directory = tmp_path_factory.mktemp("reference-values")
    try:
        inferencepool = reference_values()
        epplib = epplib_values()
    except GoModuleUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)
    return {
        "inferencepool": inferencepool,
        "epplib": values_file(directory, epplib, "epplib-values.yaml"),
        "epplib-aliased": values_file(directory, {"inferenceExtension": epplib}, "epplib-aliased.yaml"),
        "ha": values_file(directory, {"inferenceExtension": {"replicas": 2}}, "ha.yaml"),
    }


# name → the values files, in order (later files override earlier ones, as with helm -f).
VALUE_SETS = {
    "inferencepool-values": ["inferencepool"],
    "with-epplib-values-ha": ["inferencepool", "epplib", "epplib-aliased", "ha"],
}


@pytest.fixture(scope="module")
def reference(helm_binary: Path, helm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return reference_chart(helm_binary, helm_env, tmp_path_factory.mktemp("reference-chart"))
    except GoModuleUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


def epp_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = [c for c in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"] if c["name"] == "epp"]
    return container


def probes(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {kind: container[kind] for kind in ("livenessProbe", "readinessProbe")}


def probe_statuses(container: client.V1Container, local: Callable[[int], int]) -> dict[str, str]:
    """Each gRPC probe's service name → the health status the running picker answers for it."""
    statuses = {}
    for probe in (container.liveness_probe, container.readiness_probe):
        try:
            status = health_status(local(probe.grpc.port), probe.grpc.service)
            statuses[probe.grpc.service] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as exc:
            statuses[probe.grpc.service] = f"unanswered ({exc.code().name})"
    return statuses


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_reference_values_install_validate_and_the_probes_answer_serving(
    value_set, reference_files, kube_cluster, admin_api, helm_binary, helm_env, third_party_crds, tmp_path
) -> None:
    files = [reference_files[name] for name in VALUE_SETS[value_set]]
    namespace = lint_validate_install(
        helm_binary, helm_env, kube_cluster, admin_api, files, f"reference-{value_set}", CHART
    )
    deployment = client.AppsV1Api(admin_api).read_namespaced_deployment("rel-epp", namespace)
    kubeconfig = service_account_kubeconfig(
        admin_api, kube_cluster, namespace, deployment.spec.template.spec.service_account_name, tmp_path / "sa"
    )
    picker, local = run_like_the_kubelet(deployment, namespace, kubeconfig, tmp_path)
    try:
        container = deployment.spec.template.spec.containers[0]
        try:
            wait_until(
                lambda: set(probe_statuses(container, local).values()) == {"SERVING"},
                PROBE_DEADLINE,
                "every probe to answer SERVING",
            )
        except TimeoutError:
            pass  # the assertion below says which probe answered what
        assert picker.alive(), picker.log_tail()
        statuses = probe_statuses(container, local)
        assert set(statuses.values()) == {"SERVING"}, f"probe answers: {statuses}\n{picker.log_tail()}"
    finally:
        picker.stop()


def test_every_grpc_health_service_the_reference_chart_probes_is_covered(reference, helm_binary, helm_env, tmp_path):
    """The two value sets above exercise every service name the reference chart probes."""
    covered = set()
    for replicas in (1, 2):
        values = values_file(tmp_path, {"inferenceExtension": {"replicas": replicas}}, "replicas.yaml")
        docs = render(helm_binary, helm_env, reference, [reference_values(), modelservers(tmp_path), values])
        covered |= {p["grpc"]["service"] for p in probes(epp_container(docs)).values()}
    assert covered == {"inference-extension", "liveness", "readiness"}


def modelservers(directory: Path) -> Path:
    """The one value the reference chart requires that its values.yaml leaves out."""
    labels = {"inferencePool": {"modelServers": {"matchLabels": {"app": "vllm-llama3-8b-instruct"}}}}
    return values_file(directory, labels, "modelservers.yaml")


# Values on top of the reference values.yaml, each turning on reference options, rendered by both
# charts and compared where picker's chart must render the same way.
PARITY_CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "ha": {"inferenceExtension": {"replicas": 3}},
    "prometheus": {
        "inferenceExtension": {"monitoring": {"prometheus": {"enabled": True, "extraLabels": {"release": "kps"}}}}
    },
    "gke-monitoring": {
        "provider": {"name": "gke", "gke": {"autopilot": True}},
        "inferenceExtension": {"monitoring": {"prometheus": {"enabled": True}}},
    },
    "tracing-sidecar": {
        "inferenceExtension": {
            "tracing": {"enabled": True, "otelExporterEndpoint": "http://otel:4317"},
            "sidecar": {
                "enabled": True,
                "name": "proxy",
                "image": "envoyproxy/envoy:v1.36.0",
                "args": ["-c", "/etc/envoy/envoy.yaml"],
                "ports": [{"containerPort": 8081}],
                "volumeMounts": [{"name": "cfg", "mountPath": "/etc/envoy"}],
                "configMap": {"name": "envoy", "data": {"envoy.yaml": "admin: {}\n"}},
            },
        }
    },
    # insecureSkipVerify stays at its default here: the reference renders `false | default true`,
    # i.e. true; picker's chart keeps false (test_chart.py checks it).
    "engines": {
        "inferencePool": {"modelServerType": "sglang", "parser": "openai-parser", "targetPorts": [{"number": 8001}]},
        "inferenceExtension": {"metricsDataSource": {"scheme": "https", "path": "/m"}},
    },
    "istio": {
        "provider": {
            "name": "istio",
            "istio": {"destinationRule": {"trafficPolicy": {"connectionPool": {"http": {"http2MaxRequests": 9}}}}},
        }
    },
    "route": {"experimentalHttpRoute": {"enabled": True, "baseModel": "llama", "inferenceGatewayName": "gw"}},
}


LEGACY_ENGINE_FLAGS = (
    "total-queued-requests-metric",
    "total-running-requests-metric",
    "kv-cache-usage-percentage-metric",
    "lora-info-metric",
    "cache-info-metric",
    "model-server-metrics-path",
)


def go_flags(args: list[str]) -> dict[str, str]:
    """Command-line flags as Go's flag package reads them: --name=value, --name value, or a bare
    --name (true)."""
    flags = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, equals, value = arg[2:].partition("=")
        if not equals:
            following = args[i + 1] if i + 1 < len(args) else "--"
            value = "true" if following.startswith("--") else following
        flags[name] = value
    return flags


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_renders_what_the_reference_chart_renders(case, reference, helm_binary, helm_env, tmp_path) -> None:
    values = [reference_values(), modelservers(tmp_path), values_file(tmp_path, PARITY_CASES[case], "case.yaml")]
    ours = render(helm_binary, helm_env, CHART, values)
    theirs = render(helm_binary, helm_env, reference, values)
    our_epp, their_epp = epp_container(ours), epp_container(theirs)

    assert probes(our_epp) == probes(their_epp)
    assert our_epp["ports"] == their_epp["ports"]
    assert our_epp["resources"] == their_epp["resources"]
    our_env = {e["name"]: e for e in our_epp["env"]}
    assert [e for e in their_epp["env"] if our_env.get(e["name"]) != e] == []
    for key in ("strategy", "replicas", "selector"):
        assert one(ours, "Deployment")["spec"][key] == one(theirs, "Deployment")["spec"][key]
    our_pod, their_pod = (one(docs, "Deployment")["spec"]["template"]["spec"] for docs in (ours, theirs))
    assert our_pod["terminationGracePeriodSeconds"] == their_pod["terminationGracePeriodSeconds"]
    assert [c for c in our_pod["containers"] if c["name"] != "epp"] == [
        c for c in their_pod["containers"] if c["name"] != "epp"
    ]

    # Every flag the reference passes, picker's chart passes with the same value, except the
    # config file (picker reads the same ConfigMap through the API, configSource api) and the
    # legacy metric flags the reference adds for non-vLLM engines (the v1.5.0 binary refuses
    # them; both charts name the engine in the config's core-metrics-extractor instead).
    their_flags = go_flags(their_epp["args"])
    their_flags.pop("config-file")
    for legacy in LEGACY_ENGINE_FLAGS:
        their_flags.pop(legacy, None)
    assert their_flags.items() <= go_flags(our_epp["args"][1:]).items()

    our_service, their_service = one(ours, "Service"), one(theirs, "Service")
    assert {(p["name"], p["port"]) for p in their_service["spec"]["ports"]} <= {
        (p["name"], p["port"]) for p in our_service["spec"]["ports"]
    }
    assert our_service["metadata"]["name"] == their_service["metadata"]["name"]
    assert our_service["spec"]["selector"] == their_service["spec"]["selector"]
    assert one(ours, "InferencePool")["spec"] == one(theirs, "InferencePool")["spec"]

    # The default config: the reference's, data layer and parser included.
    def default_config(docs: list[dict[str, Any]]) -> Any:
        (config_map,) = [c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"] == "rel-epp"]
        return yaml.safe_load(config_map["data"]["default-plugins.yaml"])

    assert default_config(ours) == default_config(theirs)

    for kind in ("ServiceMonitor", "PodMonitoring", "DestinationRule", "HTTPRoute"):
        assert len(by_kind(ours, kind)) == len(by_kind(theirs, kind)), kind
    if by_kind(theirs, "ServiceMonitor"):
        (our_endpoint,), (their_endpoint,) = (one(d, "ServiceMonitor")["spec"]["endpoints"] for d in (ours, theirs))
        assert {k: v for k, v in our_endpoint.items() if k != "relabelings"} == their_endpoint
        assert {"release": "kps"}.items() <= one(ours, "ServiceMonitor")["metadata"]["labels"].items()
    if by_kind(theirs, "PodMonitoring"):
        our_monitoring, their_monitoring = (one(d, "PodMonitoring")["spec"] for d in (ours, theirs))
        assert our_monitoring["endpoints"] == their_monitoring["endpoints"]
    for kind in ("Secret", "ServiceAccount", "ClusterRole"):
        their_names = {d["metadata"]["name"] for d in by_kind(theirs, kind)}
        assert their_names <= {d["metadata"]["name"] for d in by_kind(ours, kind)}, kind
    their_rules = {yaml.safe_dump(r["rules"]) for r in by_kind(theirs, "ClusterRole")}
    assert their_rules <= {yaml.safe_dump(r["rules"]) for r in by_kind(ours, "ClusterRole")}
    their_election = [r["rules"] for r in by_kind(theirs, "Role") if r["metadata"]["name"].endswith("leader-election")]
    our_election = [r["rules"] for r in by_kind(ours, "Role") if r["metadata"]["name"].endswith("leader-election")]
    assert our_election == their_election
    if by_kind(theirs, "DestinationRule"):
        assert one(ours, "DestinationRule")["spec"] == one(theirs, "DestinationRule")["spec"]
    if by_kind(theirs, "HTTPRoute"):
        assert one(ours, "HTTPRoute")["spec"] == one(theirs, "HTTPRoute")["spec"]
    their_files = [c["data"] for c in by_kind(theirs, "ConfigMap") if c["metadata"]["name"] == "envoy"]
    assert their_files == [c["data"] for c in by_kind(ours, "ConfigMap") if c["metadata"]["name"] == "envoy"]


def test_helm_upgrade_swaps_a_reference_release_for_picker_in_place(
    reference, kube_cluster, admin_api, helm_binary, helm_env, third_party_crds, tmp_path
) -> None:
    """The migration README describes: the reference chart's release, upgraded to charts/picker
    with the same values. The pool, the Service and the Deployment keep their names (and the
    Deployment its immutable selector), so routes and the gateway keep pointing at them."""
    namespace = create_namespace(admin_api, "swap")
    dash_f = ["-f", str(reference_values()), "-f", str(modelservers(tmp_path))]
    helm(helm_binary, helm_env, "install", "rel", str(reference), "-n", namespace, *dash_f, kube=kube_cluster)
    custom = client.CustomObjectsApi(admin_api)
    pool = ("inference.networking.k8s.io", "v1", namespace, "inferencepools", "rel")
    before = custom.get_namespaced_custom_object(*pool)["spec"]

    helm(helm_binary, helm_env, "upgrade", "rel", str(CHART), "-n", namespace, *dash_f, kube=kube_cluster)
    deployment = client.AppsV1Api(admin_api).read_namespaced_deployment("rel-epp", namespace)
    (epp,) = deployment.spec.template.spec.containers
    assert (epp.image, epp.args[0]) == (chart_image(), "serve")
    assert custom.get_namespaced_custom_object(*pool)["spec"] == before
    core = client.CoreV1Api(admin_api)
    assert core.read_namespaced_service("rel-epp", namespace).spec.selector == deployment.spec.selector.match_labels
    roles = client.RbacAuthorizationV1Api(admin_api).list_namespaced_role(namespace).items
    assert {role.metadata.name for role in roles} == {"rel-epp"}  # the reference's two Roles are gone


def leaf_keys(tree: Any, prefix: str = "") -> set[str]:
    """Dotted paths of a values tree's leaves (empty maps and lists are leaves)."""
    if isinstance(tree, dict) and tree:
        return {key for name, value in tree.items() for key in leaf_keys(value, f"{prefix}{name}.")}
    return {prefix.rstrip(".")}


def documented_keys() -> set[str]:
    """The reference keys charts/picker/README.md's compatibility table names (a row may name
    siblings as `.x` after a full key, and whole subtrees as `key.*`)."""
    text = (CHART / "README.md").read_text()
    table = text[text.index("## Reference chart values") :].split("\n## ", 1)[0]
    keys = set()
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", row.split(" | ")[0])
        parent = names[0].removesuffix(".*").rsplit(".", 1)[0]
        keys.add(names[0])
        keys |= {parent + name for name in names[1:] if name.startswith(".")}
    return keys


def test_the_compatibility_table_covers_every_reference_key() -> None:
    charts = reference_values().parents[1]
    keys = leaf_keys(yaml.safe_load(reference_values().read_text()))
    keys |= leaf_keys({"inferenceExtension": epplib_values()})
    keys |= leaf_keys(epplib_values())  # the epplib values.yaml passed directly
    keys |= leaf_keys(yaml.safe_load(reference_values("standalone").read_text()))
    readme = (charts / "inferencepool" / "README.md").read_text()
    keys |= {f"provider.{k}" if k.startswith("istio.") else k for k in re.findall(r"^\| `([^`]+)`", readme, re.M)}
    documented = documented_keys()

    def covered(key: str) -> bool:
        parts = key.split(".")
        prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        return bool(prefixes & documented) or any(f"{p}.*" in documented for p in prefixes)

    assert sorted(k for k in keys if not covered(k)) == []
