"""Rendering, validating and installing Helm charts in e2e tests: the picker chart, and the
reference EPP's inferencepool chart as an oracle."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from picker_bench.kube_cluster import KubeCluster
from picker_bench.kube_resources import apply_manifests, wait_crds_established
from picker_bench.reference_epp import reference_dir
from tests.e2e.helm_cli import helm
from tests.e2e.kube_resources import create_namespace

PICKER_CHART = Path(__file__).resolve().parents[2] / "charts" / "picker"
PICKER_BBR_CHART = PICKER_CHART.parent / "picker-bbr"

# Kinds other projects own, which some options render; the bare test API server gets
# schema-less CRDs for them so that `helm install` can create the objects.
THIRD_PARTY_KINDS = [
    ("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors"),
    ("monitoring.googleapis.com", "v1", "PodMonitoring", "podmonitorings"),
    ("networking.gke.io", "v1", "HealthCheckPolicy", "healthcheckpolicies"),
    ("networking.gke.io", "v1", "GCPBackendPolicy", "gcpbackendpolicies"),
    ("networking.istio.io", "v1", "DestinationRule", "destinationrules"),
    ("networking.istio.io", "v1alpha3", "EnvoyFilter", "envoyfilters"),
    ("networking.gke.io", "v1", "GCPRoutingExtension", "gcproutingextensions"),
    ("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes"),
    ("gateway.networking.k8s.io", "v1", "Gateway", "gateways"),
]


def chart_image(chart: Path = PICKER_CHART) -> str:
    """The image the picker chart runs with its default values."""
    image = yaml.safe_load((chart / "values.yaml").read_text())["inferenceExtension"]["image"]
    tag = image["tag"] or yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    return f"{image['registry']}/{image['repository']}:{tag}"


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


def install_third_party_crds(api: client.ApiClient) -> None:
    """The stand-in CRDs, once per API server (later calls find them there)."""
    existing = {crd.metadata.name for crd in client.ApiextensionsV1Api(api).list_custom_resource_definition().items}
    missing = [kind for kind in THIRD_PARTY_KINDS if f"{kind[3]}.{kind[0]}" not in existing]
    apply_manifests(api, [stub_crd(*kind) for kind in missing])
    wait_crds_established(api, [f"{plural}.{group}" for group, _, _, plural in THIRD_PARTY_KINDS])


def values_file(directory: Path, values: dict[str, Any], name: str = "values.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(values))
    return path


def render(
    helm_binary: Path, helm_env: dict[str, str], chart: Path, values: Iterable[Path], namespace: str = "ns"
) -> list[dict[str, Any]]:
    """`helm template rel CHART -n NAMESPACE -f ...`, as objects."""
    args = ["template", "rel", str(chart), "-n", namespace]
    for path in values:
        args += ["-f", str(path)]
    return [doc for doc in yaml.safe_load_all(helm(helm_binary, helm_env, *args)) if doc]


def validate_strict(manifest: Path) -> None:
    """kubernetes-validate --strict (unknown fields are errors; CRD kinds are not checked)."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "--no-warn", str(manifest)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, f"kubernetes-validate rejected {manifest}:\n{result.stdout}\n{result.stderr}"


def lint_validate_install(
    helm_binary: Path,
    helm_env: dict[str, str],
    kube: KubeCluster,
    api: client.ApiClient,
    values: Iterable[Path],
    prefix: str,
    chart: Path = PICKER_CHART,
) -> str:
    """`helm lint --strict`, the rendering validated strictly, then `helm install rel` into a
    fresh namespace (named from `prefix`), which is returned."""
    dash_f = [arg for path in values for arg in ("-f", str(path))]
    helm(helm_binary, helm_env, "lint", "--strict", str(chart), *dash_f)
    with tempfile.TemporaryDirectory(prefix="picker-chart-") as directory:
        manifest = Path(directory) / "rendered.yaml"
        manifest.write_text(helm(helm_binary, helm_env, "template", "rel", str(chart), "-n", "ns", *dash_f))
        validate_strict(manifest)
    namespace = create_namespace(api, prefix)
    helm(helm_binary, helm_env, "install", "rel", str(chart), "-n", namespace, *dash_f, kube=kube)
    return namespace


def reference_chart(helm_binary: Path, helm_env: dict[str, str], directory: Path, chart: str = "inferencepool") -> Path:
    """A reference chart (inferencepool or standalone), with its epplib dependency built in (a
    writable copy: the module cache is read-only)."""
    charts = reference_dir() / "config" / "charts"
    for name in (chart, "epplib"):
        shutil.copytree(charts / name, directory / name, copy_function=shutil.copyfile)
        copy = directory / name
        for path in (copy, *copy.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
    helm(helm_binary, helm_env, "dependency", "build", str(directory / chart))
    return directory / chart


def reference_values(chart: str = "inferencepool") -> Path:
    """A reference chart's own values.yaml (inferencepool's by default)."""
    return reference_dir() / "config" / "charts" / chart / "values.yaml"


def epplib_values() -> dict[str, Any]:
    """The epplib library chart's own values (they reach the reference templates under
    inferenceExtension, the dependency's alias)."""
    return yaml.safe_load((reference_dir() / "config" / "charts" / "epplib" / "values.yaml").read_text())


def by_kind(docs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: Iterable[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = by_kind(docs, kind)
    return doc
