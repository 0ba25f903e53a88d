"""Body-based routing beside the reference: `picker bbr` and the reference `bbr` v1.5.0.

The reference binary is a build of the same Go module as the reference EPP (`bbr-v1.5.0` in the
binary cache, `reference_bbr_binary()`). `bbr_envoy_config` puts either in front of one upstream
as the reference BBR chart's Istio filter does (FULL_DUPLEX_STREAMED both ways, every phase
sent) or in BUFFERED mode; `multi_model_envoy_config` is one Gateway for several pools: the
body-based router, then each route's own EPP chosen by the header it set.

`python -m picker_bench.bbr [--seconds S] [--rate R]` measures the CPU per request of each in
the same run: a real kube-apiserver (the reference needs one), a fast backend, each router behind
its own Envoy in duplex mode, 2 KB completions bodies at a fixed rate for S seconds each, the
router process's user + system CPU divided by the requests served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from picker_bench.envoy import EnvoyProcess
from picker_bench.gobuild import print_built
from picker_bench.process import ManagedProcess, free_port, health_serving, port_open
from picker_bench.reference_epp import REFERENCE

_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_HTTP_CONNECTION_MANAGER = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
_EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
# The reference chart's Istio filter: every phase, bodies FULL_DUPLEX_STREAMED both ways.
DUPLEX_MODE = {
    "request_header_mode": "SEND",
    "response_header_mode": "SEND",
    "request_body_mode": "FULL_DUPLEX_STREAMED",
    "response_body_mode": "FULL_DUPLEX_STREAMED",
    "request_trailer_mode": "SEND",
    "response_trailer_mode": "SEND",
}
BUFFERED_MODE = {
    "request_header_mode": "SEND",
    "response_header_mode": "SKIP",
    "request_body_mode": "BUFFERED",
    "response_body_mode": "NONE",
    "request_trailer_mode": "SKIP",
    "response_trailer_mode": "SKIP",
}
MODES = {"duplex": DUPLEX_MODE, "buffered": BUFFERED_MODE}


def reference_bbr_binary() -> Path:
    """The reference `bbr` (`bbr-v1.5.0` in the binary cache), built from its module the first time."""
    return REFERENCE.binary("./cmd/bbr", "bbr")


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


# TLS to an ext_proc server's self-signed certificate (not verified), as the shipped gateway does.
_UPSTREAM_TLS = {
    "name": "envoy.transport_sockets.tls",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {"alpn_protocols": ["h2"], "validation_context": {}},
    },
}


def _grpc_cluster(name: str, address: tuple[str, int], tls: bool = False) -> dict[str, Any]:
    return {
        **({"transport_socket": _UPSTREAM_TLS} if tls else {}),
        "name": name,
        "type": "STATIC",
        "connect_timeout": "10s",
        "typed_extension_protocol_options": {
            _HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{_HTTP_OPTIONS}",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(*address)}}]}],
        },
    }


def _ext_proc_filter(name: str, cluster: str, mode: Mapping[str, str], lb_metadata: bool = False) -> dict[str, Any]:
    config: dict[str, Any] = {
        "@type": _EXT_PROC,
        "grpc_service": {"envoy_grpc": {"cluster_name": cluster}, "timeout": "10s"},
        "failure_mode_allow": False,
        "allow_mode_override": True,
        "message_timeout": "10s",
        "processing_mode": dict(mode),
    }
    if lb_metadata:
        config["metadata_options"] = {"receiving_namespaces": {"untyped": ["envoy.lb"]}}
    return {"name": name, "typed_config": config}


def _http_listener(
    listen: tuple[str, int], routes: list[dict[str, Any]], filters: list[dict[str, Any]]
) -> dict[str, Any]:
    manager = {
        "@type": _HTTP_CONNECTION_MANAGER,
        "stat_prefix": "inference_gateway",
        "route_config": {
            "name": "inference",
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            *filters,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            },
        ],
    }
    return {
        "name": "inference_gateway",
        "address": _socket(*listen),
        "per_connection_buffer_limit_bytes": 20971520,
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }


def bbr_envoy_config(
    mode: str,
    listen: tuple[str, int],
    bbr: tuple[str, int],
    upstream: tuple[str, int],
    admin: tuple[str, int],
    tls: bool = False,
) -> dict[str, Any]:
    """Envoy with the body-based router (ext_proc at `bbr`, over TLS with `tls`) before one upstream."""
    upstream_cluster = {
        "name": "upstream",
        "type": "STATIC",
        "connect_timeout": "10s",
        "load_assignment": {
            "cluster_name": "upstream",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(*upstream)}}]}],
        },
    }
    routes = [{"match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": "300s"}}]
    return {
        "admin": {"address": _socket(*admin)},
        "static_resources": {
            "listeners": [_http_listener(listen, routes, [_ext_proc_filter("bbr", "bbr", MODES[mode])])],
            "clusters": [upstream_cluster, _grpc_cluster("bbr", bbr, tls)],
        },
    }


def multi_model_envoy_config(
    listen: tuple[str, int],
    bbr: tuple[str, int],
    header: str,
    epps: Mapping[str, tuple[str, int]],
    admin: tuple[str, int],
) -> dict[str, Any]:
    """One Gateway for several pools, as HTTPRoutes matching the router's `header` make it: the
    body-based router first (the route cache cleared by its headers), then the EPP of the route
    the header selected (`epps`: header value → that pool's picker, plaintext), then the pod it
    picked. A request no route matches gets Envoy's 404, as a Gateway's does."""
    epp_filter = _ext_proc_filter("epp", "epp-0", DUPLEX_MODE, lb_metadata=True)
    routes = [
        {
            "match": {"prefix": "/", "headers": [{"name": header, "string_match": {"exact": value}}]},
            "route": {"cluster": "original_destination_cluster", "timeout": "300s"},
            "typed_per_filter_config": {
                "epp": {
                    "@type": _EXT_PROC_PER_ROUTE,
                    "overrides": {"grpc_service": {"envoy_grpc": {"cluster_name": f"epp-{i}"}}},
                }
            },
        }
        for i, value in enumerate(epps)
    ]
    original_destination = {
        "name": "original_destination_cluster",
        "type": "ORIGINAL_DST",
        "connect_timeout": "10s",
        "lb_policy": "CLUSTER_PROVIDED",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"},
    }
    return {
        "admin": {"address": _socket(*admin)},
        "static_resources": {
            "listeners": [_http_listener(listen, routes, [_ext_proc_filter("bbr", "bbr", DUPLEX_MODE), epp_filter])],
            "clusters": [
                original_destination,
                _grpc_cluster("bbr", bbr),
                *(_grpc_cluster(f"epp-{i}", address) for i, address in enumerate(epps.values())),
            ],
        },
    }


def start_envoy(config: dict[str, Any], log_dir: Path, name: str) -> EnvoyProcess:
    envoy = EnvoyProcess(name, config, log_dir).start()
    envoy.wait_ready(envoy.ready, timeout=30)
    return envoy


def _bbr_argv(grpc_port: int, health_port: int, plugins: Sequence[str], streaming: bool) -> list[str]:
    argv = [
        f"--grpc-port={grpc_port}",
        f"--grpc-health-port={health_port}",
        f"--metrics-port={free_port()}",
        "--secure-serving=false",
        f"--streaming={str(streaming).lower()}",
        "--tracing=false",
        "--enable-pprof=false",
        "--metrics-endpoint-auth=false",
    ]
    return argv + [f"--plugin={plugin}" for plugin in plugins]


def start_bbr(
    command: Sequence[str],
    kubeconfig: Path,
    grpc_port: int,
    log_dir: Path,
    name: str,
    plugins: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    streaming: bool = True,
) -> ManagedProcess:
    """A body-based router (`command`: the reference binary, or `picker bbr`) with the reference
    chart's flags on `grpc_port`, plaintext (`streaming`: for Envoy's FULL_DUPLEX_STREAMED mode,
    as the chart runs it); returns once its health port says SERVING."""
    health = free_port()
    environment = {**os.environ, **(env or {}), "KUBECONFIG": str(kubeconfig)}
    process = ManagedProcess(
        name, [*command, *_bbr_argv(grpc_port, health, plugins, streaming)], log_dir, env=environment
    )
    process.start()
    process.wait_ready(lambda: health_serving("127.0.0.1", health) and port_open("127.0.0.1", grpc_port), timeout=60)
    return process


PICKER_BBR = (sys.executable, "-m", "picker.cli", "bbr")


def main(argv: list[str] | None = None) -> int:
    """`python -m picker_bench.bbr`: CPU per request of picker bbr and the reference bbr."""
    parser = argparse.ArgumentParser(prog="python -m picker_bench.bbr", description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="load per router (default 10)")
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second (default 200)")
    parser.add_argument("--build-only", action="store_true", help="build the reference bbr and print its path")
    args = parser.parse_args(argv)
    if args.build_only:
        return print_built(reference_bbr_binary, "picker_bench.bbr")
    from picker_bench.kube_cluster import KubeCluster
    from picker_bench.overhead import body_of, cpu_seconds, fixed_rate

    body = body_of(2048)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="picker-bbr-bench-") as work:
        log_dir = Path(work)
        cluster = KubeCluster()
        cluster.start()
        processes: list[ManagedProcess] = []
        try:
            upstream_port = free_port()
            backend = ManagedProcess(
                "backend", [sys.executable, "-m", "picker_bench.backend", "127.0.0.1", str(upstream_port)], log_dir
            )
            processes.append(backend.start())
            backend.wait_ready(lambda: port_open("127.0.0.1", upstream_port))
            routers = {"reference bbr": (str(reference_bbr_binary()),), "picker bbr": PICKER_BBR}
            for label, command in routers.items():
                port = free_port()
                router = start_bbr(command, cluster.admin_kubeconfig, port, log_dir, label.replace(" ", "-"))
                processes.append(router)
                config = bbr_envoy_config(
                    "duplex",
                    ("127.0.0.1", free_port()),
                    ("127.0.0.1", port),
                    ("127.0.0.1", upstream_port),
                    ("127.0.0.1", free_port()),
                )
                envoy = start_envoy(config, log_dir, f"envoy-{label.replace(' ', '-')}")
                processes.append(envoy)
                url = envoy.url + "/v1/completions"
                asyncio.run(fixed_rate(url, body, args.rate, 1.0))  # warm up
                before = cpu_seconds(router.pid)
                result = asyncio.run(fixed_rate(url, body, args.rate, args.seconds))
                used = cpu_seconds(router.pid) - before
                served = int(args.rate * args.seconds) - result.errors
                results[label] = {
                    "cpu_us_per_request": 1e6 * used / max(served, 1),
                    "p50_ms": result.p50_ms,
                    "p99_ms": result.p99_ms,
                    "errors": result.errors,
                }
        finally:
            for process in reversed(processes):
                process.stop()
            cluster.stop()
    print(json.dumps({"duplex 2KB": results, "rate": args.rate, "seconds": args.seconds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
