"""Endpoint identity and the state plugins read about it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


def join_host_port(ip: str, port: int) -> str:
    """`ip:port`, IPv6 bracketed, as Envoy's original-destination cluster expects."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """Inverse of `join_host_port`; raises ValueError on a malformed address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"not an ip:port address: {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server endpoint: a pod, or one data-parallel rank (target port) of a pod."""

    ip: str
    port: int
    name: str = ""
    namespace: str = ""
    labels: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    # ZMQ address of the engine's KV-event publisher, when known (e.g. "tcp://10.0.0.1:5557").
    kv_events_address: str | None = None
    # `ip:port`, the endpoint's key everywhere; computed once (it is read many times a request).
    address: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "address", join_host_port(self.ip, self.port))

    @property
    def engine_type(self) -> str | None:
        return self.labels.get("inference.networking.k8s.io/engine-type")


@dataclass(frozen=True, slots=True)
class EndpointMetrics:
    """What the data layer last scraped from an endpoint's /metrics page."""

    waiting_queue_size: int = 0
    running_requests_size: int = 0
    kv_cache_usage: float = 0.0  # fraction in [0, 1]
    active_models: frozenset[str] = frozenset()  # running LoRA adapters
    waiting_models: frozenset[str] = frozenset()  # waiting LoRA adapters
    max_active_models: int = 0
    cache_block_size: int = 0  # tokens per KV block; 0 = unknown
    cache_num_blocks: int = 0  # GPU KV blocks; 0 = unknown
    update_time: float = 0.0  # time.monotonic() of the last successful scrape; 0 = never

    def stamped(self, update_time: float) -> EndpointMetrics:
        """The same values as of `update_time`: `dataclasses.replace` at half its cost, for the
        scrapes that find a page unchanged (every endpoint, every interval)."""
        return EndpointMetrics(
            self.waiting_queue_size,
            self.running_requests_size,
            self.kv_cache_usage,
            self.active_models,
            self.waiting_models,
            self.max_active_models,
            self.cache_block_size,
            self.cache_num_blocks,
            update_time,
        )


@dataclass(frozen=True, slots=True)
class EndpointState:
    """An endpoint as the scheduler sees it for one decision: identity, metrics, and load
    the picker itself has sent there and not yet seen finish."""

    endpoint: Endpoint
    metrics: EndpointMetrics
    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    # The datastore's live record of each endpoint's last scrape (`Datastore.scraped_at`): the
    # scrapes that find a page unchanged refresh it without building a new state. Without one,
    # the metrics' own `update_time` is the last scrape.
    scrape_clock: Mapping[str, float] | None = field(default=None, compare=False, repr=False)
    # Read for every candidate of every decision, so computed once here: the datastore keeps
    # each endpoint's state until its metrics or load change (`Datastore.snapshot`).
    address: str = field(init=False, compare=False, repr=False)
    # Waiting requests counting the picker's own not yet scraped (`picker.scheduling.scorers`):
    # max(waiting, in flight - running).
    effective_waiting: int = field(init=False, compare=False, repr=False)
    # Effective waiting, then KV-cache usage (a fraction, so it only orders equal queues): the
    # order `candidate-narrowing-filter` keeps the least loaded in.
    load_rank: float = field(init=False, compare=False, repr=False)
    # Requests on the endpoint as the hot-spot bound counts them (`picker.prefix.hotspot`): the
    # picker's own in flight, or the scraped running + waiting when larger (other routers).
    load: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        metrics = self.metrics
        object.__setattr__(self, "address", self.endpoint.address)
        waiting = max(metrics.waiting_queue_size, self.in_flight_requests - metrics.running_requests_size)
        object.__setattr__(self, "effective_waiting", waiting)
        object.__setattr__(self, "load_rank", waiting + metrics.kv_cache_usage)
        object.__setattr__(
            self, "load", max(self.in_flight_requests, metrics.running_requests_size + metrics.waiting_queue_size)
        )

    def metrics_age(self, now: float) -> float:
        """Seconds since the last successful scrape (infinite if never scraped)."""
        clock = self.scrape_clock
        updated = self.metrics.update_time if clock is None else clock.get(self.address, self.metrics.update_time)
        if updated <= 0:
            return float("inf")
        return now - updated
