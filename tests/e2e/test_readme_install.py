"""README's "Install into a cluster" commands, run as written against the real API server, and
the names they wire together checked on the objects they create: the HTTPRoute's pool is the one
the chart creates, the pool selects the example model servers on their port and points at the
picker's Service, the InferenceObjectives and the InferenceModelRewrite name that pool.

`kubectl apply -f` is done as a server-side apply through the API (kubectl itself is not a test
dependency); `make image` needs a container engine, which tests/unit/test_image.py stands in for;
no kubelet runs, so the objects are checked, not the pods."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, dynamic

from picker_bench.kube_resources import load_documents
from tests.e2e.charts import chart_image, install_third_party_crds
from tests.e2e.conftest import ROOT
from tests.e2e.helm_cli import helm

README = ROOT / "README.md"


def install_commands() -> list[list[str]]:
    """The shell commands of README's install block, comments dropped, continuations joined."""
    text = README.read_text()
    section = text[text.index("## Install into a cluster") :].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [words for line in block.splitlines() if (words := shlex.split(line, comments=True))]


def apply(api: client.ApiClient, path: Path) -> list[dict[str, Any]]:
    """`kubectl apply -f PATH` (a file, or every YAML file of a directory): server-side apply."""
    files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    docs = load_documents(files)
    dyn = dynamic.DynamicClient(api)
    for doc in docs:
        resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        namespace = doc["metadata"].get("namespace", "default") if resource.namespaced else None
        dyn.server_side_apply(resource, body=doc, namespace=namespace, field_manager="readme", force_conflicts=True)
    return docs


@pytest.fixture(scope="module")
def installed(kube_cluster, admin_api, helm_binary, helm_env) -> dict[str, list[dict[str, Any]]]:
    """Runs the README's commands; returns what each `kubectl apply` applied, by file name."""
    install_third_party_crds(admin_api)  # the Gateway API's kinds, which the cluster would have
    applied: dict[str, list[dict[str, Any]]] = {}
    commands = install_commands()
    assert {words[0] for words in commands} == {"make", "kind", "kubectl", "helm"}, commands
    for words in commands:
        match words:
            case ["make", "image"]:
                pass
            case ["kind", "load", "docker-image", image]:
                assert image == chart_image()
            case ["kubectl", "apply", "-f", path]:
                applied[Path(path).name] = apply(admin_api, ROOT / path)
            case ["helm", "install", release, chart, *options]:
                helm(helm_binary, helm_env, "install", release, str(ROOT / chart), *options, kube=kube_cluster)
            case _:
                pytest.fail(f"README install step not understood: {shlex.join(words)}")
    return applied


def get(api: client.ApiClient, api_version: str, kind: str, name: str, namespace: str = "default") -> Any:
    return dynamic.DynamicClient(api).resources.get(api_version=api_version, kind=kind).get(name, namespace).to_dict()


def test_the_readme_install_wires_route_pool_picker_and_model_servers(installed, admin_api) -> None:
    (gateway,) = [d for d in installed["gateway.yaml"] if d["kind"] == "Gateway"]
    (route,) = [d for d in installed["gateway.yaml"] if d["kind"] == "HTTPRoute"]
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    pool = get(admin_api, "inference.networking.k8s.io/v1", "InferencePool", backend["name"])  # the chart's

    (servers,) = installed["vllm-deployment.yaml"]
    pod = servers["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    served = {port["containerPort"] for container in pod["spec"]["containers"] for port in container["ports"]}
    assert {port["number"] for port in pool["spec"]["targetPorts"]} <= served

    picker = pool["spec"]["endpointPickerRef"]
    service = client.CoreV1Api(admin_api).read_namespaced_service(picker["name"], "default")
    (ext_proc,) = [p for p in service.spec.ports if p.port == picker["port"]["number"]]
    deployment = client.AppsV1Api(admin_api).read_namespaced_deployment(picker["name"], "default")
    assert service.spec.selector.items() <= deployment.spec.template.metadata.labels.items()
    (epp,) = deployment.spec.template.spec.containers
    assert ext_proc.target_port in {p.name for p in epp.ports}
    assert epp.image == chart_image()

    for resource in installed["inferenceobjectives.yaml"] + installed["inferencemodelrewrite.yaml"]:
        assert resource["spec"]["poolRef"]["name"] == backend["name"]


def test_the_example_pool_file_is_the_pool_the_chart_creates(installed, kube_cluster, helm_binary, helm_env) -> None:
    """manifests/examples/inferencepool.yaml stands for the chart's pool (inferencePool.create=false)."""
    (example,) = yaml.safe_load_all((ROOT / "manifests" / "examples" / "inferencepool.yaml").read_text())
    release = helm(helm_binary, helm_env, "get", "manifest", example["metadata"]["name"], kube=kube_cluster)
    (created,) = [d for d in yaml.safe_load_all(release) if d and d["kind"] == "InferencePool"]
    assert created["spec"] == example["spec"]
