"""`picker bbr`'s flags (the reference `bbr`'s) and its run: the ext_proc port, the gRPC health
port, the metrics port and, when a plugin needs it, the watch of the adapter ConfigMaps."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import signal
from dataclasses import dataclass

from picker.bbr import metrics
from picker.bbr.adapters import BBR_MANAGED_LABEL, AdaptersStore
from picker.bbr.plugins import PluginSpec, PluginSpecError, parse_plugin_spec, request_plugins
from picker.bbr.server import BbrServer
from picker.discovery.kube_reflector import KubeReflector
from picker.extproc.server import Tls
from picker.serve.flags import FlagError, FlagParser, add_logging_flags, encoder_hint, log_settings, parse_bool
from picker.telemetry import logging as logs
from picker.telemetry.http import metrics_app, start_metrics_server

log = logging.getLogger("picker.bbr")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# The reference answers SERVING for any service name; these are the ones probes ask for.
HEALTH_SERVICES = ("", EXT_PROC_SERVICE, "inference-extension")
_STOP_GRACE_SECONDS = 5.0


def _go_bool(parser: argparse._ActionsContainer, name: str, default: bool, help_: str) -> None:
    parser.add_argument(name, type=parse_bool, nargs="?", const=True, default=default, help=help_)


def _plugin(text: str) -> PluginSpec:
    try:
        return parse_plugin_spec(text)
    except PluginSpecError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    """The reference `bbr` v1.5.0's flags, with its defaults."""
    p = FlagParser(prog="picker bbr", description="Body-based routing: the body's model as a routing header.")
    p.add_argument("--grpc-port", type=int, default=9004, help="The gRPC port used for communicating with Envoy proxy.")
    p.add_argument(
        "--grpc-health-port", type=int, default=9005, help="The port used for gRPC liveness and readiness probes."
    )
    p.add_argument("--metrics-port", type=int, default=9090, help="The metrics port exposed by BBR.")
    _go_bool(p, "--tracing", True, "Accepted for the reference's sake; picker bbr emits no spans.")
    _go_bool(p, "--metrics-endpoint-auth", True, "Review the metrics endpoint's bearer tokens with the Kubernetes API.")
    _go_bool(
        p,
        "--streaming",
        False,
        "Accepted for the reference's sake: picker bbr follows the body mode Envoy sends "
        "(BUFFERED or FULL_DUPLEX_STREAMED) whatever this says.",
    )
    _go_bool(p, "--secure-serving", True, "Serve ext_proc over TLS with a self-signed certificate made at start.")
    _go_bool(p, "--enable-pprof", True, "Accepted for the reference's sake; picker bbr has no pprof handlers.")
    p.add_argument(
        "--plugin",
        type=_plugin,
        action="append",
        default=[],
        help="Repeatable. --plugin <type>:<name>[:<json>] (body-field-to-header, base-model-to-header); "
        "none: the model into X-Gateway-Model-Name, then its base model.",
    )
    add_logging_flags(p)
    return p


@dataclass(frozen=True, slots=True)
class BbrOptions:
    """What `picker bbr` runs with."""

    grpc_port: int
    health_port: int
    metrics_port: int
    secure_serving: bool
    metrics_endpoint_auth: bool
    plugins: tuple[PluginSpec, ...]
    namespace: str | None  # the reference's NAMESPACE: watch the ConfigMaps of this namespace only


def bbr_options(args: argparse.Namespace) -> BbrOptions:
    """The checked options (FlagError as the reference's checks word it)."""
    ports = {"grpc-port": args.grpc_port, "grpc-health-port": args.grpc_health_port, "metrics-port": args.metrics_port}
    for name, port in ports.items():
        if not 1 <= port <= 65535:
            raise FlagError(f'invalid value {port} for flag "{name}": must be between 1 and 65535')
    if len(set(ports.values())) < 3:
        raise FlagError("port conflict: grpc-port, grpc-health-port and metrics-port must all be different")
    return BbrOptions(
        grpc_port=args.grpc_port,
        health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        secure_serving=args.secure_serving,
        metrics_endpoint_auth=args.metrics_endpoint_auth,
        plugins=tuple(args.plugin),
        namespace=os.environ.get("NAMESPACE") or None,
    )


class _AdapterWatch:
    """The labelled ConfigMaps (cluster-wide, or one namespace) kept in an AdaptersStore."""

    def __init__(self, namespace: str | None) -> None:
        self.store = AdaptersStore()
        self.namespace = namespace
        self.reflector: KubeReflector | None = None

    async def start(self) -> None:
        from picker.discovery.kube_requests import list_call
        from picker.discovery.kubernetes import api_client

        api = await asyncio.to_thread(api_client, None)
        path = f"/api/v1/namespaces/{self.namespace}/configmaps" if self.namespace else "/api/v1/configmaps"
        call = list_call(api, path, label_selector=f"{BBR_MANAGED_LABEL}=true")
        self.reflector = KubeReflector(
            "bbr-configmaps",
            call,
            lambda objects: self.store.replace(objects.values()),
            asyncio.get_running_loop(),
            across_namespaces=self.namespace is None,
        )
        self.reflector.start()

    async def stop(self) -> None:
        if self.reflector is not None:
            self.reflector.stop()
            await asyncio.to_thread(self.reflector.join, _STOP_GRACE_SECONDS)


async def run(options: BbrOptions) -> int:
    """Serve until SIGTERM or SIGINT; 1 when the start fails."""
    watch: _AdapterWatch | None = None

    def adapters() -> AdaptersStore:
        nonlocal watch
        watch = watch or _AdapterWatch(options.namespace)
        return watch.store

    plugins = request_plugins(options.plugins, adapters)
    if watch is not None:
        await watch.start()
    tls = None
    if options.secure_serving:
        from picker.extproc.tls import self_signed_certificate

        key, cert = self_signed_certificate()
        tls = Tls(key_pem=key, cert_pem=cert)
    server, health = BbrServer(plugins), BbrServer(())
    reviewer = None
    if options.metrics_endpoint_auth:
        from picker.discovery.kubernetes import api_client
        from picker.telemetry.access_review import KubeAccessReviewer

        reviewer = KubeAccessReviewer(await asyncio.to_thread(api_client, None))
    try:
        server.start(f"0.0.0.0:{options.grpc_port}", tls=tls)
        health.start(f"0.0.0.0:{options.health_port}", health_services=HEALTH_SERVICES)
        metrics_runner = await start_metrics_server(metrics_app(reviewer=reviewer), "0.0.0.0", options.metrics_port)
    except OSError as error:
        log.error("cannot start: %s", error)
        return 1
    metrics.INFO.labels(commit="", build_ref=importlib.metadata.version("picker")).set(1)
    log.info(
        "picker bbr serving ext_proc on %d (%s), health on %d, metrics on %d; %d plugins",
        server.port,
        "TLS" if tls else "plaintext",
        health.port,
        options.metrics_port,
        len(plugins),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(_STOP_GRACE_SECONDS)
    await health.stop(0.0)
    await metrics_runner.cleanup()
    if watch is not None:
        await watch.stop()
    return 0


def main(argv: list[str]) -> int:
    """`picker bbr ARGV`: 2 for flags that do not parse, 1 for a start that fails, else 0."""
    try:
        args = build_parser().parse_args(argv)
        options = bbr_options(args)
    except FlagError as error:
        logs.configure(encoder_hint(argv))
        log.error("invalid flags: %s", error)
        return 2
    logs.configure(log_settings(args))
    import uvloop

    from picker.discovery.kubernetes import KubeCredentialsError

    try:
        return uvloop.run(run(options))
    except (PluginSpecError, KubeCredentialsError) as error:
        log.error("cannot start: %s", error)
        return 1
