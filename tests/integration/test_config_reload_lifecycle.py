"""Reloads under traffic leak nothing, and the installed config's data layer is the one in force.

A real `PickerServer` (ext_proc, health and metrics servers on loopback), real HTTP metrics
pages scraped by its data layer, and requests routed through its director while the config
flips 100 times between two configs whose prefix and data-layer parameters differ.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from aiohttp import web

from picker.serve.flags import build_parser, serve_options
from picker.serve.server import PickerServer
from picker_bench.metric_pages import vllm_page
from picker_bench.process import free_port

HOST = "127.0.0.1"
HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def config(lru_capacity: int, metrics_path: str) -> str:
    return HEADER + (
        "plugins:\n"
        "- type: approx-prefix-cache-producer\n"
        f"  parameters: {{lruCapacityPerServer: {lru_capacity}, tokenizers: {{'*': builtin}}}}\n"
        "- type: prefix-cache-scorer\n"
        "- type: queue-scorer\n"
        "- {name: source, type: metrics-data-source, parameters: {path: " + metrics_path + "}}\n"
        "- {name: extractor, type: core-metrics-extractor}\n"
        "dataLayer: {sources: [{pluginRef: source, extractors: [{pluginRef: extractor}]}]}\n"
    )


A = config(1000, "/metrics")
B = config(2000, "/engine/metrics")


class MetricsPages:
    """Two vLLM-like pods' metrics pages, each served at both paths, on a loop in a thread of
    its own (so its connection tasks are not counted with the picker's); `scrapes` by path."""

    def __init__(self) -> None:
        self.scrapes: Counter[str] = Counter()
        self.ports = [free_port(HOST) for _ in range(2)]
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, name="metrics-pages", daemon=True)

    def __enter__(self) -> MetricsPages:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    async def _start(self) -> None:
        page = vllm_page()

        async def metrics(request: web.Request) -> web.Response:
            self.scrapes[request.path] += 1
            return web.Response(body=page, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/engine/metrics", metrics)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        for port in self.ports:
            await web.TCPSite(self.runner, HOST, port).start()


def counts(server: PickerServer) -> dict[str, int]:
    return {
        "datastore listeners": server.datastore.listener_count(),
        "threads": threading.active_count(),
        "tasks": len(asyncio.all_tasks()),
        "persistent objects": len(server.runtimes.objects),
    }


async def until(condition: object, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_100_reloads_under_traffic_leak_nothing_and_apply_the_data_layer() -> None:
    with MetricsPages() as pages:
        await run_reloads(pages)


async def run_reloads(pages: MetricsPages) -> None:
    scrapes, ports = pages.scrapes, pages.ports
    args = build_parser().parse_args(
        [
            "--endpoints", ",".join(f"{HOST}:{p}" for p in ports),
            "--config-text", A,  # not a watched file: the test installs every config itself
            "--bind-address", HOST,
            "--grpc-port", str(free_port(HOST)),
            "--grpc-health-port", str(free_port(HOST)),
            "--metrics-port", str(free_port(HOST)),
            "--secure-serving=false",
            "--refresh-metrics-interval", "20ms",
        ]
    )  # fmt: skip
    server = PickerServer(serve_options(args))
    await server.start()
    routed: Counter[str] = Counter()
    failures: list[BaseException] = []
    running, parked = asyncio.Event(), asyncio.Event()
    running.set()
    stop = False

    async def traffic() -> None:
        turn = 0
        while not stop:
            if not running.is_set():
                parked.set()
                await running.wait()
                parked.clear()
            turn += 1
            body = b'{"model": "m", "prompt": "shared system prompt %d and a question"}' % (turn % 7)
            try:
                request = await server.director.route(body, {":path": "/v1/completions"}, None)
                routed[request.targets[0]] += 1
                request.finish()
            except BaseException as error:
                failures.append(error)
                raise
            await asyncio.sleep(0)

    async def flip(text: str, path: str) -> None:
        assert server.runtimes.reload(text.encode(), "test")
        await server.runtimes.settle()
        collector = server.data_layer.collector
        assert collector is not None and collector.path == path
        seen = scrapes[path]
        await until(lambda: scrapes[path] > seen, f"a scrape of {path}")

    client = asyncio.create_task(traffic())
    try:
        await flip(B, "/engine/metrics")
        await flip(A, "/metrics")
        running.clear()
        await parked.wait()  # no request in the middle of its turn
        before = counts(server)
        running.set()
        for i in range(100):
            text, path = (B, "/engine/metrics") if i % 2 == 0 else (A, "/metrics")
            await flip(text, path)
            index = server.runtimes.current.plugins["approx-prefix-cache-producer"].index  # type: ignore[attr-defined]
            assert index.default_capacity == (2000 if text is B else 1000)
        running.clear()
        await parked.wait()
        after = counts(server)
        installed_keys = server.runtimes.current.persistent_keys
    finally:
        stop = True
        running.set()
        await asyncio.gather(client, return_exceptions=True)
        await server.stop()
    assert not failures
    assert sum(routed.values()) > 200, routed
    assert after == before, f"grew over 100 reloads: {before} -> {after}"
    # Only what the installed config uses is kept: one index (and its listener), not one per
    # config ever installed; the listeners are the director's, that index's and the collector's.
    assert after["persistent objects"] == len(installed_keys)
    assert after["datastore listeners"] == 3
    assert server.datastore.listener_count() == 1  # the director's own, once everything stopped
