"""Scrape every endpoint's /metrics page on a fixed interval and keep the datastore current.

One asyncio task per endpoint, all sharing one aiohttp session (a keep-alive connection pool;
aiohttp turns Nagle off on every connection). Each request has its own timeout, so a hung
endpoint only delays itself: its metrics keep their old `update_time` and go stale, while
the other endpoints' tasks keep their own pace.

Pages are parsed on the event loop: the targeted scanner costs tens of microseconds for a
real page, less than handing the bytes to a thread would. What could block the loop is an
absurd page, so bodies are capped (`max_page_bytes`, 4 MiB by default, about 100 times a real
vLLM page): a larger page is refused as "page too large" without being read in full.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping

import aiohttp
from prometheus_client import Histogram

from picker.datalayer.engines import DEFAULT_ENGINE, EngineCatalog
from picker.datalayer.parse import parse_page
from picker.datastore.endpoint import Endpoint, join_host_port
from picker.datastore.store import Datastore
from picker.telemetry.metrics import (
    METRICS_AGE,
    POOL_KV_CACHE,
    POOL_PER_POD_QUEUE,
    POOL_QUEUE,
    POOL_READY_PODS,
    POOL_RUNNING,
    SCRAPE_DURATION,
    SCRAPE_ERRORS,
)

log = logging.getLogger(__name__)

MAX_PAGE_BYTES = 4 * 1024 * 1024
# Values of the `reason` label of picker_scrape_errors_total.
ERROR_REASONS = ("timeout", "connect", "disconnect", "http_status", "page_too_large", "no_metrics", "error")


class ScrapeError(Exception):
    """A scrape that failed for a reason the collector names (one of ERROR_REASONS)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class MetricsCollector:
    """Keeps `datastore` metrics fresh by scraping each endpoint every `interval` seconds.

    - `timeout`: per request, default max(1 s, 20 × interval); then the endpoint just ages.
    - `max_concurrency`: scrapes (and pooled connections) in flight at once; a hung endpoint
      holds one slot for at most `timeout`, so keep it above the expected endpoint count.
    - `engines`: the engine catalog (`EngineCatalog.from_parameters` for configured ones);
      when None, the built-in specs with `default_engine` for unlabelled endpoints.
    - `path`, `scheme`, `insecure_skip_verify`: the `metrics-data-source` parameters.
    - `metrics_port`: `--model-server-metrics-port`; 0 scrapes each endpoint's own port.
    - `staleness_threshold`: how old metrics may be and still count as ready in the pool
      gauges; plugins compare it with `EndpointState.metrics_age(now)`.
    - `pool_name`, `pool_gauges_interval`: label and period of the inference_pool_* gauges.
    - `max_page_bytes`: larger pages are refused ("page_too_large").
    """

    def __init__(
        self,
        datastore: Datastore,
        *,
        interval: float = 0.05,
        timeout: float | None = None,
        max_concurrency: int = 256,
        default_engine: str = DEFAULT_ENGINE,
        engines: EngineCatalog | None = None,
        path: str = "/metrics",
        scheme: str = "http",
        insecure_skip_verify: bool = True,
        staleness_threshold: float = 2.0,
        pool_name: str = "",
        pool_gauges_interval: float = 5.0,
        max_page_bytes: int = MAX_PAGE_BYTES,
        metrics_port: int = 0,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"refresh interval must be positive, got {interval}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"scrape timeout must be positive, got {timeout}")
        if max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {max_concurrency}")
        if scheme not in ("http", "https"):
            raise ValueError(f"metrics scheme must be http or https, got {scheme!r}")
        if not path.startswith("/"):
            raise ValueError(f"metrics path must start with '/', got {path!r}")
        self._datastore = datastore
        self.interval = interval
        # Well below "never": a hung endpoint costs one task one timeout, then it retries.
        self.timeout = timeout if timeout is not None else max(1.0, 20 * interval)
        self.max_concurrency = max_concurrency
        self.engines = engines if engines is not None else EngineCatalog.builtin(default_engine)
        self.path = path
        self.scheme = scheme
        self.insecure_skip_verify = insecure_skip_verify
        self.staleness_threshold = staleness_threshold
        self.pool_name = pool_name
        self.pool_gauges_interval = pool_gauges_interval
        self.max_page_bytes = max_page_bytes
        self.metrics_port = metrics_port
        self._urls: dict[str, str] = {}  # address → the metrics URL its task scrapes
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()  # cancelled, not yet finished
        self._pool_task: asyncio.Task[None] | None = None
        self._failing: dict[str, str] = {}  # address → reason of the current failure streak
        self._missing: dict[str, frozenset[str]] = {}  # address → selectors absent last scrape
        self._per_pod_labels: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the HTTP pool and start scraping every endpoint, now and as they come and go."""
        if self._session is not None:
            return
        self._semaphore = asyncio.Semaphore(self.max_concurrency)
        connector = aiohttp.TCPConnector(limit=self.max_concurrency, ssl=not self.insecure_skip_verify)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            # Plain text, uncompressed: gzip would cost CPU on both sides of a LAN hop.
            headers={"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"},
        )
        self._datastore.add_listener(self._on_endpoints_changed)
        self._sync_tasks(self._datastore.endpoints())
        self._pool_task = asyncio.create_task(self._refresh_pool_gauges_forever(), name="pool-gauges")

    async def stop(self) -> None:
        """Stop every scrape task, stop following the datastore and close the HTTP pool;
        metrics already stored stay."""
        session, self._session = self._session, None
        if session is None:
            return
        self._datastore.remove_listener(self._on_endpoints_changed)
        for address in list(self._tasks):
            self._stop_task(address)
        pending = set(self._ending)
        if self._pool_task is not None:
            self._pool_task.cancel()
            pending.add(self._pool_task)
            self._pool_task = None
        await asyncio.gather(*pending, return_exceptions=True)
        await session.close()

    def active_endpoints(self) -> frozenset[str]:
        """Addresses that currently have a scrape task."""
        return frozenset(self._tasks)

    # -- endpoint set ----------------------------------------------------------------------

    def _on_endpoints_changed(self, old: dict[str, Endpoint], new: dict[str, Endpoint]) -> None:
        if self._session is not None:
            self._sync_tasks(new)

    def _metrics_urls(self, endpoints: Mapping[str, Endpoint]) -> dict[str, str]:
        """Each endpoint's metrics URL. With `metrics_port`, an endpoint alone on its IP (a pod
        with one target port) is scraped on that port; endpoints sharing an IP (the ranks of one
        pod) keep their own, as the reference applies the port only to single-port pools."""
        hosts = {address: address for address in endpoints}
        if self.metrics_port:
            per_ip = Counter(endpoint.ip for endpoint in endpoints.values())
            for address, endpoint in endpoints.items():
                if per_ip[endpoint.ip] == 1:
                    hosts[address] = join_host_port(endpoint.ip, self.metrics_port)
        return {address: f"{self.scheme}://{host}{self.path}" for address, host in hosts.items()}

    def _sync_tasks(self, endpoints: Mapping[str, Endpoint]) -> None:
        urls = self._metrics_urls(endpoints)
        for address in [a for a in self._tasks if urls.get(a) != self._urls[a]]:
            self._stop_task(address)
        for address in urls.keys() - self._tasks.keys():
            self._urls[address] = urls[address]
            task = asyncio.create_task(self._scrape_forever(address, urls[address]), name=f"scrape {address}")
            self._tasks[address] = task
            METRICS_AGE.labels(address).set_function(self._age_reader(address))

    def _stop_task(self, address: str) -> None:
        task = self._tasks.pop(address)
        del self._urls[address]
        task.cancel()
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)
        self._failing.pop(address, None)
        self._missing.pop(address, None)
        METRICS_AGE.remove(address)
        SCRAPE_DURATION.remove(address)
        for reason in ERROR_REASONS:
            SCRAPE_ERRORS.remove(address, reason)

    def _age_reader(self, address: str) -> Callable[[], float]:
        """A callback giving the age of `address`'s metrics when Prometheus reads the gauge."""
        datastore = self._datastore

        def age() -> float:
            updated = datastore.metrics(address).update_time
            return time.monotonic() - updated if updated > 0 else math.inf

        return age

    # -- scraping --------------------------------------------------------------------------

    async def _scrape_forever(self, address: str, url: str) -> None:
        loop = asyncio.get_running_loop()
        duration = SCRAPE_DURATION.labels(address)
        # A random phase, then ±10% jitter, so endpoints added together never scrape in lockstep.
        due = loop.time() + random.uniform(0, self.interval)
        while True:
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            endpoint = self._datastore.get(address)
            if endpoint is None:
                return
            await self._scrape(endpoint, url, duration)
            # A scrape slower than the interval skips the ticks it missed instead of bursting.
            due = max(due + self.interval * random.uniform(0.9, 1.1), loop.time())

    async def _scrape(self, endpoint: Endpoint, url: str, duration: Histogram) -> None:
        """Fetch and parse one page; store the metrics on success, count the failure otherwise."""
        address = endpoint.address
        started = time.perf_counter()
        assert self._semaphore is not None, "collector not started"
        try:
            async with self._semaphore:
                page = await self._fetch(url)
        except (ScrapeError, TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._failed(address, *self._describe_failure(exc))
            return
        spec = self.engines.spec_for(endpoint)
        parsed = parse_page(page, spec, self._datastore.metrics(address), time.monotonic())
        self._note_missing(address, spec.name, parsed.missing)
        if not parsed.extracted:
            self._failed(address, "no_metrics", f"no {spec.name} metric found in {len(page)} bytes")
            return
        self._datastore.set_metrics(address, parsed.metrics)
        duration.observe(time.perf_counter() - started)
        if address in self._failing:
            del self._failing[address]
            log.info("metrics scrape of %s recovered", address)

    async def _fetch(self, url: str) -> bytes:
        assert self._session is not None, "collector not started"
        limit = self.max_page_bytes
        async with self._session.get(url) as response:
            if response.status != 200:
                raise ScrapeError("http_status", f"HTTP {response.status} from {url}")
            length = response.content_length
            if length is not None and length > limit:
                raise ScrapeError("page_too_large", f"page of {length} bytes exceeds {limit}")
            if length is not None and "Content-Encoding" not in response.headers:
                return await response.read()
            body = bytearray()
            async for chunk in response.content.iter_any():
                body += chunk
                if len(body) > limit:
                    raise ScrapeError("page_too_large", f"page exceeds {limit} bytes")
            return bytes(body)

    def _describe_failure(self, exc: BaseException) -> tuple[str, str]:
        """The `reason` label and a log detail for a failed fetch."""
        detail = str(exc) or type(exc).__name__
        if isinstance(exc, ScrapeError):
            return exc.reason, detail
        if isinstance(exc, TimeoutError):  # aiohttp's timeouts subclass it
            return "timeout", f"no answer within {self.timeout:g}s"
        if isinstance(exc, aiohttp.ClientConnectorError):
            return "connect", detail
        if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, ConnectionResetError)):
            return "disconnect", detail
        return "error", detail

    def _failed(self, address: str, reason: str, detail: str) -> None:
        """Count a failure; old metrics stay in place and age. Logged once per failure streak."""
        SCRAPE_ERRORS.labels(address, reason).inc()
        if self._failing.get(address) != reason and address in self._tasks:
            self._failing[address] = reason
            log.warning("metrics scrape of %s failed (%s): %s", address, reason, detail)

    def _note_missing(self, address: str, engine: str, missing: frozenset[str]) -> None:
        """Log once when a metric family goes missing and once when it comes back."""
        before = self._missing.get(address, frozenset())
        if missing == before:
            return
        self._missing[address] = missing
        for name in sorted(missing - before):
            log.warning("metric family not found on %s (engine %s): %s", address, engine, name)
        for name in sorted(before - missing):
            log.info("metric family found again on %s: %s", address, name)

    # -- pool gauges -----------------------------------------------------------------------

    async def _refresh_pool_gauges_forever(self) -> None:
        while True:
            self.refresh_pool_gauges()
            await asyncio.sleep(self.pool_gauges_interval)

    def refresh_pool_gauges(self, now: float | None = None) -> None:
        """Recompute the inference_pool_* gauges; only endpoints with fresh metrics count."""
        now = time.monotonic() if now is None else now
        states = self._datastore.snapshot()
        fresh = [s.metrics for s in states if s.metrics_age(now) <= self.staleness_threshold]
        pool = self.pool_name
        POOL_READY_PODS.labels(pool).set(len(fresh))
        count = len(fresh) or 1
        POOL_KV_CACHE.labels(pool).set(sum(m.kv_cache_usage for m in fresh) / count)
        POOL_QUEUE.labels(pool).set(sum(m.waiting_queue_size for m in fresh) / count)
        POOL_RUNNING.labels(pool).set(sum(m.running_requests_size for m in fresh) / count)
        labels = set()
        for state in states:
            pod = state.endpoint.name or state.address
            labels.add(pod)
            POOL_PER_POD_QUEUE.labels(pool, pod).set(state.metrics.waiting_queue_size)
        for pod in self._per_pod_labels - labels:
            POOL_PER_POD_QUEUE.remove(pool, pod)
        self._per_pod_labels = labels
