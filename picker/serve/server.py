"""`picker serve`'s composition root: `PickerServer` builds the datastore, the data layer,
discovery, the config runtimes, the director, the ext_proc, health and metrics servers from
the options, and starts and stops them together; `run` serves until a signal."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import signal
from typing import TYPE_CHECKING

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2_grpc

from picker.config.objectives import parse_objectives
from picker.config.runtime import Runtime, RuntimeHolder
from picker.config.schema import ConfigError
from picker.datalayer.layer import DataLayer
from picker.datalayer.plugins import scrape_settings
from picker.datastore.store import Datastore
from picker.discovery.static import EndpointFile, EndpointListError, parse_endpoint_flag
from picker.extproc.server import ExtProcServer, ExtProcSettings, Tls
from picker.requestcontrol.director import Director
from picker.serve.flags import STATE_STORE_PASSWORD_ENV, FlagError
from picker.serve.options import ServeOptions, StateStoreOptions
from picker.telemetry import metrics
from picker.telemetry.decisions import DecisionLog
from picker.telemetry.health import EXT_PROC_SERVICE, HealthServicer
from picker.telemetry.http import AccessReviewer, metrics_app, start_metrics_server, start_metrics_socket
from picker.telemetry.profiling import add_profiling_routes
from picker.telemetry.tracing import start_tracing
from picker.workers.role import WorkerRole

if TYPE_CHECKING:
    from kubernetes import client as kube_client

    from picker.discovery.kubernetes import KubernetesDiscovery
    from picker.discovery.lease import LeaderElector
    from picker.state.sync import StateSync

log = logging.getLogger("picker")


class PickerServer:
    """Everything `picker serve` runs, started and stopped together."""

    def __init__(self, options: ServeOptions, worker: WorkerRole | None = None) -> None:
        """`worker`: this is one of `--workers` processes; its health and metrics go to its
        parent, not to the flags' ports."""
        self.options = options
        self.worker = worker
        self.features = options.features
        pool_name = options.discovery.pool_name or ""
        self.datastore = Datastore()
        self.decisions = DecisionLog(1000) if options.debug_decisions else None
        self.data_layer = DataLayer(
            self.datastore,
            interval=options.data_layer.refresh_interval,
            staleness_threshold=options.data_layer.staleness_threshold,
            pool_gauges_interval=options.data_layer.pool_gauges_interval,
            pool_name=pool_name,
        )
        self.state_sync = self._state_sync(options.state_store) if options.state_store else None
        self.runtimes = RuntimeHolder(
            self.datastore, self.decisions, on_install=self._config_installed, state_sync=self.state_sync
        )
        self.tracing = start_tracing(os.environ, self.features.tracing, requested=options.tracing_requested)
        self.director = Director(
            self.datastore,
            self.runtimes,
            staleness_threshold=options.data_layer.staleness_threshold,
            tenant_header=options.scheduling.tenant_header,
            tracer=self.tracing,
            pool_name=pool_name,
        )
        # Gauges read from objects built here are bound here, once.
        pool_saturation = metrics.FLOW_POOL_SATURATION.labels(pool_name)
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

    def _state_sync(self, store: StateStoreOptions) -> StateSync:
        """`--state-store`: this process's link to the other pickers (connects once started)."""
        from picker.state.sync import StateSync, stream_name  # redis-py: only when asked for

        discovery = self.options.discovery
        return StateSync(
            store.url,
            stream_name(discovery.pool_namespace, discovery.pool_name or "", store.key),
            self.datastore,
            password=store.url.password or os.environ.get(STATE_STORE_PASSWORD_ENV) or None,
        )

    async def _start_discovery(self) -> None:
        """Endpoints from the flags, a file, or the Kubernetes API (pool or label selector)."""
        options = self.options.discovery
        if options.uses_kubernetes:
            from picker.discovery.kubernetes import KubernetesDiscovery  # the client is heavy to import

            self.discovery = KubernetesDiscovery(
                self.datastore,
                pool_name=options.pool_name,
                pool_namespace=options.pool_namespace,
                pool_group=options.pool_group,
                endpoint_selector=dict(options.endpoint_selector) or None,
                endpoint_target_ports=options.endpoint_target_ports,
                kubeconfig=options.kubeconfig,
                on_objectives=self.runtimes.set_objectives if options.pool_name else None,
                on_model_rewrites=self.runtimes.set_model_rewrites if options.pool_name else None,
                config_map=options.config_map,
                on_config_text=self._config_map_changed,
            )
            await self.discovery.start()
        elif options.endpoints:
            self.datastore.set_endpoints(parse_endpoint_flag(options.endpoints))
        elif options.endpoints_file:
            self.endpoint_file = EndpointFile(self.datastore, options.endpoints_file)
            self.endpoint_file.load()
            self.endpoint_file.start()
        else:
            raise EndpointListError(
                "one of --endpoints, --endpoints-file, --pool-name or --endpoint-selector is required"
            )

    def _config_map_origin(self) -> str:
        return f"ConfigMap {self.options.discovery.pool_namespace}/{self.options.discovery.config_map}"

    def _config_map_changed(self, text: str) -> None:
        """A new EndpointPickerConfig from the watched ConfigMap: swap it in, or keep the old."""
        if self.config_map_loaded:
            self.runtimes.reload(text.encode("utf-8"), self._config_map_origin())

    async def _load_config_map(self) -> None:
        """In api mode, load the ConfigMap before serving, strictly: an invalid config fails the
        start (the reference crash-loops on it); a missing ConfigMap is waited for, not Ready
        meanwhile (the reference's pod waits for the ConfigMap its config file comes from)."""
        if self.discovery is None or not self.options.discovery.config_map:
            return
        self.runtimes.load_text(await self.discovery.config_text(), self._config_map_origin())
        self.config_map_loaded = True

    def _load_config(self) -> None:
        scheduling = self.options.scheduling
        if scheduling.config_file:
            self.runtimes.load_file(scheduling.config_file)
        elif scheduling.config_text:
            self.runtimes.load_text(scheduling.config_text, "--config-text")
        if scheduling.objectives_file:
            with open(scheduling.objectives_file, encoding="utf-8") as f:
                self.runtimes.set_objectives(parse_objectives(f.read()))

    async def _config_installed(self, runtime: Runtime) -> None:
        """The data layer follows the installed config."""
        await self.data_layer.apply(scrape_settings(runtime.data_sources, self.options.data_layer.scrape))

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
            address = f"{self.options.serving.bind_address}:{self.options.serving.grpc_health_port}"
        self.health_server.add_insecure_port(address)
        await self.health_server.start()

    def _is_leader(self) -> bool:
        return self.leader_elector is not None and self.leader_elector.is_leader()

    async def _kube_client(self) -> kube_client.ApiClient:
        """The API client for leader election and metrics auth (credentials as discovery's)."""
        from picker.discovery.kubernetes import KubeCredentialsError, api_client

        if self.kube_api is None:
            try:
                self.kube_api = await asyncio.to_thread(api_client, self.options.discovery.kubeconfig)
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

        assert self.options.lease_name is not None
        self.leader_elector = LeaderElector(
            await self._kube_client(), self.options.discovery.pool_namespace, self.options.lease_name
        )
        self.leader_elector.start()

    async def _access_reviewer(self) -> AccessReviewer | None:
        if not self.features.metrics_endpoint_auth:
            return None
        from picker.telemetry.access_review import KubeAccessReviewer

        return KubeAccessReviewer(await self._kube_client())

    async def start(self) -> None:
        options = self.options
        serving = options.serving
        self._load_config()
        if options.scheduling.config_file:
            self.config_watch = asyncio.create_task(
                self.runtimes.watch(options.scheduling.config_file), name="config-watch"
            )
        await self._start_health_server()
        await self._start_discovery()
        await self._load_config_map()
        await self.runtimes.start()
        if self.state_sync is not None:
            self.state_sync.start()
        bind = serving.bind_address
        settings = ExtProcSettings(
            max_body_bytes=options.scheduling.max_body_bytes,
            honour_subset_hint=options.scheduling.honour_subset_hint,
        )
        address = f"{bind}:{serving.grpc_port}"
        tls = None
        if options.tls.secure_serving and options.tls.cert_path:
            tls = Tls(cert_dir=options.tls.cert_path)
        elif options.tls.secure_serving:  # as the reference: a self-signed certificate made at start
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
            self.metrics_runner = await start_metrics_server(app, bind, serving.metrics_port)
        self.ext_proc_server = ExtProcServer(self.director, settings)
        metrics.STREAMS_ACTIVE.set_function(self.ext_proc_server.streams_active)
        self.ext_proc_server.start(
            address,
            # Workers share the port through SO_REUSEPORT; one process alone must own it.
            reuse_port=self.worker is not None,
            tls=tls,
            # as the reference: the standard health service beside ext_proc
            health_services=("", EXT_PROC_SERVICE) if serving.health_checking else (),
        )
        self.started = True
        if self.features.leader_election:
            await self._start_leader_election()
        metrics.INFO.labels(commit="", build_ref=importlib.metadata.version("picker")).set(1)
        log.info(
            "picker serving ext_proc on %s (%s), health on %s, metrics on %s; %d endpoints",
            address,
            "TLS" if options.tls.secure_serving else "plaintext",
            serving.grpc_health_port,
            serving.metrics_port,
            len(self.datastore.endpoints()),
        )

    async def drain(self) -> None:
        """Report NOT_SERVING, keep serving for `--shutdown-delay`, then stop (see `stop`)."""
        self.draining = True
        await self._stop_leader_election()  # a standby takes over while this replica drains
        if self.ext_proc_server is not None:
            self.ext_proc_server.enter_graceful_shutdown()
        delay = self.options.serving.shutdown_delay
        if delay > 0:
            log.info("draining for %.1fs before stopping", delay)
            await asyncio.sleep(delay)
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
            await self.ext_proc_server.stop(self.options.serving.shutdown_grace)
        if self.health_server is not None:
            await self.health_server.stop(grace=self.options.serving.shutdown_grace)
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
        if self.kube_api is not None:
            await asyncio.to_thread(self.kube_api.close)
        if self.tracing is not None:  # last: the spans of the requests that just finished
            await self.tracing.shutdown()


async def run(options: ServeOptions, worker: WorkerRole | None = None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        server = PickerServer(options, worker)
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
