"""Endpoint discovery from the Kubernetes API: an InferencePool (or a plain label selector) and
its pods, InferenceObjectives, InferenceModelRewrites, and the ConfigMap holding the
EndpointPickerConfig (its text as first read, for the start: `config_text`; every change after:
`on_config_text`).

Each watched kind runs in a `KubeReflector` thread; results arrive on the event loop, where this
class turns them into `Datastore.set_endpoints` calls and the `on_objectives` /
`on_model_rewrites` / `on_config_text` callbacks. Nothing here blocks the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.discovery.kube_objects import (
    OBJECTIVE_GROUP,
    OBJECTIVE_VERSION,
    POOL_GROUP_V1,
    PoolSpec,
    PoolSpecError,
    config_map_text,
    objective_priorities,
    parse_pool_spec,
    pod_endpoints,
    pool_model_rewrites,
    pool_version,
    validate_target_ports,
)
from picker.discovery.kube_reflector import KubeReflector, ListCall, Objects
from picker.discovery.kube_requests import list_call, namespaced_path, served_resources

log = logging.getLogger(__name__)

_STOP_TIMEOUT = 5.0


class KubeCredentialsError(Exception):
    """No usable Kubernetes credentials (bad kubeconfig, or none and not in a cluster)."""


class ConfigMapError(ValueError):
    """The watched ConfigMap holds no EndpointPickerConfig (no key for it)."""


def api_client(kubeconfig: str | None) -> client.ApiClient:
    """A client for `kubeconfig`, else the in-cluster service account, else $KUBECONFIG or
    ~/.kube/config."""
    # The client ships py.typed but leaves its config loaders unannotated: type the ones used here.
    new_client_from_config: Callable[..., client.ApiClient] = config.new_client_from_config
    load_incluster_config: Callable[..., None] = config.load_incluster_config
    load_kube_config: Callable[..., None] = config.load_kube_config
    try:
        if kubeconfig:
            return new_client_from_config(config_file=kubeconfig)
        configuration = client.Configuration()
        try:
            load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            load_kube_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except (config.ConfigException, OSError, ValueError) as exc:
        where = kubeconfig or "in-cluster service account, $KUBECONFIG or ~/.kube/config"
        raise KubeCredentialsError(f"cannot load Kubernetes credentials ({where}): {exc}") from None


class KubernetesDiscovery:
    """Keeps the datastore's endpoints equal to the ready pods of an InferencePool.

    Pool mode (`pool_name`) follows the pool's selector and target ports, re-targeting when
    they change. Standalone mode (`endpoint_selector` + `endpoint_target_ports`) needs no CRD.
    """

    def __init__(
        self,
        datastore: Datastore,
        *,
        pool_name: str | None,
        pool_namespace: str,
        pool_group: str = POOL_GROUP_V1,
        endpoint_selector: Mapping[str, str] | None = None,
        endpoint_target_ports: Sequence[int] = (),
        kubeconfig: str | None = None,
        on_objectives: Callable[[dict[str, int]], None] | None = None,
        on_model_rewrites: Callable[[list[Mapping[str, Any]]], None] | None = None,
        config_map: str | None = None,
        config_map_key: str | None = None,
        on_config_text: Callable[[str], None] | None = None,
    ) -> None:
        if bool(pool_name) == bool(endpoint_selector):
            raise ValueError("set exactly one of pool_name or endpoint_selector")
        self._standalone_spec: PoolSpec | None = None
        if endpoint_selector:
            try:
                ports = validate_target_ports(endpoint_target_ports)
            except PoolSpecError as exc:
                raise ValueError(f"endpoint_target_ports: {exc}") from None
            labels = tuple(sorted((str(k), str(v)) for k, v in endpoint_selector.items()))
            self._standalone_spec = PoolSpec(labels, ports)
        else:
            pool_version(pool_group)  # rejects an unknown group early
        self._datastore = datastore
        self._pool_name = pool_name
        self._namespace = pool_namespace
        self._pool_group = pool_group
        self._kubeconfig = kubeconfig
        self._on_objectives = on_objectives
        self._on_model_rewrites = on_model_rewrites
        self._config_map = config_map
        self._config_map_key = config_map_key
        self._on_config_text = on_config_text

        self._loop: asyncio.AbstractEventLoop | None = None
        self._api: client.ApiClient | None = None
        self._reflectors: list[KubeReflector] = []
        self._pod_reflector: KubeReflector | None = None
        self._spec: PoolSpec | None = None
        self._pods: Objects = {}
        self._objectives: dict[str, int] | None = None
        self._model_rewrites: list[Mapping[str, Any]] | None = None
        self._config_text: str | None = None
        self._config_problem: str | None = None  # why the ConfigMap holds no config, when it does not
        self._config_seen = asyncio.Event()  # the ConfigMap exists and has been read
        self._config_map_missing_logged = False
        self._optional_watches: list[asyncio.Task[None]] = []  # watches of CRDs that may be missing
        self._stopped = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Begin watching; returns once the watch threads are started (not synced).

        Raises KubeCredentialsError when no credentials can be loaded."""
        self._loop = asyncio.get_running_loop()
        self._api = await asyncio.to_thread(api_client, self._kubeconfig)
        if self._standalone_spec is not None:
            self._target(self._standalone_spec)
        else:
            self._start_reflector(
                "inferencepool",
                self._list_call(
                    "inferencepools",
                    self._pool_group,
                    pool_version(self._pool_group),
                    field_selector=f"metadata.name={self._pool_name}",
                ),
                self._on_pools,
            )
            if self._on_objectives is not None:
                self._watch_if_served("InferenceObjective", "priorities default to 0", self._on_objectives_changed)
            if self._on_model_rewrites is not None:
                self._watch_if_served("InferenceModelRewrite", "no model is rewritten", self._on_model_rewrites_changed)
        if self._config_map:
            self._start_reflector(
                "configmap",
                self._list_call("configmaps", field_selector=f"metadata.name={self._config_map}"),
                self._on_config_maps,
            )

    async def stop(self) -> None:
        """Stop every watch thread and wait (briefly) for them to end."""
        self._stopped.set()
        for task in self._optional_watches:
            task.cancel()
        await asyncio.gather(*self._optional_watches, return_exceptions=True)
        reflectors, self._reflectors = self._reflectors, []
        self._pod_reflector = None
        for reflector in reflectors:
            reflector.stop()
        for reflector in reflectors:
            await asyncio.to_thread(reflector.join, _STOP_TIMEOUT)
        if self._api is not None:
            await asyncio.to_thread(self._api.close)
            self._api = None

    # -- wiring ----------------------------------------------------------------------------

    def _list_call(self, plural: str, group: str = "", version: str = "v1", **query: str) -> ListCall:
        """List/watch calls for `plural` in the pool's namespace (the core group's by default)."""
        assert self._api is not None
        return list_call(self._api, namespaced_path(self._namespace, plural, group, version), **query)

    def _start_reflector(self, name: str, call: ListCall, on_change: Callable[[Objects], None]) -> KubeReflector:
        assert self._loop is not None
        reflector = KubeReflector(name, call, on_change, self._loop)
        self._reflectors.append(reflector)
        reflector.start()
        return reflector

    def _stop_reflector(self, reflector: KubeReflector) -> None:
        reflector.stop()
        self._reflectors.remove(reflector)

    def _target(self, spec: PoolSpec) -> None:
        """Point the pod watch at `spec`'s selector (restarting it if the selector changed)."""
        old = self._spec
        self._spec = spec
        if old is not None and old.selector == spec.selector and self._pod_reflector is not None:
            self._publish()  # only the ports changed: same pods, new endpoints
            return
        if self._pod_reflector is not None:
            self._stop_reflector(self._pod_reflector)

        def on_pods(objects: Objects) -> None:
            if self._pod_reflector is reflector:  # ignore a replaced watch's late deliveries
                self._pods = objects
                self._publish()

        reflector = self._start_reflector(
            f"pods({spec.label_selector})",
            self._list_call("pods", label_selector=spec.label_selector),
            on_pods,
        )
        self._pod_reflector = reflector

    def _publish(self) -> None:
        if self._spec is None:
            return
        endpoints: list[Endpoint] = []
        for name in sorted(self._pods):
            endpoints.extend(pod_endpoints(self._pods[name], self._spec.target_ports))
        self._datastore.set_endpoints(endpoints)

    # -- watch callbacks (on the event loop) ----------------------------------------------

    def _on_pools(self, objects: Objects) -> None:
        pool = objects.get(self._pool_name or "")
        if pool is None:
            if self._spec is not None:
                log.warning("InferencePool %s/%s was deleted: no endpoints", self._namespace, self._pool_name)
                if self._pod_reflector is not None:
                    self._stop_reflector(self._pod_reflector)
                    self._pod_reflector = None
                self._spec = None
                self._pods = {}
                self._datastore.set_endpoints([])
            return
        try:
            spec = parse_pool_spec(pool, self._pool_group)
        except PoolSpecError as exc:
            log.error("InferencePool %s/%s ignored: %s", self._namespace, self._pool_name, exc)
            return
        if spec != self._spec:
            log.info(
                "InferencePool %s/%s: selector %s, target ports %s",
                self._namespace,
                self._pool_name,
                spec.label_selector,
                list(spec.target_ports),
            )
            self._target(spec)

    def _on_objectives_changed(self, objects: Objects) -> None:
        assert self._on_objectives is not None and self._pool_name is not None
        priorities = objective_priorities(objects.values(), self._pool_name)
        if priorities != self._objectives:
            self._objectives = priorities
            self._on_objectives(dict(priorities))

    def _on_model_rewrites_changed(self, objects: Objects) -> None:
        assert self._on_model_rewrites is not None and self._pool_name is not None
        rewrites = pool_model_rewrites(objects.values(), self._pool_name, self._pool_group)
        if rewrites != self._model_rewrites:
            self._model_rewrites = rewrites
            self._on_model_rewrites(list(rewrites))

    async def config_text(self) -> str:
        """The watched ConfigMap's EndpointPickerConfig text, once the ConfigMap has been read:
        waits while it does not exist; raises ConfigMapError if it holds no config."""
        await self._config_seen.wait()
        if self._config_text is None:
            raise ConfigMapError(self._config_problem or "no config")
        return self._config_text

    def _on_config_maps(self, objects: Objects) -> None:
        config_map = objects.get(self._config_map or "")
        if config_map is None:
            if not self._config_seen.is_set() and not self._config_map_missing_logged:
                self._config_map_missing_logged = True
                log.warning("ConfigMap %s/%s does not exist: waiting for it", self._namespace, self._config_map)
            return  # deleted or not created yet: keep running on the last config
        self._config_seen.set()
        text = config_map_text(config_map, self._config_map_key)
        if text is None:
            self._config_problem = (
                f"ConfigMap {self._namespace}/{self._config_map} has no key "
                f"{self._config_map_key or 'ending in .yaml'} holding the EndpointPickerConfig"
            )
            log.error("%s", self._config_problem)
            return
        if text != self._config_text:
            self._config_text = text
            if self._on_config_text is not None:
                self._on_config_text(text)

    def _watch_if_served(self, kind: str, without: str, on_change: Callable[[Objects], None]) -> None:
        """Watch `kind` (of the InferenceObjective API group) only when its CRD is installed;
        otherwise log what that means (`without`), which is not an error."""
        plural = kind.lower() + "s"

        async def watch() -> None:
            served = await asyncio.to_thread(self._served, plural)
            if self._stopped.is_set():
                return
            if not served:
                log.info("%s CRD (%s/%s) is not installed: %s", kind, OBJECTIVE_GROUP, OBJECTIVE_VERSION, without)
                return
            self._start_reflector(plural, self._list_call(plural, OBJECTIVE_GROUP, OBJECTIVE_VERSION), on_change)

        self._optional_watches.append(asyncio.create_task(watch()))

    def _served(self, plural: str) -> bool:
        """Ask API discovery whether `plural` is served; retries until it answers."""
        assert self._api is not None
        while not self._stopped.is_set():
            try:
                return plural in served_resources(self._api, OBJECTIVE_GROUP, OBJECTIVE_VERSION, 5.0)
            except ApiException as exc:
                if exc.status == 404:
                    return False
                log.warning("API discovery failed (%s); retrying", exc.status)
            except Exception as exc:  # API server unreachable: retry like the watches do
                log.warning("API discovery failed (%s); retrying", type(exc).__name__)
            self._stopped.wait(1.0)
        return False
