"""`picker serve`'s flags: every flag of the reference EPP v1.5.0 (its meaning, or refused at
start naming it), then the picker's own; parsed, checked and resolved into `ServeOptions`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from picker.config.builtin_configs import resolve_config_path
from picker.config.schema import ConfigError
from picker.datalayer.plugins import ScrapeSettings
from picker.discovery.static import EndpointListError
from picker.framework.durations import parse_duration as parse_go_duration
from picker.serve.options import (
    DataLayerOptions,
    DiscoveryOptions,
    ReferenceFeatures,
    SchedulingOptions,
    ServeOptions,
    ServingOptions,
    StateStoreOptions,
    TlsOptions,
)
from picker.state.url import parse_store_key, parse_store_url
from picker.telemetry import logging as logs
from picker.telemetry.logging import DEFAULT_VERBOSITY, LogSettings

STATE_STORE_PASSWORD_ENV = "PICKER_STATE_STORE_PASSWORD"


class FlagError(ValueError):
    """A flag the picker cannot honour as given; the message starts with the flag's name."""


class FlagParser(argparse.ArgumentParser):
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


def check_workers(workers: int, features: ReferenceFeatures) -> None:
    """Refuse what several workers cannot do yet."""
    if workers > 1 and features.leader_election:
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


def processed_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag's value under its name, as the reference's "flags processed" start-up line lists them."""
    return {dest.replace("_", "-"): value for dest, value in vars(args).items()}


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


def endpoint_selector(text: str | None) -> tuple[tuple[str, str], ...]:
    """`--endpoint-selector k=v,k2=v2`: the label pairs (a later value for a key wins)."""
    if not text:
        return ()
    try:
        return tuple(dict(part.split("=", 1) for part in text.split(",")).items())
    except ValueError:
        raise EndpointListError(f"--endpoint-selector: expected k=v,k2=v2, got {text!r}") from None


def endpoint_target_ports(text: str | None) -> tuple[int, ...]:
    """`--endpoint-target-ports 8000,8001`."""
    try:
        return tuple(int(port) for port in text.split(",")) if text else ()
    except ValueError:
        raise EndpointListError(f"--endpoint-target-ports: expected ports, got {text!r}") from None


def check_config_source(args: argparse.Namespace) -> None:
    """At most one config source, and the ConfigMap only where there is an API server to read it from."""
    if sum(bool(source) for source in (args.config_file, args.config_text, args.config_map)) > 1:
        raise ConfigError(["--config-file, --config-text and --config-map are mutually exclusive"])
    if args.config_map and not (args.pool_name or args.endpoint_selector):
        raise ConfigError(
            ["--config-map is read through the Kubernetes API: it needs --pool-name or --endpoint-selector"]
        )


def serve_options(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServeOptions:
    """The parsed flags checked and resolved (with `$NAMESPACE` and `$POD_NAME` from `environ`).
    Raises FlagError for a flag the picker cannot honour as given (ValueError, EndpointListError
    or ConfigError for a value or combination it cannot use)."""
    check_refused(args)
    features = reference_features(args)
    check_workers(args.workers, features)
    check_config_source(args)
    kubernetes = bool(args.pool_name or args.endpoint_selector)
    # as the reference: an empty namespace means $NAMESPACE, else default
    pool_namespace = args.pool_namespace or environ.get("NAMESPACE") or "default"
    lease = None
    if features.leader_election:
        from picker.discovery.lease import elected_name, lease_name

        lease = lease_name(pool_namespace, elected_name(args.pool_name, environ.get("POD_NAME")))
    return ServeOptions(
        serving=ServingOptions(
            bind_address=args.bind_address,
            grpc_port=args.grpc_port,
            grpc_health_port=args.grpc_health_port,
            metrics_port=args.metrics_port,
            workers=args.workers,
            health_checking=args.health_checking,
            shutdown_delay=args.shutdown_delay,
            shutdown_grace=args.shutdown_grace,
        ),
        tls=TlsOptions(
            secure_serving=args.secure_serving, cert_path=args.cert_path, enable_cert_reload=args.enable_cert_reload
        ),
        discovery=DiscoveryOptions(
            pool_name=args.pool_name,
            pool_namespace=pool_namespace,
            pool_group=args.pool_group,
            endpoint_selector=endpoint_selector(args.endpoint_selector),
            # read only where there are pods to take them from, as before
            endpoint_target_ports=endpoint_target_ports(args.endpoint_target_ports) if kubernetes else (),
            endpoints=args.endpoints,
            endpoints_file=args.endpoints_file,
            kubeconfig=args.kubeconfig,
            config_map=args.config_map,
        ),
        scheduling=SchedulingOptions(
            # a built-in config's name becomes its file here, so loading and watching read a path
            config_file=str(resolve_config_path(args.config_file)) if args.config_file else None,
            config_text=args.config_text,
            objectives_file=args.objectives_file,
            max_body_bytes=args.max_body_bytes,
            tenant_header=args.tenant_header.lower() if args.tenant_header else None,
            honour_subset_hint=not args.disable_endpoint_subset_filter,
        ),
        data_layer=DataLayerOptions(
            refresh_interval=args.refresh_metrics_interval,
            pool_gauges_interval=args.refresh_prometheus_metrics_interval,
            staleness_threshold=args.metrics_staleness_threshold,
            scrape=model_server_scrape(args),
        ),
        state_store=StateStoreOptions(args.state_store, args.state_store_key) if args.state_store else None,
        features=features,
        lease_name=lease,
        logging=log_settings(args),
        tracing_requested=args.tracing is True,
        debug_decisions=args.enable_debug_decisions,
    )


def add_logging_flags(p: argparse._ActionsContainer) -> None:
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
    p = FlagParser(prog="picker serve", description="Run the ext_proc endpoint picker.")
    _add_serving_flags(p.add_argument_group("serving"))
    _add_endpoint_flags(p.add_argument_group("endpoints"))
    _add_scheduling_flags(p.add_argument_group("scheduling"))
    _add_model_server_metrics_flags(p.add_argument_group("model server metrics"))
    _add_security_flags(p.add_argument_group("security"))
    _add_diagnostics_flags(p.add_argument_group("logging and diagnostics"))
    return p


def _add_serving_flags(srv: argparse._ArgumentGroup) -> None:
    """The ports, the processes and their shutdown."""
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


def _add_endpoint_flags(src: argparse._ArgumentGroup) -> None:
    """Where the endpoints come from."""
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


def _add_scheduling_flags(cfg: argparse._ArgumentGroup) -> None:
    """The EndpointPickerConfig and what requests may carry."""
    cfg.add_argument(
        "--config-file",
        help="The path to the configuration file (hot-reloaded), or a built-in config's name (picker-best.yaml, ...).",
    )
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


def _add_model_server_metrics_flags(msp: argparse._ArgumentGroup) -> None:
    """Scraping the model servers (the reference's deprecated metric-name flags refused)."""
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


def _add_security_flags(sec: argparse._ArgumentGroup) -> None:
    """TLS and the metrics port's access control."""
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


def _add_diagnostics_flags(obs: argparse._ArgumentGroup) -> None:
    """Logs, traces and debugging endpoints."""
    add_logging_flags(obs)
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


def encoder_hint(argv: list[str]) -> LogSettings:
    """Logging settings good enough to report flags that do not parse: only the encoder."""
    quick = FlagParser(add_help=False)
    quick.add_argument("--zap-encoder", type=_checked(logs.parse_encoder))
    _bool_flag(quick, "--zap-devel", True, "")
    try:
        known, _ = quick.parse_known_args(argv)
    except FlagError:
        return LogSettings()
    return LogSettings(development=known.zap_devel, encoder=known.zap_encoder)
