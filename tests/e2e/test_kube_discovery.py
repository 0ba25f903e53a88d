"""KubernetesDiscovery against a real kube-apiserver, running with the chart's ServiceAccount
token (so the chart's RBAC is what it gets). Each test uses its own pod label, so pods left by
other tests never match."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kubernetes import client, config

from picker.datastore.store import Datastore
from picker.discovery.kube_reflector import KubeReflector
from picker.discovery.kubernetes import KubeCredentialsError, KubernetesDiscovery
from picker_bench.kube_resources import create_pod, put_pool, set_pod_ready, wait_crds_established
from picker_bench.process import wait_until
from tests.e2e.conftest import CHART
from tests.e2e.helm_cli import helm
from tests.e2e.kube_resources import create_namespace, delete_pod, patch_config_map, service_account_kubeconfig

CHANGE_DEADLINE = 1.0  # the acceptance bound for a pod change to reach the datastore
START_DEADLINE = 10.0  # first list after start, on a shared 2-core machine

_ids = itertools.count(1)
_ips = itertools.count(0)


async def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> None:
    """Poll `condition` on the loop (discovery callbacks run in between) for up to `timeout` s."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.005)


def addresses(datastore: Datastore) -> set[str]:
    return set(datastore.endpoints())


async def api_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Blocking client calls run in a thread so the discovery callbacks keep flowing."""
    return await asyncio.to_thread(function, *args, **kwargs)


@pytest.fixture
def labels() -> dict[str, str]:
    return {"app": f"model-{next(_ids)}"}


@pytest.fixture
def ip() -> Callable[[], str]:
    """Fresh 127.0.0.x addresses (unique within a test)."""
    return lambda: f"127.0.0.{next(_ips) % 250 + 2}"


@pytest.fixture
async def start_discovery(picker_release: dict[str, str]) -> AsyncIterator[Callable[..., Any]]:
    started: list[KubernetesDiscovery] = []

    async def start(datastore: Datastore, **overrides: Any) -> KubernetesDiscovery:
        kwargs: dict[str, Any] = {
            "pool_name": picker_release["pool"],
            "pool_namespace": picker_release["namespace"],
            "kubeconfig": picker_release["kubeconfig"],
        }
        kwargs.update(overrides)
        discovery = KubernetesDiscovery(datastore, **kwargs)
        await discovery.start()
        started.append(discovery)
        return discovery

    yield start
    for discovery in started:
        await discovery.stop()


async def test_endpoints_follow_ready_notready_terminating_and_deleted_pods(
    admin_api, picker_release, labels, ip, start_discovery
) -> None:
    ns = picker_release["namespace"]
    await api_call(put_pool, admin_api, ns, "pool", labels, [8000])
    ip_a, ip_b, ip_c = ip(), ip(), ip()
    for name in ("a", "b"):
        await api_call(create_pod, admin_api, ns, f"{labels['app']}-{name}", labels)
    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-a", ip_a)
    await api_call(create_pod, admin_api, ns, f"{labels['app']}-other", {"app": "unrelated"})
    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-other", ip_c)

    datastore = Datastore()
    await start_discovery(datastore)
    assert not datastore.synced, "synced before the first list arrived"
    await wait_for(lambda: datastore.synced, START_DEADLINE, "first sync")
    assert addresses(datastore) == {f"{ip_a}:8000"}
    endpoint = datastore.get(f"{ip_a}:8000")
    assert endpoint is not None
    assert (endpoint.name, endpoint.namespace, endpoint.labels) == (f"{labels['app']}-a-rank-0", ns, labels)

    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-b", ip_b)
    await wait_for(lambda: addresses(datastore) == {f"{ip_a}:8000", f"{ip_b}:8000"}, CHANGE_DEADLINE, "b Ready")

    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-a", ip_a, ready=False)
    await wait_for(lambda: addresses(datastore) == {f"{ip_b}:8000"}, CHANGE_DEADLINE, "a NotReady")

    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-a", ip_a)
    await wait_for(lambda: len(datastore.endpoints()) == 2, CHANGE_DEADLINE, "a Ready again")
    # A graceful delete without a kubelet only sets deletionTimestamp: the pod is terminating.
    await api_call(client.CoreV1Api(admin_api).delete_namespaced_pod, f"{labels['app']}-a", ns)
    await wait_for(lambda: addresses(datastore) == {f"{ip_b}:8000"}, CHANGE_DEADLINE, "a terminating")

    await api_call(delete_pod, admin_api, ns, f"{labels['app']}-b")
    await wait_for(lambda: addresses(datastore) == set(), CHANGE_DEADLINE, "b deleted")


async def test_target_ports_are_ranks_filtered_by_active_ports_with_kv_event_addresses(
    admin_api, picker_release, labels, ip, start_discovery
) -> None:
    ns = picker_release["namespace"]
    await api_call(put_pool, admin_api, ns, "pool", labels, [8000, 8001, 8002])
    ip_a, ip_b = ip(), ip()
    await api_call(
        create_pod,
        admin_api,
        ns,
        "dp-a",
        labels,
        {
            "inference.networking.k8s.io/active-ports": "8000,8002",
            "picker.inference/kv-events-port": "5557",
        },
    )
    await api_call(create_pod, admin_api, ns, "dp-b", labels, {"picker.inference/kv-events-port": "6000,6100"})
    await api_call(set_pod_ready, admin_api, ns, "dp-a", ip_a)
    await api_call(set_pod_ready, admin_api, ns, "dp-b", ip_b)

    datastore = Datastore()
    await start_discovery(datastore)
    await wait_for(lambda: len(datastore.endpoints()) == 5, START_DEADLINE, "5 rank endpoints")
    found = {(e.address, e.name, e.kv_events_address) for e in datastore.endpoints().values()}
    assert found == {
        (f"{ip_a}:8000", "dp-a-rank-0", f"tcp://{ip_a}:5557"),
        (f"{ip_a}:8002", "dp-a-rank-2", f"tcp://{ip_a}:5559"),
        (f"{ip_b}:8000", "dp-b-rank-0", f"tcp://{ip_b}:6000"),
        (f"{ip_b}:8001", "dp-b-rank-1", f"tcp://{ip_b}:6100"),
        (f"{ip_b}:8002", "dp-b-rank-2", None),
    }

    await api_call(
        client.CoreV1Api(admin_api).patch_namespaced_pod,
        "dp-a",
        ns,
        {"metadata": {"annotations": {"inference.networking.k8s.io/active-ports": "8001"}}},
    )
    await wait_for(
        lambda: {a for a in addresses(datastore) if a.startswith(f"{ip_a}:")} == {f"{ip_a}:8001"},
        CHANGE_DEADLINE,
        "active-ports change",
    )

    await api_call(put_pool, admin_api, ns, "pool", labels, [8001])
    await wait_for(
        lambda: addresses(datastore) == {f"{ip_a}:8001", f"{ip_b}:8001"}, CHANGE_DEADLINE, "targetPorts change"
    )
    assert datastore.get(f"{ip_b}:8001").name == "dp-b-rank-0"


async def test_selector_change_retargets_the_pool(admin_api, picker_release, labels, ip, start_discovery) -> None:
    ns = picker_release["namespace"]
    blue, green = {"app": labels["app"], "track": "blue"}, {"app": labels["app"], "track": "green"}
    await api_call(put_pool, admin_api, ns, "pool", blue, [8000])
    ip_blue, ip_green = ip(), ip()
    for name, pod_labels, pod_ip in (("blue", blue, ip_blue), ("green", green, ip_green)):
        await api_call(create_pod, admin_api, ns, f"{labels['app']}-{name}", pod_labels)
        await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-{name}", pod_ip)

    datastore = Datastore()
    await start_discovery(datastore)
    await wait_for(lambda: addresses(datastore) == {f"{ip_blue}:8000"}, START_DEADLINE, "blue selected")

    await api_call(put_pool, admin_api, ns, "pool", green, [8000])
    await wait_for(lambda: addresses(datastore) == {f"{ip_green}:8000"}, CHANGE_DEADLINE, "green selected")
    # The new pod watch is live, not a one-off list.
    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-green", ip_green, ready=False)
    await wait_for(lambda: addresses(datastore) == set(), CHANGE_DEADLINE, "green NotReady")


async def test_standalone_mode_needs_no_pool(admin_api, picker_release, labels, ip, start_discovery) -> None:
    ns = picker_release["namespace"]
    pod_ip = ip()
    await api_call(create_pod, admin_api, ns, f"{labels['app']}-solo", labels)
    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-solo", pod_ip)

    datastore = Datastore()
    await start_discovery(datastore, pool_name=None, endpoint_selector=labels, endpoint_target_ports=[8000, 8001])
    await wait_for(
        lambda: addresses(datastore) == {f"{pod_ip}:8000", f"{pod_ip}:8001"}, START_DEADLINE, "standalone endpoints"
    )


async def test_inference_objectives_of_this_pool_reach_the_callback(admin_api, picker_release, start_discovery) -> None:
    ns = picker_release["namespace"]
    custom = client.CustomObjectsApi(admin_api)

    def objective(name: str, pool: str, priority: int | None) -> dict[str, Any]:
        spec: dict[str, Any] = {"poolRef": {"name": pool}}
        if priority is not None:
            spec["priority"] = priority
        return {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": name},
            "spec": spec,
        }

    for body in (
        objective("critical", "pool", 10),
        objective("batch", "pool", -1),
        objective("default-prio", "pool", None),
        objective("elsewhere", "other-pool", 5),
    ):
        await api_call(
            custom.create_namespaced_custom_object,
            "inference.networking.x-k8s.io",
            "v1alpha2",
            ns,
            "inferenceobjectives",
            body,
        )
    seen: list[dict[str, int]] = []
    await start_discovery(Datastore(), on_objectives=seen.append)
    await wait_for(lambda: seen, START_DEADLINE, "objectives")
    assert seen[-1] == {"critical": 10, "batch": -1, "default-prio": 0}

    await api_call(
        custom.patch_namespaced_custom_object,
        "inference.networking.x-k8s.io",
        "v1alpha2",
        ns,
        "inferenceobjectives",
        "batch",
        {"spec": {"priority": -5}},
    )
    await wait_for(lambda: seen[-1].get("batch") == -5, CHANGE_DEADLINE, "priority change")


async def test_config_map_changes_reach_the_callback(admin_api, picker_release, start_discovery) -> None:
    ns, name = picker_release["namespace"], picker_release["config_map"]
    texts: list[str] = []
    await start_discovery(Datastore(), config_map=name, on_config_text=texts.append)
    await wait_for(lambda: texts, START_DEADLINE, "the chart's config")
    assert "kind: EndpointPickerConfig" in texts[0] and "weight: 3" in texts[0]

    changed = texts[0].replace("weight: 3", "weight: 7")
    await api_call(patch_config_map, admin_api, ns, name, {"default-plugins.yaml": changed})
    await wait_for(lambda: texts[-1] == changed, CHANGE_DEADLINE, "config change")
    # Metadata-only updates do not re-deliver the same text.
    await api_call(
        client.CoreV1Api(admin_api).patch_namespaced_config_map, name, ns, {"metadata": {"labels": {"touched": "yes"}}}
    )
    await api_call(patch_config_map, admin_api, ns, name, {"default-plugins.yaml": texts[0]})
    await wait_for(lambda: texts[-1] == texts[0], CHANGE_DEADLINE, "config change back")
    assert len(texts) == 3


async def test_legacy_v1alpha2_pool(kube_cluster, admin_api, helm_binary, helm_env, labels, ip, tmp_path) -> None:
    ns = await api_call(create_namespace, admin_api, "picker-legacy")
    await api_call(
        helm,
        helm_binary,
        helm_env,
        "install",
        "legacy",
        str(CHART),
        "-n",
        ns,
        "--set",
        "inferencePool.apiVersion=inference.networking.x-k8s.io/v1alpha2",
        "--set",
        f"inferencePool.modelServers.matchLabels.app={labels['app']}",
        "--set",
        "inferencePool.targetPorts[0].number=8080",
        kube=kube_cluster,
    )
    kubeconfig = await api_call(
        service_account_kubeconfig, admin_api, kube_cluster, ns, "legacy-epp", tmp_path / "legacy.kubeconfig"
    )
    pod_ip = ip()
    await api_call(create_pod, admin_api, ns, "old-pod", labels)
    await api_call(set_pod_ready, admin_api, ns, "old-pod", pod_ip)

    datastore = Datastore()
    discovery = KubernetesDiscovery(
        datastore,
        pool_name="legacy",
        pool_namespace=ns,
        pool_group="inference.networking.x-k8s.io",
        kubeconfig=str(kubeconfig),
    )
    await discovery.start()
    try:
        await wait_for(lambda: addresses(datastore) == {f"{pod_ip}:8080"}, START_DEADLINE, "legacy pool endpoint")
        await api_call(put_pool, admin_api, ns, "legacy", labels, [9000], legacy=True)
        await wait_for(lambda: addresses(datastore) == {f"{pod_ip}:9000"}, CHANGE_DEADLINE, "targetPortNumber change")
    finally:
        await discovery.stop()


async def test_pool_deleted_empties_the_endpoints(
    admin_api, picker_release, labels, ip, start_discovery, kube_cluster, tmp_path
) -> None:
    ns = picker_release["namespace"]
    # A pool the chart's Role does not name: this test watches it with admin credentials.
    await api_call(put_pool, admin_api, ns, "scratch", labels, [8000])
    pod_ip = ip()
    await api_call(create_pod, admin_api, ns, f"{labels['app']}-x", labels)
    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-x", pod_ip)
    datastore = Datastore()
    await start_discovery(datastore, pool_name="scratch", kubeconfig=str(kube_cluster.admin_kubeconfig))
    await wait_for(lambda: addresses(datastore) == {f"{pod_ip}:8000"}, START_DEADLINE, "scratch pool endpoint")
    await api_call(
        client.CustomObjectsApi(admin_api).delete_namespaced_custom_object,
        "inference.networking.k8s.io",
        "v1",
        ns,
        "inferencepools",
        "scratch",
    )
    await wait_for(lambda: addresses(datastore) == set(), CHANGE_DEADLINE, "pool deleted")


def test_service_account_cannot_do_what_it_must_not(admin_api, picker_release) -> None:
    ns = picker_release["namespace"]
    sa = config.new_client_from_config(config_file=picker_release["kubeconfig"])
    with sa:
        core = client.CoreV1Api(sa)
        # Allowed: what discovery needs.
        core.list_namespaced_pod(ns)
        core.read_namespaced_config_map(picker_release["config_map"], ns)
        forbidden: list[Callable[[], Any]] = [
            lambda: core.list_namespaced_secret(ns),
            lambda: core.read_namespaced_secret("anything", ns),
            lambda: core.create_namespaced_pod(
                ns,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "evil"},
                    "spec": {"containers": [{"name": "c", "image": "x"}]},
                },
            ),
            lambda: core.patch_namespaced_pod_status("any", ns, {"status": {"podIP": "127.0.0.9"}}),
            lambda: core.delete_collection_namespaced_pod(ns),
            lambda: core.list_namespaced_config_map(ns),  # only its own ConfigMap, by name
            lambda: core.patch_namespaced_config_map(picker_release["config_map"], ns, {"data": {"x": "y"}}),
            lambda: core.list_namespaced_pod("default"),  # other namespaces
            lambda: client.CustomObjectsApi(sa).patch_namespaced_custom_object(
                "inference.networking.k8s.io", "v1", ns, "inferencepools", "pool", {"spec": {}}
            ),
            lambda: client.CustomObjectsApi(sa).list_namespaced_custom_object(
                "inference.networking.k8s.io", "v1", ns, "inferencepools"
            ),  # only its own pool, by name
            lambda: client.CoordinationV1Api(sa).list_namespaced_lease(ns),
        ]
        for call in forbidden:
            with pytest.raises(client.ApiException) as info:
                call()
            assert info.value.status == 403, info.value


async def test_api_server_restart_keeps_endpoints_and_the_watch_resumes(
    kube_cluster, admin_api, picker_release, labels, ip, start_discovery
) -> None:
    ns = picker_release["namespace"]
    await api_call(put_pool, admin_api, ns, "pool", labels, [8000])
    ip_a, ip_b = ip(), ip()
    await api_call(create_pod, admin_api, ns, f"{labels['app']}-a", labels)
    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-a", ip_a)
    datastore = Datastore()
    await start_discovery(datastore)
    await wait_for(lambda: addresses(datastore) == {f"{ip_a}:8000"}, START_DEADLINE, "a")

    await api_call(kube_cluster.stop_apiserver)
    assert addresses(datastore) == {f"{ip_a}:8000"}
    await api_call(kube_cluster.start_apiserver)
    assert addresses(datastore) == {f"{ip_a}:8000"}, "endpoints lost while the API server was down"

    await api_call(create_pod, admin_api, ns, f"{labels['app']}-b", labels)
    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-b", ip_b)
    # The watch reconnects with backoff (at most 2 s between tries), then follows changes again.
    await wait_for(lambda: addresses(datastore) == {f"{ip_a}:8000", f"{ip_b}:8000"}, 5.0, "b after restart")
    await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-a", ip_a, ready=False)
    await wait_for(lambda: addresses(datastore) == {f"{ip_b}:8000"}, CHANGE_DEADLINE, "a NotReady after restart")


async def test_watch_gone_410_relists_without_dropping_objects(kube_cluster, admin_api, picker_release, labels) -> None:
    """A watch from a compacted-away resourceVersion gets 410 Gone from the real API server
    (ConfigMap watches bypass its watch cache in this cluster); the reflector relists and carries
    on, and no delivery ever lacks an object that still exists."""
    ns = picker_release["namespace"]
    core = client.CoreV1Api(admin_api)
    kept, new = f"{labels['app']}-kept", f"{labels['app']}-new"

    def config_map(name: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}

    await api_call(core.create_namespaced_config_map, ns, config_map(kept))
    await api_call(kube_cluster.compact_etcd)
    calls: list[dict[str, Any]] = []

    def list_config_maps(**query: Any) -> Any:
        if query.get("watch") and not any(c.get("watch") for c in calls):
            query["resource_version"] = "1"  # compacted away: the API server answers 410 Gone
        calls.append(query)
        return core.list_namespaced_config_map(
            ns, label_selector=f"app={labels['app']}", _preload_content=False, **query
        )

    deliveries: list[set[str]] = []
    reflector = KubeReflector(
        "configmaps-410", list_config_maps, lambda objects: deliveries.append(set(objects)), asyncio.get_running_loop()
    )
    reflector.start()
    try:
        await wait_for(lambda: len([c for c in calls if not c.get("watch")]) >= 2, START_DEADLINE, "a relist")
        await api_call(core.create_namespaced_config_map, ns, config_map(new))
        # What this asserts is that nothing is dropped; the change lands while the watch is being
        # re-established after the relist, so it gets the start deadline, not the change bound.
        await wait_for(lambda: deliveries and new in deliveries[-1], START_DEADLINE, "the watch after the relist")
    finally:
        reflector.stop()
        await asyncio.to_thread(reflector.join, 5.0)
    assert all(kept in d for d in deliveries), deliveries


async def test_missing_credentials_are_a_clear_error(tmp_path) -> None:
    discovery = KubernetesDiscovery(
        Datastore(), pool_name="pool", pool_namespace="default", kubeconfig=str(tmp_path / "missing.kubeconfig")
    )
    with pytest.raises(KubeCredentialsError, match="missing.kubeconfig"):
        await discovery.start()
    await discovery.stop()


async def test_missing_objective_crd_is_not_an_error(
    admin_api, picker_release, labels, ip, start_discovery, caplog
) -> None:
    """Without the InferenceObjective CRD the picker still syncs its pool and says so in its log
    (the CRD is put back afterwards for the other tests)."""
    ns = picker_release["namespace"]
    crd_name = "inferenceobjectives.inference.networking.x-k8s.io"
    extensions = client.ApiextensionsV1Api(admin_api)
    saved = await api_call(extensions.read_custom_resource_definition, crd_name)
    await api_call(extensions.delete_custom_resource_definition, crd_name)
    try:
        group = client.CustomObjectsApi(admin_api)

        def objectives_gone() -> bool:
            try:
                resources = group.get_api_resources("inference.networking.x-k8s.io", "v1alpha2").resources
            except client.ApiException as exc:
                return exc.status == 404
            return all(r.name != "inferenceobjectives" for r in resources)

        deadline = time.monotonic() + 30
        while not await api_call(objectives_gone):
            assert time.monotonic() < deadline, "the CRD was not removed"
            await asyncio.sleep(0.1)
        await api_call(put_pool, admin_api, ns, "pool", labels, [8000])
        pod_ip = ip()
        await api_call(create_pod, admin_api, ns, f"{labels['app']}-p", labels)
        await api_call(set_pod_ready, admin_api, ns, f"{labels['app']}-p", pod_ip)
        seen: list[dict[str, int]] = []
        datastore = Datastore()
        with caplog.at_level("INFO", logger="picker.discovery.kubernetes"):
            await start_discovery(datastore, on_objectives=seen.append)
            await wait_for(lambda: addresses(datastore) == {f"{pod_ip}:8000"}, START_DEADLINE, "the pool's pod")
            await wait_for(lambda: "InferenceObjective CRD" in caplog.text, START_DEADLINE, "the not-installed log")
        assert seen == []
    finally:
        body = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": crd_name, "annotations": saved.metadata.annotations},
            "spec": saved.spec,
        }
        await api_call(_recreate_crd, admin_api, body)


def _recreate_crd(api: client.ApiClient, body: dict[str, Any]) -> None:
    extensions = client.ApiextensionsV1Api(api)

    def created() -> bool:
        try:
            extensions.create_custom_resource_definition(body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            return False  # the deleted CRD lingers until its objects are cleaned up
        return True

    wait_until(created, 30, "the deleted CRD to be recreated", interval=0.1)
    wait_crds_established(api, [body["metadata"]["name"]])
