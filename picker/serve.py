"""`picker serve`: the ext_proc endpoint picker, with the reference EPP's flags."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib.metadata
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2_grpc

from picker.config.objectives import parse_objectives
from picker.config.runtime import Runtime, RuntimeHolder
from picker.config.schema import ConfigError
from picker.datalayer.layer import DataLayer
from picker.datalayer.plugins import ScrapeSettings, scrape_settings
from picker.datastore.store import Datastore
from picker.discovery.static import EndpointFile, EndpointListError, parse_endpoint_flag
from picker.extproc.server import ExtProcServer, ExtProcSettings, Tls
from picker.framework.durations import parse_duration as parse_go_duration
from picker.requestcontrol.director import Director
from picker.state.url import StoreUrl, parse_store_key, parse_store_url
from picker.telemetry import logging as logs
from picker.telemetry import metrics
from picker.telemetry.decisions import DecisionLog
from picker.telemetry.health import EXT_PROC_SERVICE, HealthServicer
from picker.telemetry.http import AccessReviewer, metrics_app, start_metrics_server, start_metrics_socket
from picker.telemetry.logging import DEFAULT_VERBOSITY, LogSettings
from picker.telemetry.profiling import add_profiling_routes
from picker.telemetry.tracing import start_tracing
from picker.workers.role import WorkerRole

if TYPE_CHECKING:
    from kubernetes import client as kube_client

    from picker.discovery.kubernetes import KubernetesDiscovery
    from picker.discovery.lease import LeaderElector
    from picker.state.sync import StateSync

log = logging.getLogger("picker")

STATE_STORE_PASSWORD_ENV = "PICKER_STATE_STORE_PASSWORD"


class FlagError(ValueError):
    """A flag the picker cannot honour as given; the message starts with the flag's name."""


class _FlagParser(argparse.ArgumentParser):
    """Raises FlagError instead of printing usage and exiting, so a bad flag is logged (as
    JSON with `--zap-encoder=json`) and the start fails with exit code 2, as the reference's."""

    def error(self, message: str) -> NoReturn:
        raise FlagError(message)


def parse_duration(text: str) -> float:
    """A Go duration flag (`50ms`, `2s`, `1m30s`, `0`) in seconds."""
    try:
        return parse_go_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


MAX_WORKERS = 64


def parse_workers(text: str) -> int:
    """`--workers`: a whole number from 1 to MAX_WORKERS."""
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number of processes, got {text!r}") from None
    if not 1 <= count <= MAX_WORKERS:
        raise ValueError(f"must be from 1 to {MAX_WORKERS}, got {count}")
    return count


def check_workers(args: argparse.Namespace) -> None:
    """Refuse what several workers cannot do yet."""
    if args.workers > 1 and reference_features(args).leader_election:
        raise FlagError(
            "--workers: leader election (--ha-enable-leader-election) runs in one process; use --workers=1 with it"
        )


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "t", "true", "yes"):
        return True
    if value in ("0", "f", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}")


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser raising ValueError, its message kept."""

    def check(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return check


def _bool_flag(parser: argparse._ActionsContainer, name: str, default: bool | None, help_: str) -> None:
    # Go-style: `--flag`, `--flag=true`, `--flag=false` (the reference chart's syntax). A None
    # default tells "not given" from the reference default (see REFERENCE_DEFAULTS).
    parser.add_argument(name, type=parse_bool, nargs="?", const=True, default=default, help=help_)


# The reference's feature flags and their defaults when the flag is not given: the reference's,
# but for --enable-pprof (see its help).
REFERENCE_DEFAULTS = {
    "ha_enable_leader_election": False,
    "metrics_endpoint_auth": True,
    "tracing": True,  # exports only when an OTLP endpoint is configured (telemetry.tracing)
    "enable_pprof": False,
}
# The reference refuses these (deprecated) when set: metrics come from engineConfigs.
REFUSED_METRIC_FLAGS = {
    "total_queued_requests_metric": ("--total-queued-requests-metric", "vllm:num_requests_waiting"),
    "total_running_requests_metric": ("--total-running-requests-metric", "vllm:num_requests_running"),
    "kv_cache_usage_percentage_metric": ("--kv-cache-usage-percentage-metric", "vllm:kv_cache_usage_perc"),
    "lora_info_metric": ("--lora-info-metric", "vllm:lora_requests_info"),
    "cache_info_metric": ("--cache-info-metric", "vllm:cache_config_info"),
}


@dataclass(frozen=True, slots=True)
class ReferenceFeatures:
    """The values of the reference's feature flags; their implementations read them here (`PickerServer.features`)."""

    leader_election: bool  # --ha-enable-leader-election: readiness only on the Lease holder
    metrics_endpoint_auth: bool  # --metrics-endpoint-auth: TokenReview + SubjectAccessReview on /metrics
    tracing: bool  # --tracing: OpenTelemetry spans, configured by OTEL_* variables
    pprof: bool  # --enable-pprof: profiling endpoints on the metrics port (telemetry.profiling)


def _flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def reference_features(args: argparse.Namespace) -> ReferenceFeatures:
    """The features' values. Raises FlagError for leader election without a Kubernetes API."""
    values: dict[str, bool] = {}
    uses_kubernetes = bool(args.pool_name or args.endpoint_selector)
    for dest, default in REFERENCE_DEFAULTS.items():
        given = getattr(args, dest)
        if given is None and dest == "metrics_endpoint_auth" and not uses_kubernetes:
            default = False  # no API server to review tokens with: static endpoints serve metrics openly
        values[dest] = default if given is None else given
    if values["ha_enable_leader_election"] and not uses_kubernetes:
        raise FlagError(
            "--ha-enable-leader-election: the Lease lives in the Kubernetes API; "
            "it needs --pool-name or --endpoint-selector"
        )
    return ReferenceFeatures(
        leader_election=values["ha_enable_leader_election"],
        metrics_endpoint_auth=values["metrics_endpoint_auth"],
        tracing=values["tracing"],
        pprof=values["enable_pprof"],
    )


def model_server_scrape(args: argparse.Namespace) -> ScrapeSettings:
    """The `--model-server-metrics-*` flags: where to scrape unless the config's
    `metrics-data-source` parameters say otherwise (the reference's precedence)."""
    path = args.model_server_metrics_path
    if not path.startswith("/"):
        raise FlagError(f"--model-server-metrics-path: must start with '/', got {path!r}")
    port = args.model_server_metrics_port
    if not 0 <= port <= 65535:
        raise FlagError(f"--model-server-metrics-port: must be a port number (0: the endpoint's own), got {port}")
    return ScrapeSettings(
        path=path,
        scheme=args.model_server_metrics_scheme,
        insecure_skip_verify=args.model_server_metrics_https_insecure_skip_verify,
        port=port,
    )


def check_refused(args: argparse.Namespace) -> None:
    """Refuse what the reference refuses (its deprecated metric-name flags when set), and flags
    that would do nothing."""
    if args.state_store_key is not None and args.state_store is None:
        raise FlagError("--state-store-key: names state in a store; give --state-store too")
    for dest, (flag, _) in REFUSED_METRIC_FLAGS.items():
        if getattr(args, dest) is not None:
            raise FlagError(
                f"{flag}: deprecated and cannot be used; configure metrics via engineConfigs "
                "(core-metrics-extractor) in the EndpointPickerConfig instead"
            )


def log_settings(args: argparse.Namespace) -> LogSettings:
    """`-v` and the zap flags."""
    return LogSettings(
        verbosity=args.v,
        development=args.zap_devel,
        encoder=args.zap_encoder,
        level=args.zap_log_level,
        stacktrace_level=args.zap_stacktrace_level,
        time_encoding=args.zap_time_encoding,
    )


def _add_logging_flags(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "-v",
        "--v",
        type=int,
        default=DEFAULT_VERBOSITY,
        help="Number for the log level verbosity: 2 default, "
        "3 verbose, 4 debug (one line per routed request: x-request-id, model, objective, endpoint, scores, "
        "decision time), 5 trace; negative means 2. (default 2)",
    )
    _bool_flag(
        p,
        "--zap-devel",
        True,
        "Development Mode defaults(encoder=consoleEncoder,stackTraceLevel=Warn). "
        "Production Mode defaults(encoder=jsonEncoder,stackTraceLevel=Error); the level follows -v. (default true)",
    )
    p.add_argument(
        "--zap-encoder",
        type=_checked(logs.parse_encoder),
        help="Zap log encoding (one of 'json' or 'console'): json "
        "writes one JSON object per line with zap's keys (level, ts, logger, caller, msg, error, stacktrace)",
    )
    p.add_argument(
        "--zap-log-level",
        type=_checked(logs.parse_zap_level),
        help="Zap Level to configure the verbosity of logging, "
        "overriding -v. Can be one of 'debug' (V1), 'info' (V0), 'error', 'panic' or any integer value > 0 which "
        "corresponds to custom debug levels of increasing verbosity (a -v level)",
    )
    p.add_argument(
        "--zap-stacktrace-level",
        type=_checked(logs.parse_stacktrace_level),
        help="Zap Level at and above which stacktraces are captured (one of 'info', 'error', 'panic').",
    )
    p.add_argument(
        "--zap-time-encoding",
        type=_checked(logs.parse_time_encoding),
        help="Zap time encoding (one of 'epoch', 'millis', 'nano', 'iso8601', 'rfc3339' or 'rfc3339nano'). "
        "Defaults to 'epoch' (the console encoder: 'iso8601').",
    )


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the reference EPP v1.5.0 (its meaning, or refused at start naming the
    flag), then the picker's own."""
    p = _FlagParser(prog="picker serve", description="Run the ext_proc endpoint picker.")
    srv = p.add_argument_group("serving")
    srv.add_argument(
        "--grpc-port", type=int, default=9002, help="gRPC port used for communicating with Envoy proxy. (default 9002)"
    )
    srv.add_argument(
        "--grpc-health-port",
        type=int,
        default=9003,
        help="The port used for gRPC liveness and readiness probes. (default 9003)",
    )
    srv.add_argument("--metrics-port", type=int, default=9090, help="The metrics port exposed by EPP. (default 9090)")
    srv.add_argument("--bind-address", default="0.0.0.0", help="address every port binds to (default 0.0.0.0)")
    srv.add_argument(
        "--workers",
        type=_checked(parse_workers),
        default=1,
        help="picker processes serving the ext_proc port together (SO_REUSEPORT: the kernel spreads Envoy's "
        "connections over them), under one parent that answers health and metrics for all of them and restarts "
        "a worker that dies. Each worker learns its own prefix index, in-flight counts and TTFT model: without "
        "--state-store a prompt's prefix is found only by the worker it reached before. (default 1)",
    )
    srv.add_argument(
        "--state-store",
        type=_checked(parse_store_url),
        metavar="URL",
        help="share what picks teach (the approximate prefix index, in-flight counts, the TTFT model's samples) with "
        "the other picker processes and replicas "
        "of the pool through this Redis/Valkey: redis://[user:pass@]host:port[/db], rediss:// for TLS; the "
        f"password may come from ${STATE_STORE_PASSWORD_ENV} instead. Requests read only local state: the store "
        "being down or slow never fails or delays one. (default: nothing shared)",
    )
    srv.add_argument(
        "--state-store-key",
        type=_checked(parse_store_key),
        metavar="KEY",
        help="which state in the --state-store is this picker's: pickers with the same key share it. Set it when "
        "deployments with static endpoints (--endpoints, --endpoints-file) share one store, or they would share "
        "one another's. (default: the pool's namespace/name)",
    )
    _bool_flag(
        srv,
        "--health-checking",
        False,
        "Enables health checking: the gRPC health service on the ext_proc port too "
        '(the ext_proc service and "" SERVING, NOT_SERVING once draining).',
    )
    srv.add_argument(
        "--shutdown-delay",
        type=parse_duration,
        default=0.0,
        help="after SIGTERM, report NOT_SERVING but keep serving this long, so proxies and "
        "Kubernetes stop sending new requests first (e.g. 5s)",
    )
    srv.add_argument(
        "--shutdown-grace",
        type=parse_duration,
        default=2.0,
        help="then let requests in flight finish for up to this long (e.g. 120s for long streams)",
    )
    _bool_flag(
        srv,
        "--ha-enable-leader-election",
        None,
        "Enables leader election for high availability. When enabled, "
        "readiness probes will only pass on the leader. The Lease is "
        "epp-<pool-namespace>-<pool-name>.gateway-api-inference-extension.sigs.k8s.io (15s duration); followers keep "
        "their endpoints synced and still answer ext_proc streams sent to them.",
    )
    src = p.add_argument_group("endpoints")
    src.add_argument("--pool-name", help="Name of the InferencePool this Endpoint Picker is associated with.")
    src.add_argument(
        "--pool-namespace",
        default="",
        help="Namespace of the InferencePool this Endpoint Picker is associated "
        "with (empty: $NAMESPACE, else default).",
    )
    src.add_argument(
        "--pool-group",
        default="inference.networking.k8s.io",
        help="Kubernetes resource group of the "
        "InferencePool: inference.networking.k8s.io (v1) or inference.networking.x-k8s.io (v1alpha2). "
        "(default inference.networking.k8s.io)",
    )
    src.add_argument(
        "--endpoint-selector",
        help="Selector to filter model server pods on, only 'key=value' pairs are supported. "
        "Format: a comma-separated list of key=value pairs without whitespace (e.g., 'app=vllm-qwen3-32b,env=prod').",
    )
    src.add_argument(
        "--endpoint-target-ports",
        help="Target ports of model server pods. Format: a comma-separated list of "
        "numbers without whitespace (e.g., '3000,3001,3002').",
    )
    src.add_argument("--endpoints", help="static endpoints instead of Kubernetes: ip:port,ip:port,...")
    src.add_argument("--endpoints-file", help="YAML list of endpoints instead of Kubernetes, re-read when it changes")
    src.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    src.add_argument("--config-map", help="ConfigMap holding the EndpointPickerConfig, watched for changes")
    cfg = p.add_argument_group("scheduling")
    cfg.add_argument("--config-file", help="The path to the configuration file (hot-reloaded).")
    cfg.add_argument("--config-text", help="The configuration specified as text, in lieu of a file.")
    cfg.add_argument("--objectives-file", help="InferenceObjectives (priorities) when not read from Kubernetes")
    cfg.add_argument("--max-body-bytes", type=int, default=16 << 20, help="request body cap (413 above)")
    cfg.add_argument("--tenant-header", help="request header naming the tenant that scopes prefix state")
    _bool_flag(
        cfg,
        "--disable-endpoint-subset-filter",
        False,
        "Disables respecting the x-gateway-destination-endpoint-subset metadata for dispatching requests in EPP.",
    )
    msp = p.add_argument_group("model server metrics")
    msp.add_argument(
        "--refresh-metrics-interval",
        type=parse_duration,
        default=0.05,
        help="Interval to refresh metrics. (default 50ms)",
    )
    msp.add_argument(
        "--refresh-prometheus-metrics-interval",
        type=parse_duration,
        default=5.0,
        help="Interval to flush Prometheus metrics. (default 5s)",
    )
    msp.add_argument(
        "--metrics-staleness-threshold",
        type=parse_duration,
        default=2.0,
        help="Duration after which metrics are considered stale. This is used to determine if an endpoint's "
        "metrics are fresh enough. (default 2s)",
    )
    msp.add_argument(
        "--model-server-metrics-scheme",
        choices=("http", "https"),
        default="http",
        help="Protocol scheme used in scraping metrics from endpoints; the metrics-data-source plugin's "
        "`scheme` parameter overrides it. Deprecated in the reference. (default http)",
    )
    msp.add_argument(
        "--model-server-metrics-path",
        default="/metrics",
        help="URL path used in scraping metrics from endpoints (trtllm-serve: /prometheus/metrics); the "
        "metrics-data-source plugin's `path` parameter overrides it. Deprecated in the reference. (default /metrics)",
    )
    msp.add_argument(
        "--model-server-metrics-port",
        type=int,
        default=0,
        help="Port to scrape metrics from endpoints, for pods with one target port (an endpoint that shares its "
        "IP with others keeps its own port); 0: the endpoint's port. Deprecated in the reference. (default 0)",
    )
    _bool_flag(
        msp,
        "--model-server-metrics-https-insecure-skip-verify",
        True,
        "Disable certificate verification when using 'https' scheme for 'model-server-metrics-scheme'; the "
        "metrics-data-source plugin's `insecureSkipVerify` parameter overrides it. (default true)",
    )
    for dest, (flag, reference_default) in REFUSED_METRIC_FLAGS.items():
        msp.add_argument(
            flag,
            dest=dest,
            metavar="METRIC",
            help=f"Refused, as by the reference (deprecated; its default was "
            f"{reference_default}): configure metrics via engineConfigs in the EndpointPickerConfig.",
        )
    sec = p.add_argument_group("security")
    _bool_flag(sec, "--secure-serving", True, "Enables secure serving (TLS on the ext_proc port). (default true)")
    sec.add_argument(
        "--cert-path",
        help="The path to the certificate for secure serving. The certificate and private key files "
        "are assumed to be named tls.crt and tls.key, respectively. If not set, and secureServing is enabled, then "
        "a self-signed certificate is used.",
    )
    _bool_flag(
        sec,
        "--enable-cert-reload",
        False,
        "Enables certificate reloading of the certificates specified in "
        "--cert-path. The picker always reloads them when they change, so false changes nothing.",
    )
    _bool_flag(
        sec,
        "--metrics-endpoint-auth",
        None,
        "Enables authentication and authorization of the metrics endpoint: "
        "a bearer token reviewed by the API server (TokenReview; else 401) whose user may get the path "
        "(SubjectAccessReview on the nonResourceURL, e.g. /metrics; else 403), on every path of the metrics port. "
        "(default true with --pool-name or --endpoint-selector; false with static endpoints)",
    )
    obs = p.add_argument_group("logging and diagnostics")
    _add_logging_flags(obs)
    _bool_flag(
        obs,
        "--tracing",
        None,
        "Enables emitting traces: OpenTelemetry spans per request and plugin, exported over OTLP gRPC, "
        "configured by the standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, "
        "OTEL_TRACES_SAMPLER[_ARG], default parentbased_traceidratio 0.1 as the reference). Left out (the "
        "reference default true), spans are exported only when an OTLP endpoint or OTEL_TRACES_EXPORTER=otlp is "
        "set; =true also exports to http://localhost:4317 without them, as the reference. (default true)",
    )
    _bool_flag(
        obs,
        "--enable-pprof",
        None,
        "Enables profiling handlers on the metrics port: /debug/pprof/profile?seconds=N (a sampling profile of "
        "all threads, collapsed stacks) and /debug/pprof/goroutine (stacks of all threads and asyncio tasks). "
        "Defaults to false, unlike the reference (true): they show the process's internals and the metrics port "
        "is unauthenticated unless --metrics-endpoint-auth protects it. (default false)",
    )
    _bool_flag(obs, "--enable-debug-decisions", False, "serve GET /debug/decisions on the metrics port")
    return p


def _encoder_hint(argv: list[str]) -> LogSettings:
    """Logging settings good enough to report flags that do not parse: only the encoder."""
    quick = _FlagParser(add_help=False)
    quick.add_argument("--zap-encoder", type=_checked(logs.parse_encoder))
    _bool_flag(quick, "--zap-devel", True, "")
    try:
        known, _ = quick.parse_known_args(argv)
    except FlagError:
        return LogSettings()
    return LogSettings(development=known.zap_devel, encoder=known.zap_encoder)


class PickerServer:
    """Everything `picker serve` runs, started and stopped together."""

    def __init__(self, args: argparse.Namespace, worker: WorkerRole | None = None) -> None:
        """Raises FlagError for a flag the picker cannot honour as given. `worker`: this is one
        of `--workers` processes; its health and metrics go to its parent, not to the flags' ports."""
        self.args = args
        self.worker = worker
        check_refused(args)
        self.features = reference_features(args)
        self.scrape_defaults = model_server_scrape(args)
        self.datastore = Datastore()
        self.decisions = DecisionLog(1000) if args.enable_debug_decisions else None
        self.data_layer = DataLayer(
            self.datastore,
            interval=args.refresh_metrics_interval,
            staleness_threshold=args.metrics_staleness_threshold,
            pool_gauges_interval=args.refresh_prometheus_metrics_interval,
            pool_name=args.pool_name or "",
        )
        self.state_sync = self._state_sync(args.state_store) if args.state_store else None
        self.runtimes = RuntimeHolder(
            self.datastore, self.decisions, on_install=self._config_installed, state_sync=self.state_sync
        )
        self.tracing = start_tracing(os.environ, self.features.tracing, requested=args.tracing is True)
        self.director = Director(
            self.datastore,
            self.runtimes,
            staleness_threshold=args.metrics_staleness_threshold,
            tenant_header=args.tenant_header.lower() if args.tenant_header else None,
            tracer=self.tracing,
            pool_name=args.pool_name or "",
        )
        # Gauges read from objects built here are bound here, once.
        pool_saturation = metrics.FLOW_POOL_SATURATION.labels(args.pool_name or "")
        pool_saturation.set_function(self.director.flow_control.reported_saturation)
        self.config_watch: asyncio.Task[None] | None = None
        self.started = False  # Ready only once everything runs: the config loaded, the servers up
        self.config_map_loaded = False  # later ConfigMap changes reload; the first one is loaded at start
        self.draining = False
        self.endpoint_file: EndpointFile | None = None
        self.discovery: KubernetesDiscovery | None = None
        self.ext_proc_server: ExtProcServer | None = None
        self.health_server: grpc.aio.Server | None = None
        self.metrics_runner: web.AppRunner | None = None
        self.kube_api: kube_client.ApiClient | None = None  # leader election and metrics auth
        self.leader_elector: LeaderElector | None = None
        self.lease_name: str | None = None
        if self.features.leader_election:
            from picker.discovery.lease import elected_name, lease_name

            self.lease_name = lease_name(args.pool_namespace, elected_name(args.pool_name, os.environ.get("POD_NAME")))

    def _state_sync(self, url: StoreUrl) -> StateSync:
        """`--state-store`: this process's link to the other pickers (connects once started)."""
        from picker.state.sync import StateSync, stream_name  # redis-py: only when asked for

        return StateSync(
            url,
            stream_name(self.args.pool_namespace, self.args.pool_name or "", self.args.state_store_key),
            self.datastore,
            password=url.password or os.environ.get(STATE_STORE_PASSWORD_ENV) or None,
        )

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
        """The data layer follows the installed config."""
        await self.data_layer.apply(scrape_settings(runtime.data_sources, self.scrape_defaults))

    async def _start_health_server(self) -> None:
        """Health first, so liveness answers while the start waits (e.g. for its ConfigMap)."""
        self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        servicer = HealthServicer(
            lambda: self.started and self.datastore.synced,
            lambda: self.draining,
            self._is_leader if self.features.leader_election else None,
        )
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self.health_server)
        if self.worker is not None:
            address = self.worker.health_address
        else:
            address = f"{self.args.bind_address}:{self.args.grpc_health_port}"
        self.health_server.add_insecure_port(address)
        await self.health_server.start()

    def _is_leader(self) -> bool:
        return self.leader_elector is not None and self.leader_elector.is_leader()

    async def _kube_client(self) -> kube_client.ApiClient:
        """The API client for leader election and metrics auth (credentials as discovery's)."""
        from picker.discovery.kubernetes import KubeCredentialsError, api_client

        if self.kube_api is None:
            try:
                self.kube_api = await asyncio.to_thread(api_client, self.args.kubeconfig)
            except KubeCredentialsError as exc:
                flags = [flag for flag, on in self._kube_features() if on]
                raise FlagError(f"{', '.join(flags)}: {exc}") from None
        return self.kube_api

    def _kube_features(self) -> list[tuple[str, bool]]:
        return [
            ("--ha-enable-leader-election", self.features.leader_election),
            ("--metrics-endpoint-auth", self.features.metrics_endpoint_auth),
        ]

    async def _start_leader_election(self) -> None:
        """Compete for the reference's Lease once everything runs: a replica that cannot start
        must not hold it."""
        from picker.discovery.lease import LeaderElector

        assert self.lease_name is not None
        self.leader_elector = LeaderElector(await self._kube_client(), self.args.pool_namespace, self.lease_name)
        self.leader_elector.start()

    async def _access_reviewer(self) -> AccessReviewer | None:
        if not self.features.metrics_endpoint_auth:
            return None
        from picker.telemetry.access_review import KubeAccessReviewer

        return KubeAccessReviewer(await self._kube_client())

    async def start(self) -> None:
        args = self.args
        self._load_config()
        if args.config_file:
            self.config_watch = asyncio.create_task(self.runtimes.watch(args.config_file), name="config-watch")
        await self._start_health_server()
        await self._start_discovery()
        await self._load_config_map()
        await self.runtimes.start()
        if self.state_sync is not None:
            self.state_sync.start()
        bind = args.bind_address
        settings = ExtProcSettings(
            max_body_bytes=args.max_body_bytes,
            honour_subset_hint=not args.disable_endpoint_subset_filter,
        )
        address = f"{bind}:{args.grpc_port}"
        tls = None
        if args.secure_serving and args.cert_path:
            tls = Tls(cert_dir=args.cert_path)
        elif args.secure_serving:  # as the reference: a self-signed certificate made at start
            from picker.extproc.tls import self_signed_certificate

            key, cert = self_signed_certificate()
            tls = Tls(key_pem=key, cert_pem=cert)
        decisions = self.decisions.entries if self.decisions is not None else None
        app = metrics_app(decisions, self.runtimes.describe, await self._access_reviewer())
        if self.features.pprof:
            add_profiling_routes(app)
        if self.worker is not None:
            self.metrics_runner = await start_metrics_socket(app, self.worker.metrics_socket)
        else:
            self.metrics_runner = await start_metrics_server(app, bind, args.metrics_port)
        self.ext_proc_server = ExtProcServer(self.director, settings)
        self.ext_proc_server.start(
            address,
            # Workers share the port through SO_REUSEPORT; one process alone must own it.
            reuse_port=self.worker is not None,
            tls=tls,
            # as the reference: the standard health service beside ext_proc
            health_services=("", EXT_PROC_SERVICE) if args.health_checking else (),
        )
        self.started = True
        if self.features.leader_election:
            await self._start_leader_election()
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
        await self._stop_leader_election()  # a standby takes over while this replica drains
        if self.ext_proc_server is not None:
            self.ext_proc_server.enter_graceful_shutdown()
        if self.args.shutdown_delay > 0:
            log.info("draining for %.1fs before stopping", self.args.shutdown_delay)
            await asyncio.sleep(self.args.shutdown_delay)
        await self.stop()

    async def _stop_leader_election(self) -> None:
        if self.leader_elector is not None:
            await self.leader_elector.stop()
            self.leader_elector = None

    async def stop(self) -> None:
        await self._stop_leader_election()
        if self.config_watch is not None:
            self.config_watch.cancel()
            await asyncio.gather(self.config_watch, return_exceptions=True)
        if self.endpoint_file is not None:
            await self.endpoint_file.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.runtimes.stop()
        if self.state_sync is not None:
            await self.state_sync.stop()
        await self.data_layer.stop()
        if self.ext_proc_server is not None:
            await self.ext_proc_server.stop(self.args.shutdown_grace)
        if self.health_server is not None:
            await self.health_server.stop(grace=self.args.shutdown_grace)
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
        if self.kube_api is not None:
            await asyncio.to_thread(self.kube_api.close)
        if self.tracing is not None:  # last: the spans of the requests that just finished
            await self.tracing.shutdown()


async def run(args: argparse.Namespace, worker: WorkerRole | None = None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        server = PickerServer(args, worker)
    except (EndpointListError, ConfigError, OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 1
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
    # RuntimeError: gRPC could not bind a port.
    except (EndpointListError, ConfigError, OSError, ValueError, RuntimeError) as e:
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
    try:
        args = build_parser().parse_args(argv)
    except FlagError as error:
        logs.configure(_encoder_hint(argv))
        log.error("invalid flags: %s", error)
        return 2
    logs.configure(log_settings(args))
    log.info("flags processed", extra={"flags": {_flag_name(k)[2:]: v for k, v in vars(args).items()}})
    _return_large_buffers_to_the_os()
    if not args.pool_namespace:  # as the reference: empty means $NAMESPACE, else default
        args.pool_namespace = os.environ.get("NAMESPACE") or "default"
    import uvloop

    if args.workers == 1:
        return uvloop.run(run(args))
    try:
        check_workers(args)
    except FlagError as error:
        log.error("cannot start: %s", error)
        return 1
    from picker.workers.supervisor import supervise

    return uvloop.run(supervise(args, serve_worker, metrics_reviewer))


def serve_worker(args: argparse.Namespace, role: WorkerRole) -> None:
    """A `--workers` process: the picker as `picker serve` runs it, its exit code the process's."""
    import uvloop

    logs.configure(log_settings(args))
    _return_large_buffers_to_the_os()
    raise SystemExit(uvloop.run(run(args, role)))


async def metrics_reviewer(args: argparse.Namespace) -> AccessReviewer | None:
    """The access reviewer of the `--workers` parent's metrics port (`--metrics-endpoint-auth`)."""
    if not reference_features(args).metrics_endpoint_auth:
        return None
    from picker.discovery.kubernetes import KubeCredentialsError, api_client
    from picker.telemetry.access_review import KubeAccessReviewer

    try:
        api = await asyncio.to_thread(api_client, args.kubeconfig)
    except KubeCredentialsError as exc:
        raise FlagError(f"--metrics-endpoint-auth: {exc}") from None
    return KubeAccessReviewer(api)
