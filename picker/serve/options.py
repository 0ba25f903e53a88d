"""What `picker serve` runs with: the flags parsed, checked and resolved once at start
(`flags.serve_options`), then read, never changed, by the server it builds."""

from __future__ import annotations

from dataclasses import dataclass

from picker.datalayer.plugins import ScrapeSettings
from picker.state.url import StoreUrl
from picker.telemetry.logging import LogSettings


@dataclass(frozen=True, slots=True)
class ReferenceFeatures:
    """The values of the reference's feature flags; their implementations read them here (`ServeOptions.features`)."""

    leader_election: bool  # --ha-enable-leader-election: readiness only on the Lease holder
    metrics_endpoint_auth: bool  # --metrics-endpoint-auth: TokenReview + SubjectAccessReview on /metrics
    tracing: bool  # --tracing: OpenTelemetry spans, configured by OTEL_* variables
    pprof: bool  # --enable-pprof: profiling endpoints on the metrics port (telemetry.profiling)


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """The ports and processes that serve, and how they stop."""

    bind_address: str
    grpc_port: int  # ext_proc
    grpc_health_port: int
    metrics_port: int
    workers: int
    health_checking: bool  # the gRPC health service on the ext_proc port too
    shutdown_delay: float  # seconds NOT_SERVING but serving after SIGTERM
    shutdown_grace: float  # seconds then left to requests in flight


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """TLS on the ext_proc port: a certificate directory, else a self-signed certificate."""

    secure_serving: bool
    cert_path: str | None
    enable_cert_reload: bool  # accepted for the reference's sake: the picker always reloads


@dataclass(frozen=True, slots=True)
class DiscoveryOptions:
    """Where the endpoints come from: the Kubernetes API (a pool or a label selector), a list, or a file."""

    pool_name: str | None
    pool_namespace: str  # resolved: the flag, else $NAMESPACE, else default
    pool_group: str
    endpoint_selector: tuple[tuple[str, str], ...]  # label pairs; empty: none
    endpoint_target_ports: tuple[int, ...]
    endpoints: str | None
    endpoints_file: str | None
    kubeconfig: str | None
    config_map: str | None

    @property
    def uses_kubernetes(self) -> bool:
        return bool(self.pool_name or self.endpoint_selector)


@dataclass(frozen=True, slots=True)
class SchedulingOptions:
    """The EndpointPickerConfig's source (at most one of file, text and ConfigMap) and what requests may carry."""

    config_file: str | None
    config_text: str | None
    objectives_file: str | None
    max_body_bytes: int
    tenant_header: str | None  # lower case
    honour_subset_hint: bool  # not --disable-endpoint-subset-filter


@dataclass(frozen=True, slots=True)
class DataLayerOptions:
    """How often model server metrics are scraped and flushed, when they go stale, and where they are read."""

    refresh_interval: float
    pool_gauges_interval: float
    staleness_threshold: float
    scrape: ScrapeSettings  # the --model-server-metrics-* flags: the config's data source overrides them


@dataclass(frozen=True, slots=True)
class StateStoreOptions:
    """`--state-store`: the store shared with the other pickers, and which of its state is this picker's."""

    url: StoreUrl
    key: str | None


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Everything `picker serve` was told, checked."""

    serving: ServingOptions
    tls: TlsOptions
    discovery: DiscoveryOptions
    scheduling: SchedulingOptions
    data_layer: DataLayerOptions
    state_store: StateStoreOptions | None
    features: ReferenceFeatures
    lease_name: str | None  # the Lease leader election competes for
    logging: LogSettings
    tracing_requested: bool  # --tracing=true given: export even without an OTLP endpoint configured
    debug_decisions: bool  # GET /debug/decisions on the metrics port
