"""Reading Kubernetes objects (as decoded JSON) into what the picker needs.

Pure functions: InferencePool specs in both API versions, pods into endpoints, InferenceObjective
priorities, the InferenceModelRewrites of a pool, and the EndpointPickerConfig text held in a
ConfigMap.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from picker.datastore.endpoint import Endpoint

log = logging.getLogger(__name__)

POOL_GROUP_V1 = "inference.networking.k8s.io"
POOL_GROUP_LEGACY = "inference.networking.x-k8s.io"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
OBJECTIVE_VERSION = "v1alpha2"

# Restricts which of the pool's target ports a pod serves (CSV of port numbers).
ACTIVE_PORTS_ANNOTATION = "inference.networking.k8s.io/active-ports"
# The picker's own annotation: the port of the pod's KV-cache event publisher (ZMQ). One number
# means rank i publishes on that port + i (vLLM offsets it by data-parallel rank); a CSV gives
# one port per rank, in targetPorts order.
KV_EVENTS_PORT_ANNOTATION = "picker.inference/kv-events-port"

MAX_TARGET_PORTS = 8


class PoolSpecError(ValueError):
    """An InferencePool whose spec the picker cannot use."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The part of an InferencePool that decides its endpoints."""

    selector: tuple[tuple[str, str], ...]  # sorted label pairs, all must match
    target_ports: tuple[int, ...]  # 1-8 unique ports; index = rank

    @property
    def label_selector(self) -> str:
        """The selector in the API server's `labelSelector` query syntax."""
        return format_label_selector(dict(self.selector))


def pool_version(group: str) -> str:
    """The InferencePool API version served in `group`."""
    if group == POOL_GROUP_V1:
        return "v1"
    if group == POOL_GROUP_LEGACY:
        return "v1alpha2"
    raise PoolSpecError(f"unknown InferencePool group {group!r}: use {POOL_GROUP_V1} or {POOL_GROUP_LEGACY}")


def format_label_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def validate_target_ports(ports: Iterable[object]) -> tuple[int, ...]:
    """1-8 unique ports in 1..65535, order kept (it defines ranks). Takes any values, since pool
    objects are untyped JSON: each is checked to be an int."""
    values = tuple(ports)
    if not 1 <= len(values) <= MAX_TARGET_PORTS:
        raise PoolSpecError(f"need 1 to {MAX_TARGET_PORTS} target ports, got {len(values)}")
    if len(set(values)) != len(values):
        raise PoolSpecError(f"target ports must be unique, got {list(values)}")
    result: list[int] = []
    for port in values:
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise PoolSpecError(f"target port {port!r} is not in 1..65535")
        result.append(port)
    return tuple(result)


def parse_pool_spec(pool: Mapping[str, Any], group: str) -> PoolSpec:
    """The selector and target ports of an InferencePool of `group` (v1 or legacy v1alpha2)."""
    spec = pool.get("spec") or {}
    if pool_version(group) == "v1":
        selector = (spec.get("selector") or {}).get("matchLabels") or {}
        ports = [p.get("number") for p in spec.get("targetPorts") or [] if isinstance(p, Mapping)]
    else:
        selector = spec.get("selector") or {}
        ports = [spec.get("targetPortNumber")]
    if not isinstance(selector, Mapping) or not selector:
        raise PoolSpecError("the pool's selector is empty: it would select every pod")
    labels = tuple(sorted((str(k), str(v)) for k, v in selector.items()))
    return PoolSpec(labels, validate_target_ports(ports))


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready=True, not being deleted, and with an IP."""
    metadata = pod.get("metadata") or {}
    if metadata.get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def _csv_ints(value: str, what: str, pod_name: str) -> list[int] | None:
    try:
        return [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        log.warning("pod %s: ignoring malformed %s annotation %r", pod_name, what, value)
        return None


def pod_endpoints(pod: Mapping[str, Any], target_ports: tuple[int, ...]) -> list[Endpoint]:
    """One endpoint per active target port of a ready pod (named `<pod>-rank-<i>`)."""
    if not pod_is_ready(pod):
        return []
    metadata = pod.get("metadata") or {}
    name = metadata.get("name", "")
    namespace = metadata.get("namespace", "")
    labels = dict(metadata.get("labels") or {})
    annotations = metadata.get("annotations") or {}
    ip = pod["status"]["podIP"]

    active: set[int] | None = None
    if ACTIVE_PORTS_ANNOTATION in annotations:
        ports = _csv_ints(annotations[ACTIVE_PORTS_ANNOTATION], ACTIVE_PORTS_ANNOTATION, name)
        active = set(ports) if ports is not None else None

    kv_ports: list[int] | None = None
    if KV_EVENTS_PORT_ANNOTATION in annotations:
        kv_ports = _csv_ints(annotations[KV_EVENTS_PORT_ANNOTATION], KV_EVENTS_PORT_ANNOTATION, name)

    endpoints = []
    for rank, port in enumerate(target_ports):
        if active is not None and port not in active:
            continue
        endpoints.append(
            Endpoint(
                ip=ip,
                port=port,
                name=f"{name}-rank-{rank}",
                namespace=namespace,
                labels=labels,
                kv_events_address=_kv_events_address(ip, kv_ports, rank),
            )
        )
    return endpoints


def _kv_events_address(ip: str, kv_ports: list[int] | None, rank: int) -> str | None:
    if not kv_ports:
        return None
    if len(kv_ports) == 1:
        port = kv_ports[0] + rank
    elif rank < len(kv_ports):
        port = kv_ports[rank]
    else:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"tcp://{host}:{port}"


def objective_priorities(objectives: Iterable[Mapping[str, Any]], pool_name: str) -> dict[str, int]:
    """`{objective name: priority}` for the InferenceObjectives whose poolRef names this pool.

    An unset priority counts as 0, as in the reference EPP."""
    result: dict[str, int] = {}
    for obj in objectives:
        spec = obj.get("spec") or {}
        if (spec.get("poolRef") or {}).get("name") != pool_name:
            continue
        priority = spec.get("priority")
        result[obj["metadata"]["name"]] = priority if isinstance(priority, int) else 0
    return result


def pool_model_rewrites(
    rewrites: Iterable[Mapping[str, Any]], pool_name: str, pool_group: str
) -> list[Mapping[str, Any]]:
    """The InferenceModelRewrites whose poolRef names this pool, by name and group (the group
    defaults to inference.networking.k8s.io), as the reference's reconciler filters them."""
    result = []
    for rewrite in rewrites:
        pool_ref = (rewrite.get("spec") or {}).get("poolRef") or {}
        if pool_ref.get("name") == pool_name and pool_ref.get("group", POOL_GROUP_V1) == pool_group:
            result.append(rewrite)
    return sorted(result, key=lambda r: str(r["metadata"]["name"]))


def config_map_text(config_map: Mapping[str, Any], key: str | None) -> str | None:
    """The config text under `key`, or under the first key (sorted) ending in .yaml when None."""
    data = config_map.get("data") or {}
    if key is None:
        key = next((k for k in sorted(data) if k.endswith(".yaml")), None)
        if key is None:
            return None
    return data.get(key)
