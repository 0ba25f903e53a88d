"""Scrape every endpoint's /metrics page on a fixed interval and keep the datastore current.

Plain http (the usual case) is scraped by the compiled core (`picker_extproc_core.Scraper`,
native/extproc/src/scrape.rs) on its own thread, off the event loop and the GIL: one task per
endpoint with a kept-alive connection, its own timer and timeout. The core skips a page
identical to the last one, picks out the sample lines of the families the endpoint's engine spec
reads and hands them over only when they changed, so the loop's cost is one `parse_page` per
change and one restamp of `update_time` per unchanged page, taken in one batch per interval
(so metrics reach the datastore up to one interval after their scrape, stamped with its time),
applied `DRAIN_SLICE` results per turn of the loop: at 1,024 endpoints one interval's batch
holds about 1,000 results, milliseconds of work no request should wait behind.

Cost per endpoint, measured on this shared 2-core machine with static vLLM pages
(`python -m picker_bench.datalayer --endpoints 256`, `python -m picker_bench.poolsize`): about
30 µs of CPU per scrape all in (~20 µs on the scraper thread, kernel included, ~7 µs on the
loop), where the aiohttp client cost about 250-400 µs: 0.10-0.15 cores for 256 endpoints at
50 ms, under 0.5 for 1,024. An unchanged page costs the loop about 0.4 µs, its stamp and its
duration (`EndpointDurations`, 1.1 µs with prometheus_client's Histogram). Memory: RSS grows
about 30 KiB per endpoint, of which ~7 KiB are Python objects (mostly the endpoint's Prometheus
series) and the rest the scraper's (about 1 KB of task, socket and hashes, plus malloc keeping
the page-sized read buffers of scrapes in flight).

https pages are scraped by one asyncio task per endpoint sharing one aiohttp session (the core
speaks plain http only), parsed on the event loop with the same `parse_page`.

Either way each request has its own timeout, so a hung endpoint only delays itself: its metrics
keep their old `update_time` and go stale, while the other endpoints keep their own pace. Bodies
are capped (`max_page_bytes`, 4 MiB by default, about 100 times a real vLLM page): a larger page
is refused as "page too large" without being read in full.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import aiohttp
import picker_extproc_core

from picker.datalayer.engines import DEFAULT_ENGINE, EngineCatalog, EngineSpec
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
    EndpointDurationSeries,
)

log = logging.getLogger(__name__)

MAX_PAGE_BYTES = 4 * 1024 * 1024
DRAIN_SLICE = 64  # scrape results applied between two turns of the event loop
# The core scraper's results (`Scraper.drain`): a changed page's wanted lines (target id, lines,
# page bytes, scrape time, seconds it took), an unchanged page (id, time, took), a failure
# (id, reason, detail).
Changed = tuple[int, bytes, int, float, float]
Same = tuple[int, float, float]
Failed = tuple[int, str, str]
_Result = TypeVar("_Result")
# Values of the `reason` label of picker_scrape_errors_total.
ERROR_REASONS = ("timeout", "connect", "disconnect", "http_status", "page_too_large", "no_metrics", "error")


class ScrapeError(Exception):
    """A scrape that failed for a reason the collector names (one of ERROR_REASONS)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Target:
    """Where and what to scrape for one endpoint; a change of either restarts its scrapes."""

    host: str
    port: int
    url: str
    spec: EngineSpec


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
        self._started = False
        self._targets: dict[str, _Target] = {}  # address → what its scrapes fetch and read
        self._durations: dict[str, EndpointDurationSeries] = {}  # address → its scrape duration series
        # http: the compiled core's scraper; its target ids, and the task applying its results.
        self._scraper: picker_extproc_core.Scraper | None = None
        self._next_id = 0
        self._ids: dict[str, int] = {}
        self._addresses: dict[int, str] = {}
        self._drain_task: asyncio.Task[None] | None = None
        # https: one asyncio task per endpoint on one aiohttp session.
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()  # cancelled, not yet finished
        self._pool_task: asyncio.Task[None] | None = None
        self._unusable: set[str] = set()  # addresses whose current page gave no metric
        self._failing: dict[str, str] = {}  # address → reason of the current failure streak
        self._missing: dict[str, frozenset[str]] = {}  # address → selectors absent last scrape
        self._per_pod_labels: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start scraping every endpoint, now and as they come and go."""
        if self._started:
            return
        self._started = True
        if self.scheme == "http":
            self._scraper = picker_extproc_core.Scraper(
                interval=self.interval,
                timeout=self.timeout,
                max_concurrency=self.max_concurrency,
                max_page_bytes=self.max_page_bytes,
            )
            self._drain_task = asyncio.create_task(self._drain_forever(), name="scrape results")
        else:
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
            connector = aiohttp.TCPConnector(limit=self.max_concurrency, ssl=not self.insecure_skip_verify)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                # Plain text, uncompressed: gzip would cost CPU on both sides of a LAN hop.
                headers={"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"},
            )
        self._datastore.add_listener(self._on_endpoints_changed)
        self._sync_targets(self._datastore.endpoints())
        self._pool_task = asyncio.create_task(self._refresh_pool_gauges_forever(), name="pool-gauges")

    async def stop(self) -> None:
        """Stop every scrape, stop following the datastore and close the connections; metrics
        already stored stay."""
        if not self._started:
            return
        self._started = False
        self._datastore.remove_listener(self._on_endpoints_changed)
        for address in list(self._targets):
            self._stop_scraping(address)
        pending = set(self._ending)
        for task in (self._pool_task, self._drain_task):
            if task is not None:
                task.cancel()
                pending.add(task)
        self._pool_task = self._drain_task = None
        await asyncio.gather(*pending, return_exceptions=True)
        scraper, self._scraper = self._scraper, None
        if scraper is not None:
            scraper.stop()  # joins the scraper thread: a few milliseconds at most
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def active_endpoints(self) -> frozenset[str]:
        """Addresses being scraped."""
        return frozenset(self._targets)

    # -- endpoint set ----------------------------------------------------------------------

    def _on_endpoints_changed(self, old: dict[str, Endpoint], new: dict[str, Endpoint]) -> None:
        if self._started:
            self._sync_targets(new)

    def _targets_of(self, endpoints: Mapping[str, Endpoint]) -> dict[str, _Target]:
        """Each endpoint's target. With `metrics_port`, an endpoint alone on its IP (a pod with
        one target port) is scraped on that port; endpoints sharing an IP (the ranks of one pod)
        keep their own, as the reference applies the port only to single-port pools."""
        per_ip = Counter(endpoint.ip for endpoint in endpoints.values()) if self.metrics_port else Counter[str]()
        targets = {}
        for address, endpoint in endpoints.items():
            port = self.metrics_port if per_ip[endpoint.ip] == 1 else endpoint.port
            url = f"{self.scheme}://{join_host_port(endpoint.ip, port)}{self.path}"
            targets[address] = _Target(endpoint.ip, port, url, self.engines.spec_for(endpoint))
        return targets

    def _sync_targets(self, endpoints: Mapping[str, Endpoint]) -> None:
        targets = self._targets_of(endpoints)
        for address in [a for a, target in self._targets.items() if targets.get(a) != target]:
            self._stop_scraping(address)
        for address in targets.keys() - self._targets.keys():
            self._start_scraping(address, targets[address])

    def _start_scraping(self, address: str, target: _Target) -> None:
        self._targets[address] = target
        self._durations[address] = SCRAPE_DURATION.labels(address)
        METRICS_AGE.labels(address).set_function(self._age_reader(address))
        if self._scraper is not None:
            self._next_id += 1
            self._ids[address] = self._next_id
            self._addresses[self._next_id] = address
            self._scraper.add(self._next_id, target.host, target.port, self.path, sorted(target.spec.families))
        else:
            self._tasks[address] = asyncio.create_task(self._scrape_forever(address), name=f"scrape {address}")

    def _stop_scraping(self, address: str) -> None:
        del self._targets[address], self._durations[address]
        if self._scraper is not None:
            target_id = self._ids.pop(address)
            del self._addresses[target_id]
            self._scraper.remove(target_id)
        else:
            task = self._tasks.pop(address)
            task.cancel()
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
        self._failing.pop(address, None)
        self._missing.pop(address, None)
        self._unusable.discard(address)
        METRICS_AGE.remove(address)
        SCRAPE_DURATION.remove(address)
        for reason in ERROR_REASONS:
            SCRAPE_ERRORS.remove(address, reason)

    def _age_reader(self, address: str) -> Callable[[], float]:
        """A callback giving the age of `address`'s metrics when Prometheus reads the gauge."""
        datastore = self._datastore

        def age() -> float:
            updated = datastore.scraped_at(address)
            return time.monotonic() - updated if updated > 0 else math.inf

        return age

    # -- scrape results ------------------------------------------------------------------

    def _parsed(self, address: str, page: bytes, page_bytes: int, update_time: float, took: float) -> None:
        """Read a page (or the core's lines of it) that differs from the last one."""
        spec = self._targets[address].spec
        parsed = parse_page(page, spec, self._datastore.metrics(address), update_time)
        self._note_missing(address, spec.name, parsed.missing)
        if not parsed.extracted:
            self._unusable.add(address)
            self._failed(address, "no_metrics", f"no {spec.name} metric found in {page_bytes} bytes")
            return
        self._unusable.discard(address)
        self._datastore.set_metrics(address, parsed.metrics)
        self._succeeded(address, took)

    def _succeeded(self, address: str, took: float) -> None:
        self._durations[address].observe(took)
        if address in self._failing:
            del self._failing[address]
            log.info("metrics scrape of %s recovered", address)

    def _apply_failed(self, failed: list[Failed]) -> None:
        addresses = self._addresses
        for target_id, reason, detail in failed:
            address = addresses.get(target_id)  # None: the endpoint left meanwhile
            if address is not None:
                self._failed(address, reason, detail)

    def _apply_changed(self, changed: list[Changed]) -> None:
        addresses = self._addresses
        for target_id, lines, page_bytes, update_time, took in changed:
            address = addresses.get(target_id)
            if address is not None:
                self._parsed(address, lines, page_bytes, update_time, took)

    def _apply_same(self, same: list[Same]) -> None:
        addresses = self._addresses
        stamps = []
        for target_id, update_time, took in same:
            address = addresses.get(target_id)
            if address is None:
                continue
            if address in self._unusable:
                spec = self._targets[address].spec
                self._failed(address, "no_metrics", f"no {spec.name} metric found, page unchanged")
                continue
            stamps.append((address, update_time))
            self._succeeded(address, took)
        self._datastore.refresh_update_times(stamps)

    async def _drain_forever(self) -> None:
        assert self._scraper is not None, "collector not started"
        scraper = self._scraper
        while True:
            await asyncio.sleep(self.interval)
            changed, same, failed = scraper.drain()
            # Each kind is the latest of its kind for an endpoint: failures, then changes, then
            # unchanged pages (which read what the changes left). A slice at a time, so a large
            # pool's interval of results leaves the loop to requests in between.
            steps = [
                *_slices(self._apply_failed, failed),
                *_slices(self._apply_changed, changed),
                *_slices(self._apply_same, same),
            ]
            for n, step in enumerate(steps):
                if n:
                    await asyncio.sleep(0)
                step()

    # -- https scraping (asyncio) ----------------------------------------------------------

    async def _scrape_forever(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        # A random phase, then ±10% jitter, so endpoints added together never scrape in lockstep.
        due = loop.time() + random.uniform(0, self.interval)
        while True:
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await self._scrape(address, self._targets[address].url)
            # A scrape slower than the interval skips the ticks it missed instead of bursting.
            due = max(due + self.interval * random.uniform(0.9, 1.1), loop.time())

    async def _scrape(self, address: str, url: str) -> None:
        """Fetch and parse one page; store the metrics on success, count the failure otherwise."""
        started = time.perf_counter()
        assert self._semaphore is not None, "collector not started"
        try:
            async with self._semaphore:
                page = await self._fetch(url)
        except (ScrapeError, TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._failed(address, *self._describe_failure(exc))
            return
        self._parsed(address, page, len(page), time.monotonic(), time.perf_counter() - started)

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
        if self._failing.get(address) != reason:
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


def _slices(apply: Callable[[list[_Result]], None], results: list[_Result]) -> Iterator[Callable[[], None]]:
    """`apply` over `results`, `DRAIN_SLICE` at a time."""
    return (partial(apply, results[i : i + DRAIN_SLICE]) for i in range(0, len(results), DRAIN_SLICE))
