"""MetricsCollector against real HTTP servers on 127.0.0.x: values, failures, staleness, churn."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from picker.datalayer.collector import DRAIN_SLICE, ERROR_REASONS, MetricsCollector
from picker.datalayer.engines import ENGINE_LABEL_KEY
from picker.datastore.endpoint import Endpoint, EndpointMetrics
from picker.datastore.store import Datastore
from picker.extproc.tls import self_signed_certificate
from picker_bench.metric_pages import (
    sglang_page,
    triton_page,
    trtllm_page,
    vllm_page,
)

POLL = 0.01


async def until(condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `condition` until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(POLL)


def _bound_socket(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))  # a free port chosen by the kernel
    return sock


class PageServer:
    """An aiohttp server answering GET /metrics with `page`; can be told to hang or to chunk."""

    def __init__(self, host: str, page: bytes, ssl_context: ssl.SSLContext | None = None) -> None:
        self.host = host
        self.page = page
        self.ssl_context = ssl_context
        self.requests = 0
        self.hang = False
        self.chunked = False
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self.hang:
            await self._release.wait()
        if not self.chunked:
            return web.Response(body=self.page, content_type="text/plain")
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(self.page), 256 * 1024):
            await response.write(self.page[start : start + 256 * 1024])
        await response.write_eof()
        return response

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        sock = _bound_socket(self.host)
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock, ssl_context=self.ssl_context).start()

    async def stop(self) -> None:
        self._release.set()
        assert self._runner is not None
        await self._runner.cleanup()

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.port, name=f"pod-{self.host}")


class RawServer:
    """A bare TCP server running `handle` per connection (for servers that misbehave at the HTTP level)."""

    def __init__(
        self, host: str, handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
    ) -> None:
        self.host = host
        self.connections = 0
        self._handle = handle
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            await self._handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up first
        finally:
            writer.close()
            self._writers.discard(writer)

    async def start(self) -> None:
        sock = _bound_socket(self.host)
        self.port = sock.getsockname()[1]
        self._server = await asyncio.start_server(self._on_connection, sock=sock)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()  # ends handlers blocked reading: they see EOF
        await self._server.wait_closed()

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.port)


async def _serve(stack: AsyncExitStack, server: PageServer | RawServer) -> None:
    await server.start()
    stack.push_async_callback(server.stop)


async def _collect(stack: AsyncExitStack, datastore: Datastore, **kwargs: object) -> MetricsCollector:
    collector = MetricsCollector(datastore, **kwargs)  # type: ignore[arg-type]
    await collector.start()
    stack.push_async_callback(collector.stop)
    return collector


def errors(address: str, reason: str) -> float:
    return REGISTRY.get_sample_value("picker_scrape_errors_total", {"endpoint": address, "reason": reason}) or 0.0


def scrapes(address: str) -> float:
    return REGISTRY.get_sample_value("picker_scrape_duration_seconds_count", {"endpoint": address}) or 0.0


async def test_scrapes_each_engine_and_follows_changes() -> None:
    datastore = Datastore()
    async with AsyncExitStack() as stack:
        vllm = PageServer("127.0.0.2", vllm_page(waiting=3, running=12, kv_usage=0.42))
        sglang = PageServer("127.0.0.3", sglang_page(queue=5, running=30, token_usage=0.61))
        trtllm = PageServer("127.0.0.4", trtllm_page(waiting=2, running=8, utilization=0.25))
        triton = PageServer("127.0.0.5", triton_page(waiting=4, scheduled=16, fraction=0.5))
        for server in (vllm, sglang, trtllm, triton):
            await _serve(stack, server)
        datastore.set_endpoints(
            [
                vllm.endpoint,
                Endpoint(sglang.host, sglang.port, labels={ENGINE_LABEL_KEY: "sglang"}),
                Endpoint(trtllm.host, trtllm.port, labels={ENGINE_LABEL_KEY: "trtllm-serve"}),
                Endpoint(triton.host, triton.port, labels={ENGINE_LABEL_KEY: "triton-tensorrt-llm"}),
            ]
        )
        collector = await _collect(stack, datastore, interval=0.05)
        servers = (vllm, sglang, trtllm, triton)
        await until(
            lambda: all(datastore.metrics(s.endpoint.address).update_time > 0 for s in servers), what="first scrapes"
        )

        m = datastore.metrics(vllm.endpoint.address)
        assert (m.waiting_queue_size, m.running_requests_size, m.kv_cache_usage) == (3, 12, 0.42)
        assert m.active_models == {"sql-lora", "chat-lora"} and m.max_active_models == 4
        assert (m.cache_block_size, m.cache_num_blocks) == (16, 27_000)
        m = datastore.metrics(sglang.endpoint.address)
        assert (m.waiting_queue_size, m.running_requests_size, m.kv_cache_usage, m.cache_block_size) == (5, 30, 0.61, 1)
        m = datastore.metrics(trtllm.endpoint.address)
        assert (m.waiting_queue_size, m.running_requests_size, m.kv_cache_usage, m.cache_block_size) == (2, 8, 0.25, 32)
        m = datastore.metrics(triton.endpoint.address)
        assert (m.waiting_queue_size, m.running_requests_size, m.kv_cache_usage, m.cache_num_blocks) == (
            4,
            16,
            0.5,
            4096,
        )
        assert collector.active_endpoints() == {s.endpoint.address for s in servers}

        changed = time.monotonic()  # before the change: a scrape of the new page always comes after
        vllm.page = vllm_page(waiting=9, running=1, kv_usage=0.9, legacy_kv_name=True)
        await until(lambda: datastore.metrics(vllm.endpoint.address).waiting_queue_size == 9, what="new queue value")
        assert datastore.metrics(vllm.endpoint.address).kv_cache_usage == 0.9
        # The age is since the scrape that brought the new page, which came after the change.
        age = REGISTRY.get_sample_value("picker_metrics_age_seconds", {"endpoint": vllm.endpoint.address})
        assert age is not None and 0 <= age <= time.monotonic() - changed

        # Relabelling an endpoint switches its engine spec on the next scrape, same task.
        vllm.page = sglang_page(queue=17)
        relabelled = Endpoint(vllm.host, vllm.port, labels={ENGINE_LABEL_KEY: "sglang"})
        datastore.set_endpoints([relabelled, *(e for a, e in datastore.endpoints().items() if a != relabelled.address)])
        await until(lambda: datastore.metrics(vllm.endpoint.address).waiting_queue_size == 17, what="sglang values")


class CountingDatastore(Datastore):
    """The real datastore, counting the unchanged-page stamps applied since a probe last ran."""

    def __init__(self) -> None:
        super().__init__()
        self.since_turn = self.most_between_turns = self.total = 0

    def refresh_update_times(self, stamps: Iterable[tuple[str, float]]) -> None:
        stamps = list(stamps)
        self.since_turn += len(stamps)
        self.total += len(stamps)
        super().refresh_update_times(stamps)

    async def probe(self) -> None:
        """Take every turn of the loop it can, noting how many stamps went in between two."""
        while True:
            self.most_between_turns = max(self.most_between_turns, self.since_turn)
            self.since_turn = 0
            await asyncio.sleep(0)


async def test_a_large_pools_results_leave_the_loop_to_requests_between_slices() -> None:
    # 160 endpoints (one server on every loopback address) give the drain about 160 results an
    # interval: applied DRAIN_SLICE at a time, with the loop's other tasks run in between.
    datastore = CountingDatastore()
    async with AsyncExitStack() as stack:
        server = PageServer("0.0.0.0", vllm_page(waiting=1, running=2, kv_usage=0.3))
        await _serve(stack, server)
        addresses = [f"127.0.0.{i}" for i in range(1, 161)]
        datastore.set_endpoints([Endpoint(ip, server.port) for ip in addresses])
        probe = asyncio.create_task(datastore.probe())
        stack.callback(probe.cancel)
        await _collect(stack, datastore, interval=0.25)
        await until(lambda: datastore.total >= 3 * len(addresses), timeout=20, what="three intervals of scrapes")
        assert 0 < datastore.most_between_turns <= DRAIN_SLICE


async def test_malformed_nan_and_missing_families_keep_old_values_and_log_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="picker.datalayer.collector")
    datastore = Datastore()
    async with AsyncExitStack() as stack:
        server = PageServer("127.0.0.2", vllm_page(waiting=3, running=12, kv_usage=0.42))
        await _serve(stack, server)
        address = server.endpoint.address
        datastore.set_endpoints([server.endpoint])
        await _collect(stack, datastore, interval=0.02)
        await until(lambda: datastore.metrics(address).running_requests_size == 12, what="first scrape")

        server.page = (
            b"# HELP vllm:num_requests_waiting broken on purpose\n"
            b'vllm:num_requests_waiting{model_name="m" 7\n'
            b"vllm:num_requests_running 20\n"
            b"vllm:kv_cache_usage_perc NaN\n"
            b"\xff\xfe not prometheus at all\n"
        )
        await until(lambda: datastore.metrics(address).running_requests_size == 20, what="partial page")
        before = scrapes(address)
        await until(lambda: scrapes(address) >= before + 5, what="more scrapes of the partial page")
        m = datastore.metrics(address)
        assert (m.waiting_queue_size, m.kv_cache_usage) == (3, 0.42)  # the last good values
        assert m.active_models == {"sql-lora", "chat-lora"}
        missing_logs = [r.getMessage() for r in caplog.records if "metric family not found" in r.getMessage()]
        assert sorted(name.rsplit(": ", 1)[1] for name in missing_logs) == [
            "vllm:cache_config_info",
            "vllm:kv_cache_usage_perc",
            "vllm:lora_requests_info",
            "vllm:num_requests_waiting",
        ]

        server.page = vllm_page(waiting=4)
        await until(lambda: datastore.metrics(address).waiting_queue_size == 4, what="recovery")
        assert sum("found again" in r.getMessage() for r in caplog.records) == 4

        server.page = b"# nothing this picker reads\nprocess_cpu_seconds_total 1\n"
        # from the first error on (scrapes of the good page may still be on their way until then)
        await until(lambda: errors(address, "no_metrics") >= 1, what="a no_metrics error")
        stamp = datastore.metrics(address).update_time
        await until(lambda: errors(address, "no_metrics") >= 3, what="no_metrics errors")
        assert datastore.metrics(address).update_time == stamp  # nothing extracted: goes stale


async def test_pages_over_the_size_cap_are_refused_without_stalling_others() -> None:
    datastore = Datastore()
    big = vllm_page() + b"".join(b'filler{i="%d"} %d\n' % (i, i) for i in range(300_000))
    assert len(big) > 5_000_000
    async with AsyncExitStack() as stack:
        sized = PageServer("127.0.0.2", big)
        chunked = PageServer("127.0.0.3", big)
        chunked.chunked = True  # no Content-Length: the cap must stop the read itself
        small = PageServer("127.0.0.4", vllm_page(waiting=1))
        for server in (sized, chunked, small):
            await _serve(stack, server)
        datastore.set_endpoints([sized.endpoint, chunked.endpoint, small.endpoint])
        await _collect(stack, datastore, interval=0.1)
        await until(
            lambda: (
                errors(sized.endpoint.address, "page_too_large") >= 2
                and errors(chunked.endpoint.address, "page_too_large") >= 2
                and scrapes(small.endpoint.address) >= 3
            ),
            what="page too large errors while the small page keeps being scraped",
        )
        assert datastore.metrics(sized.endpoint.address).update_time == 0
        assert datastore.metrics(chunked.endpoint.address).update_time == 0

        # Under the cap, a multi-megabyte page still parses.
        sized.page = chunked.page = big[:3_000_000].rsplit(b"\n", 1)[0] + b"\n"
        await until(
            lambda: (
                datastore.metrics(sized.endpoint.address).update_time > 0
                and datastore.metrics(chunked.endpoint.address).update_time > 0
            ),
            what="3 MB pages parsed",
        )
        assert datastore.metrics(chunked.endpoint.address).waiting_queue_size == 3


async def test_a_hung_endpoint_goes_stale_while_the_others_are_scraped_meanwhile() -> None:
    datastore = Datastore()
    interval = 0.05
    async with AsyncExitStack() as stack:
        good = PageServer("127.0.0.2", vllm_page(waiting=1))
        hung = PageServer("127.0.0.3", vllm_page(waiting=2))
        # Accepts, reads, never answers; notes how often `good` was scraped while each scrape of
        # it waited, until the scraper's timeout closed the connection.
        held: list[tuple[int, int]] = []

        async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            before = good.requests
            await reader.read()
            held.append((before, good.requests))

        silent = RawServer("127.0.0.4", never_answer)
        for server in (good, hung, silent):
            await _serve(stack, server)
        datastore.set_endpoints([good.endpoint, hung.endpoint, silent.endpoint])
        collector = await _collect(stack, datastore, interval=interval, timeout=0.4, staleness_threshold=0.3)
        await until(
            lambda: all(datastore.metrics(s.endpoint.address).update_time > 0 for s in (good, hung)),
            what="first scrapes",
        )

        hung.hang = True

        def hung_is_stale() -> bool:
            now = time.monotonic()
            states = {s.address: s for s in datastore.snapshot()}
            return (
                states[hung.endpoint.address].metrics_age(now) > collector.staleness_threshold
                and errors(hung.endpoint.address, "timeout") >= 2
                and errors(silent.endpoint.address, "timeout") >= 2
            )

        await until(hung_is_stale, what="hung endpoint stale with two timeouts")
        # Each endpoint is scraped on its own: while a scrape of the silent one waited for its
        # timeout, the good one was scraped (not after it, as one scrape after another would).
        await until(lambda: len(held) >= 2, what="the silent endpoint to see its two scrapes give up")
        assert all(after > before for before, after in held), held
        assert datastore.metrics(hung.endpoint.address).waiting_queue_size == 2  # old value kept, just stale
        assert datastore.metrics(silent.endpoint.address).update_time == 0


async def test_servers_that_close_or_refuse_connections_are_errors_not_crashes() -> None:
    async def close_after_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")

    async def half_response(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nvllm:num_requests_waiting 1\n")
        await writer.drain()

    refused = _bound_socket("127.0.0.6")  # bound, never listening: connections are refused
    datastore = Datastore()
    async with AsyncExitStack() as stack:
        stack.callback(refused.close)
        closing = RawServer("127.0.0.2", close_after_request)
        partial = RawServer("127.0.0.3", half_response)
        good = PageServer("127.0.0.4", vllm_page(waiting=5))
        for server in (closing, partial, good):
            await _serve(stack, server)
        refused_endpoint = Endpoint("127.0.0.6", refused.getsockname()[1])
        datastore.set_endpoints([closing.endpoint, partial.endpoint, good.endpoint, refused_endpoint])
        await _collect(stack, datastore, interval=0.05)
        await until(
            lambda: (
                errors(closing.endpoint.address, "disconnect") >= 3
                and errors(partial.endpoint.address, "disconnect") >= 3
                and errors(refused_endpoint.address, "connect") >= 3
            ),
            what="errors from misbehaving servers",
        )
        assert closing.connections >= 3
        assert datastore.metrics(good.endpoint.address).waiting_queue_size == 5
        for endpoint in (closing.endpoint, partial.endpoint, refused_endpoint):
            assert datastore.metrics(endpoint.address) == EndpointMetrics()


async def test_close_delimited_pages_and_silently_closed_keep_alive_connections_are_read() -> None:
    page = vllm_page(waiting=7)

    async def http_1_0(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + page)
        await writer.drain()

    async def one_answer_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        # Says nothing of closing: the client finds the connection closed at its next request.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(page) + page)
        await writer.drain()

    datastore = Datastore()
    async with AsyncExitStack() as stack:
        until_close = RawServer("127.0.0.2", http_1_0)
        closing = RawServer("127.0.0.3", one_answer_per_connection)
        for server in (until_close, closing):
            await _serve(stack, server)
        datastore.set_endpoints([until_close.endpoint, closing.endpoint])
        await _collect(stack, datastore, interval=0.02)
        await until(
            lambda: scrapes(until_close.endpoint.address) >= 5 and scrapes(closing.endpoint.address) >= 5,
            what="five scrapes of each",
        )
        for server in (until_close, closing):
            assert datastore.metrics(server.endpoint.address).waiting_queue_size == 7
            assert server.connections >= 5  # a new connection for each scrape
            assert all(errors(server.endpoint.address, reason) == 0 for reason in ERROR_REASONS)


async def test_http_errors_are_counted() -> None:
    datastore = Datastore()
    async with AsyncExitStack() as stack:
        server = PageServer("127.0.0.2", b"")
        await _serve(stack, server)
        datastore.set_endpoints([server.endpoint])
        await _collect(stack, datastore, interval=0.05, path="/not-metrics")
        await until(lambda: errors(server.endpoint.address, "http_status") >= 2, what="404s counted")


async def test_removed_endpoints_stop_being_scraped_and_added_ones_start() -> None:
    datastore = Datastore()
    async with AsyncExitStack() as stack:
        stays = PageServer("127.0.0.2", vllm_page(waiting=1))
        leaves = PageServer("127.0.0.3", vllm_page(waiting=2))
        joins = PageServer("127.0.0.4", vllm_page(waiting=3))
        for server in (stays, leaves, joins):
            await _serve(stack, server)
        datastore.set_endpoints([stays.endpoint, leaves.endpoint])
        collector = await _collect(stack, datastore, interval=0.03)
        await until(lambda: leaves.requests >= 2 and stays.requests >= 2, what="both scraped")

        datastore.set_endpoints([stays.endpoint, joins.endpoint])
        assert collector.active_endpoints() == {stays.endpoint.address, joins.endpoint.address}
        left_at, stays_at = leaves.requests, stays.requests
        await until(lambda: stays.requests >= stays_at + 10, what="ten more scrapes of the remaining endpoint")
        assert leaves.requests <= left_at + 1  # at most the request already in flight
        assert datastore.metrics(leaves.endpoint.address) == EndpointMetrics()
        assert REGISTRY.get_sample_value("picker_metrics_age_seconds", {"endpoint": leaves.endpoint.address}) is None
        assert datastore.metrics(joins.endpoint.address).waiting_queue_size == 3

        await collector.stop()
        assert collector.active_endpoints() == frozenset()
        stopped_at = stays.requests
        await collector.stop()  # idempotent
        assert stays.requests == stopped_at


async def test_https_pages_are_scraped_by_the_event_loop_with_the_same_rules(tmp_path: Path) -> None:
    key, cert = self_signed_certificate("metrics")
    (tmp_path / "key.pem").write_bytes(key)
    (tmp_path / "cert.pem").write_bytes(cert)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    datastore = Datastore()
    async with AsyncExitStack() as stack:
        server = PageServer("127.0.0.2", vllm_page(waiting=6, running=2), ssl_context=context)
        empty = PageServer("127.0.0.3", b"# nothing this picker reads\n", ssl_context=context)
        for page_server in (server, empty):
            await _serve(stack, page_server)
        datastore.set_endpoints([server.endpoint, empty.endpoint])
        await _collect(stack, datastore, interval=0.05, scheme="https")
        await until(lambda: datastore.metrics(server.endpoint.address).waiting_queue_size == 6, what="https scrape")
        assert datastore.metrics(server.endpoint.address).running_requests_size == 2
        await until(lambda: errors(empty.endpoint.address, "no_metrics") >= 2, what="no_metrics over https")
        server.page = vllm_page(waiting=8)
        await until(lambda: datastore.metrics(server.endpoint.address).waiting_queue_size == 8, what="new value")


async def test_pool_gauges_count_only_fresh_endpoints() -> None:
    datastore = Datastore()
    pool = "datalayer-test-pool"
    async with AsyncExitStack() as stack:
        a = PageServer("127.0.0.2", vllm_page(waiting=2, running=10, kv_usage=0.2))
        b = PageServer("127.0.0.3", vllm_page(waiting=4, running=20, kv_usage=0.6))
        for server in (a, b):
            await _serve(stack, server)
        datastore.set_endpoints([a.endpoint, b.endpoint, Endpoint("127.0.0.9", 9, name="never-scraped")])
        collector = await _collect(stack, datastore, interval=0.05, pool_name=pool, staleness_threshold=1.0)
        await until(lambda: all(datastore.metrics(s.endpoint.address).update_time > 0 for s in (a, b)), what="scrapes")
        collector.refresh_pool_gauges()

        def gauge(name: str, **labels: str) -> float | None:
            return REGISTRY.get_sample_value(name, {"name": pool, **labels})

        assert gauge("inference_pool_ready_pods") == 2
        assert gauge("inference_pool_average_queue_size") == 3
        assert gauge("inference_pool_average_running_requests") == 15
        assert gauge("inference_pool_average_kv_cache_utilization") == pytest.approx(0.4)
        assert gauge("inference_pool_per_pod_queue_size", model_server_pod="pod-127.0.0.3") == 4

        collector.refresh_pool_gauges(now=time.monotonic() + 10)  # as if 10 s passed with no scrape
        assert gauge("inference_pool_ready_pods") == 0
        datastore.set_endpoints([a.endpoint])
        collector.refresh_pool_gauges()
        assert gauge("inference_pool_per_pod_queue_size", model_server_pod="pod-127.0.0.3") is None


def test_bad_settings_are_clear_errors() -> None:
    datastore = Datastore()
    for kwargs, message in (
        ({"interval": 0}, "interval"),
        ({"scheme": "ftp"}, "scheme"),
        ({"path": "metrics"}, "path"),
        ({"default_engine": "nope"}, "defaultEngine"),
        ({"max_concurrency": 0}, "concurrency"),
    ):
        with pytest.raises(ValueError, match=message):
            MetricsCollector(datastore, **kwargs)  # type: ignore[arg-type]
