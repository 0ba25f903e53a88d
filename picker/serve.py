"""`picker serve`: the ext_proc endpoint picker, with the reference EPP's flags."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib.metadata
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from picker.config.objectives import parse_objectives
from picker.config.runtime import Runtime, RuntimeHolder
from picker.config.schema import ConfigError
from picker.datalayer.layer import DataLayer
from picker.datalayer.plugins import scrape_settings
from picker.datastore.store import Datastore
from picker.discovery.static import EndpointFile, EndpointListError, parse_endpoint_flag
from picker.extproc.servicer import ExternalProcessor, ExtProcSettings
from picker.extproc.tls import server_credentials
from picker.framework.durations import parse_duration as parse_go_duration
from picker.requestcontrol.director import Director
from picker.telemetry import metrics
from picker.telemetry.decisions import DecisionLog
from picker.telemetry.health import HealthServicer
from picker.telemetry.http import metrics_app, start_metrics_server

if TYPE_CHECKING:
    from picker.discovery.kubernetes import KubernetesDiscovery

log = logging.getLogger("picker")


def parse_duration(text: str) -> float:
    """A Go duration flag (`50ms`, `2s`, `1m30s`, `0`) in seconds."""
    try:
        return parse_go_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "t", "true", "yes"):
        return True
    if value in ("0", "f", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}")


def _bool_flag(parser: argparse._ActionsContainer, name: str, default: bool, help_: str) -> None:
    # Go-style: `--flag`, `--flag=true`, `--flag=false` (the reference chart's syntax).
    parser.add_argument(name, type=parse_bool, nargs="?", const=True, default=default, help=help_)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="picker serve", description="Run the ext_proc endpoint picker.")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port (default 9002)")
    p.add_argument("--grpc-health-port", type=int, default=9003, help="gRPC health port (default 9003)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics port (default 9090)")
    p.add_argument("--bind-address", default="0.0.0.0", help="address every port binds to")
    p.add_argument(
        "--shutdown-delay",
        type=parse_duration,
        default=0.0,
        help="after SIGTERM, report NOT_SERVING but keep serving this long, so proxies and "
        "Kubernetes stop sending new requests first (e.g. 5s)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=parse_duration,
        default=2.0,
        help="then let requests in flight finish for up to this long (e.g. 120s for long streams)",
    )
    src = p.add_argument_group("endpoints")
    src.add_argument("--endpoints", help="static endpoints: ip:port,ip:port,...")
    src.add_argument("--endpoints-file", help="YAML list of endpoints, re-read when it changes")
    src.add_argument("--pool-name", help="InferencePool to watch")
    src.add_argument("--pool-namespace", default=None, help="its namespace (default: $NAMESPACE, else default)")
    src.add_argument("--pool-group", default="inference.networking.k8s.io", help="InferencePool API group")
    src.add_argument("--endpoint-selector", help="standalone mode: pod label selector k=v,k2=v2")
    src.add_argument("--endpoint-target-ports", help="standalone mode: target ports, CSV")
    src.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    src.add_argument("--config-map", help="ConfigMap holding the EndpointPickerConfig, watched for changes")
    cfg = p.add_argument_group("scheduling")
    cfg.add_argument("--config-file", help="EndpointPickerConfig file (hot-reloaded)")
    cfg.add_argument("--config-text", help="EndpointPickerConfig as inline YAML")
    cfg.add_argument("--objectives-file", help="InferenceObjectives (priorities) when not read from Kubernetes")
    cfg.add_argument("--refresh-metrics-interval", type=parse_duration, default=0.05)
    cfg.add_argument("--refresh-prometheus-metrics-interval", type=parse_duration, default=5.0)
    cfg.add_argument("--metrics-staleness-threshold", type=parse_duration, default=2.0)
    cfg.add_argument("--max-body-bytes", type=int, default=16 << 20, help="request body cap (413 above)")
    cfg.add_argument("--tenant-header", help="request header naming the tenant that scopes prefix state")
    _bool_flag(cfg, "--disable-endpoint-subset-filter", False, "ignore the proxy's subset hint")
    sec = p.add_argument_group("security")
    _bool_flag(sec, "--secure-serving", True, "TLS on the ext_proc port (default true)")
    sec.add_argument("--cert-path", help="directory with tls.crt and tls.key (reloaded when they change)")
    _bool_flag(sec, "--enable-cert-reload", False, "accepted for compatibility; --cert-path always reloads")
    obs = p.add_argument_group("observability")
    _bool_flag(obs, "--enable-debug-decisions", False, "serve GET /debug/decisions on the metrics port")
    obs.add_argument("--v", type=int, default=2, help="log verbosity: 2 default, 3 verbose, 4 debug")
    # Accepted so the reference chart's arguments work unchanged; the picker has no use for them.
    compat = p.add_argument_group("reference compatibility (accepted, no effect)")
    compat.add_argument("--zap-encoder", help=argparse.SUPPRESS)
    compat.add_argument("--zap-log-level", help=argparse.SUPPRESS)
    for name in (
        "--tracing",
        "--ha-enable-leader-election",
        "--metrics-endpoint-auth",
        "--enable-pprof",
        "--health-checking",
        "--model-server-metrics-https-insecure-skip-verify",
    ):
        _bool_flag(compat, name, False, argparse.SUPPRESS)
    for name in ("--model-server-metrics-scheme", "--model-server-metrics-path", "--model-server-metrics-port"):
        compat.add_argument(name, help=argparse.SUPPRESS)
    return p


def _configure_logging(verbosity: int, encoder: str | None) -> None:
    level = logging.DEBUG if verbosity >= 4 else logging.INFO if verbosity >= 2 else logging.WARNING
    if encoder == "json":
        fmt = '{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}'
    else:
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr)


class PickerServer:
    """Everything `picker serve` runs, started and stopped together."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.datastore = Datastore()
        self.decisions = DecisionLog(1000) if args.enable_debug_decisions else None
        self.data_layer = DataLayer(
            self.datastore,
            interval=args.refresh_metrics_interval,
            staleness_threshold=args.metrics_staleness_threshold,
            pool_gauges_interval=args.refresh_prometheus_metrics_interval,
            pool_name=args.pool_name or "",
        )
        self.runtimes = RuntimeHolder(self.datastore, self.decisions, on_install=self._config_installed)
        self.director = Director(
            self.datastore,
            self.runtimes,
            tenant_header=args.tenant_header.lower() if args.tenant_header else None,
        )
        self.config_watch: asyncio.Task[None] | None = None
        self.started = False  # Ready only once everything runs: the config loaded, the servers up
        self.config_map_loaded = False  # later ConfigMap changes reload; the first one is loaded at start
        self.draining = False
        self.endpoint_file: EndpointFile | None = None
        self.discovery: KubernetesDiscovery | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.metrics_runner: web.AppRunner | None = None

    async def _start_discovery(self) -> None:
        """Endpoints from the flags, a file, or the Kubernetes API (pool or label selector)."""
        args = self.args
        if args.pool_name or args.endpoint_selector:
            from picker.discovery.kubernetes import KubernetesDiscovery  # the client is heavy to import

            selector = None
            if args.endpoint_selector:
                try:
                    selector = dict(part.split("=", 1) for part in args.endpoint_selector.split(","))
                except ValueError:
                    raise EndpointListError(
                        f"--endpoint-selector: expected k=v,k2=v2, got {args.endpoint_selector!r}"
                    ) from None
            try:
                ports = [int(p) for p in args.endpoint_target_ports.split(",")] if args.endpoint_target_ports else ()
            except ValueError:
                raise EndpointListError(
                    f"--endpoint-target-ports: expected ports, got {args.endpoint_target_ports!r}"
                ) from None
            self.discovery = KubernetesDiscovery(
                self.datastore,
                pool_name=args.pool_name,
                pool_namespace=args.pool_namespace,
                pool_group=args.pool_group,
                endpoint_selector=selector,
                endpoint_target_ports=ports,
                kubeconfig=args.kubeconfig,
                on_objectives=self.runtimes.set_objectives if args.pool_name else None,
                config_map=args.config_map,
                on_config_text=self._config_map_changed,
            )
            await self.discovery.start()
        elif args.endpoints:
            self.datastore.set_endpoints(parse_endpoint_flag(args.endpoints))
        elif args.endpoints_file:
            self.endpoint_file = EndpointFile(self.datastore, args.endpoints_file)
            self.endpoint_file.load()
            self.endpoint_file.start()
        else:
            raise EndpointListError(
                "one of --endpoints, --endpoints-file, --pool-name or --endpoint-selector is required"
            )

    def _config_map_origin(self) -> str:
        return f"ConfigMap {self.args.pool_namespace}/{self.args.config_map}"

    def _config_map_changed(self, text: str) -> None:
        """A new EndpointPickerConfig from the watched ConfigMap: swap it in, or keep the old."""
        if self.config_map_loaded:
            self.runtimes.reload(text.encode("utf-8"), self._config_map_origin())

    async def _load_config_map(self) -> None:
        """In api mode, load the ConfigMap before serving, strictly: an invalid config fails the
        start (the reference crash-loops on it); a missing ConfigMap is waited for, not Ready
        meanwhile (the reference's pod waits for the ConfigMap its config file comes from)."""
        if self.discovery is None or not self.args.config_map:
            return
        self.runtimes.load_text(await self.discovery.config_text(), self._config_map_origin())
        self.config_map_loaded = True

    def _load_config(self) -> None:
        args = self.args
        if sum(bool(source) for source in (args.config_file, args.config_text, args.config_map)) > 1:
            raise ConfigError(["--config-file, --config-text and --config-map are mutually exclusive"])
        if args.config_map and not (args.pool_name or args.endpoint_selector):
            raise ConfigError(
                ["--config-map is read through the Kubernetes API: it needs --pool-name or --endpoint-selector"]
            )
        if args.config_file:
            self.runtimes.load_file(args.config_file)
        elif args.config_text:
            self.runtimes.load_text(args.config_text, "--config-text")
        if args.objectives_file:
            with open(args.objectives_file, encoding="utf-8") as f:
                self.runtimes.set_objectives(parse_objectives(f.read()))

    async def _config_installed(self, runtime: Runtime) -> None:
        """The data layer follows the installed config; stale metrics only exclude endpoints
        while something scrapes them."""
        await self.data_layer.apply(scrape_settings(runtime.data_sources))
        scraping = self.data_layer.collector is not None
        self.director.staleness_threshold = self.args.metrics_staleness_threshold if scraping else None

    async def _start_health_server(self) -> None:
        """Health first, so liveness answers while the start waits (e.g. for its ConfigMap)."""
        self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(
            HealthServicer(lambda: self.started and self.datastore.synced and not self.draining), self.health_server
        )
        self.health_server.add_insecure_port(f"{self.args.bind_address}:{self.args.grpc_health_port}")
        await self.health_server.start()

    async def start(self) -> None:
        args = self.args
        self._load_config()
        if args.config_file:
            self.config_watch = asyncio.create_task(self.runtimes.watch(args.config_file), name="config-watch")
        await self._start_health_server()
        await self._start_discovery()
        await self._load_config_map()
        await self.runtimes.start()
        bind = args.bind_address
        settings = ExtProcSettings(
            max_body_bytes=args.max_body_bytes,
            honour_subset_hint=not args.disable_endpoint_subset_filter,
        )
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)]
        self.grpc_server = grpc.aio.server(options=options)
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self.director, settings), self.grpc_server)
        address = f"{bind}:{args.grpc_port}"
        if args.secure_serving:
            self.grpc_server.add_secure_port(address, server_credentials(args.cert_path))
        else:
            self.grpc_server.add_insecure_port(address)
        decisions = self.decisions.entries if self.decisions is not None else None
        self.metrics_runner = await start_metrics_server(
            metrics_app(decisions, self.runtimes.describe), bind, args.metrics_port
        )
        await self.grpc_server.start()
        self.started = True
        metrics.INFO.labels(commit="", build_ref=importlib.metadata.version("picker")).set(1)
        log.info(
            "picker serving ext_proc on %s (%s), health on %s, metrics on %s; %d endpoints",
            address,
            "TLS" if args.secure_serving else "plaintext",
            args.grpc_health_port,
            args.metrics_port,
            len(self.datastore.endpoints()),
        )

    async def drain(self) -> None:
        """Report NOT_SERVING, keep serving for `--shutdown-delay`, then stop (see `stop`)."""
        self.draining = True
        if self.args.shutdown_delay > 0:
            log.info("draining for %.1fs before stopping", self.args.shutdown_delay)
            await asyncio.sleep(self.args.shutdown_delay)
        await self.stop()

    async def stop(self) -> None:
        if self.config_watch is not None:
            self.config_watch.cancel()
            await asyncio.gather(self.config_watch, return_exceptions=True)
        if self.endpoint_file is not None:
            await self.endpoint_file.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.runtimes.stop()
        await self.data_layer.stop()
        for server in (self.grpc_server, self.health_server):
            if server is not None:
                await server.stop(grace=self.args.shutdown_grace)
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()


async def run(args: argparse.Namespace) -> int:
    server = PickerServer(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The start may wait (for its ConfigMap): a signal meanwhile ends it.
    starting = asyncio.create_task(server.start(), name="start")
    stopping = asyncio.create_task(stop.wait(), name="stop-signal")
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        log.info("stopped before the start completed")
        await server.stop()
        return 0
    try:
        starting.result()
    except (EndpointListError, ConfigError, OSError, ValueError) as e:
        stopping.cancel()
        log.error("cannot start: %s", e)
        await server.stop()
        return 1
    await stopping
    log.info("shutting down")
    await server.drain()
    return 0


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
_MMAP_THRESHOLD_BYTES = 256 << 10


def _return_large_buffers_to_the_os() -> None:
    """Serve blocks of 256 KiB and more (request bodies) from mmap, so freeing them returns the
    memory: glibc otherwise raises its threshold after the first large free and keeps later
    large bodies in its heaps, and RSS ratchets up after bursts of big requests."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return  # the operator chose
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass  # not glibc (musl, macOS): that allocator's own policy applies


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.v, args.zap_encoder)
    _return_large_buffers_to_the_os()
    if args.pool_namespace is None:
        args.pool_namespace = os.environ.get("NAMESPACE", "default")
    import uvloop

    return uvloop.run(run(args))
