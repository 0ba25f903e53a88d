"""The parent of `picker serve --workers N`: starts N picker processes serving one ext_proc
port, answers health and metrics for the pod, restarts a worker that dies, drains them all on
SIGTERM.

The port is shared with SO_REUSEPORT (each worker's gRPC server binds it with
`grpc.so_reuseport`): the kernel gives each new connection to one of the bound workers, and a
worker that dies leaves the group with its socket, so its connections' retries land on the
others. A pre-bound socket handed down would do the same, but grpcio has no API to serve on an
inherited listening socket.

Each worker is spawned (not forked: gRPC does not survive a fork) with its health and metrics
on unix sockets in a private run directory; the parent's health answer is SERVING while any
worker is (once all started), and its /metrics page merges the workers' (picker.workers.metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import aiohttp
import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from picker.telemetry.health import HealthServicer
from picker.telemetry.http import AccessReviewer, metrics_app, start_metrics_server
from picker.workers.metrics import Families, FamiliesCollector, merge, parse_page, retire
from picker.workers.role import WorkerRole

log = logging.getLogger("picker")

HEALTH_POLL_SECONDS = 0.5
# Reconnect soon to a worker that is starting (gRPC's default backoff grows to two minutes).
_HEALTH_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
METRICS_POLL_SECONDS = 5.0  # bounds what a dead worker counted but the parent never read
STABLE_SECONDS = 10.0  # a worker that ran this long was not crash-looping
MAX_RESTART_DELAY_SECONDS = 30.0
KILL_MARGIN_SECONDS = 10.0  # past --shutdown-delay + --shutdown-grace, a worker is killed
_PR_SET_PDEATHSIG = 1


class ParentServing(Protocol):
    """What the parent serves on, how many workers it runs and how long they may take to stop
    (`picker serve`'s serving options)."""

    @property
    def bind_address(self) -> str: ...
    @property
    def grpc_health_port(self) -> int: ...
    @property
    def metrics_port(self) -> int: ...
    @property
    def workers(self) -> int: ...
    @property
    def shutdown_delay(self) -> float: ...
    @property
    def shutdown_grace(self) -> float: ...


# What each worker is told (picklable: workers are spawned); the supervisor only hands it on.
WorkerOptions = TypeVar("WorkerOptions")
ReviewerFactory = Callable[[], Awaitable[AccessReviewer | None]]


def _worker_entry(
    worker_main: Callable[[WorkerOptions, WorkerRole], None], options: WorkerOptions, role: WorkerRole
) -> None:
    """The spawned process: dies with its parent (a kill -9 of the parent leaves no orphan
    on the port), then runs the picker."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: orphans outlive a killed parent
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    worker_main(options, role)


class Worker:
    """One worker slot: the process in it now and what the parent last learnt from it."""

    def __init__(self, role: WorkerRole) -> None:
        self.role = role
        self.process: BaseProcess | None = None
        self.started_at = 0.0
        self.ready = False
        self.last_page: Families | None = None
        self.health: grpc.aio.Channel | None = None  # to its health service
        self.fast_failures = 0  # consecutive exits within STABLE_SECONDS of the start

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.exitcode is None


class Supervisor(Generic[WorkerOptions]):
    """The workers of one `picker serve --workers N` and the parent's health and metrics servers."""

    def __init__(
        self,
        serving: ParentServing,
        worker_options: WorkerOptions,
        worker_main: Callable[[WorkerOptions, WorkerRole], None],
        run_dir: Path,
    ) -> None:
        self.serving_options = serving
        self.worker_options = worker_options
        self.worker_main = worker_main
        self.workers = [
            Worker(
                WorkerRole(
                    index=i,
                    health_address=f"unix:{run_dir / f'worker-{i}-health.sock'}",
                    metrics_socket=str(run_dir / f"worker-{i}-metrics.sock"),
                )
            )
            for i in range(serving.workers)
        ]
        self.exits: asyncio.Queue[Worker] = asyncio.Queue()
        self.started = False  # every worker was ready once
        self.draining = False
        self.retired: Families | None = None  # what dead workers counted
        self.restarts: set[asyncio.Task[None]] = set()
        self.health_server: grpc.aio.Server | None = None
        self.metrics_runner: web.AppRunner | None = None
        self.registry = CollectorRegistry()
        self.merged = FamiliesCollector()
        self.registry.register(self.merged)
        self.restart_count = Counter(
            "picker_worker_restarts", "Workers restarted after they died.", registry=self.registry
        )
        self.ready_count = Gauge("picker_workers_ready", "Workers answering SERVING.", registry=self.registry)

    # -- processes ---------------------------------------------------------------------------
    def _spawn(self, worker: Worker) -> None:
        for path in (worker.role.metrics_socket, worker.role.health_address.removeprefix("unix:")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead worker's socket file
        context = multiprocessing.get_context("spawn")
        process = context.Process(
            target=_worker_entry,
            args=(self.worker_main, self.worker_options, worker.role),
            name=f"picker-worker-{worker.role.index}",
        )
        process.start()
        worker.process, worker.started_at, worker.ready = process, time.monotonic(), False
        worker.health = grpc.aio.insecure_channel(worker.role.health_address, options=_HEALTH_CHANNEL_OPTIONS)
        loop = asyncio.get_running_loop()
        sentinel = process.sentinel

        def exited() -> None:
            loop.remove_reader(sentinel)
            self.exits.put_nowait(worker)

        loop.add_reader(sentinel, exited)
        log.info("worker %d started, pid %d", worker.role.index, process.pid)

    async def _reap(self, worker: Worker) -> int:
        """The dead worker's exit code (negative: the signal); its counts are kept."""
        assert worker.process is not None
        if worker.health is not None:
            await worker.health.close()
            worker.health = None
        worker.process.join()
        code = worker.process.exitcode
        worker.process.close()
        worker.process, worker.ready = None, False
        if worker.last_page is not None:
            self.retired = retire(self.retired, worker.last_page)
            worker.last_page = None
        return code if code is not None else 1

    async def _restart_later(self, worker: Worker, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self.draining:
            self.restart_count.inc()
            self._spawn(worker)

    def _schedule_restart(self, worker: Worker, ran: float) -> None:
        """At once after a worker ran a while; backing off (to 30 s) while it keeps dying young."""
        worker.fast_failures = worker.fast_failures + 1 if ran < STABLE_SECONDS else 0
        delay = 0.0 if worker.fast_failures == 0 else min(MAX_RESTART_DELAY_SECONDS, 0.25 * 2**worker.fast_failures)
        task = asyncio.create_task(self._restart_later(worker, delay), name=f"restart-worker-{worker.role.index}")
        self.restarts.add(task)
        task.add_done_callback(self.restarts.discard)

    # -- health ------------------------------------------------------------------------------
    def serving(self) -> bool:
        return self.started and any(worker.ready for worker in self.workers)

    async def _worker_serving(self, worker: Worker) -> bool:
        if worker.health is None:
            return False
        try:
            answer = await health_pb2_grpc.HealthStub(worker.health).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    async def _poll_health(self) -> None:
        while True:
            for worker in self.workers:
                worker.ready = worker.alive and await self._worker_serving(worker) and worker.alive
            self.ready_count.set(sum(worker.ready for worker in self.workers))
            if not self.started and all(worker.ready for worker in self.workers):
                self.started = True
                log.info("all %d workers serving", len(self.workers))
            await asyncio.sleep(HEALTH_POLL_SECONDS)

    # -- metrics port ------------------------------------------------------------------------
    async def _get(self, worker: Worker, path: str, query: dict[str, str]) -> web.Response:
        connector = aiohttp.UnixConnector(path=worker.role.metrics_socket)
        timeout = aiohttp.ClientTimeout(total=None if path.startswith("/debug/pprof") else 5.0)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.get(f"http://worker{path}", params=query) as answer,
        ):
            body = await answer.read()
            content_type = answer.headers["Content-Type"]
            return web.Response(status=answer.status, body=body, headers={"Content-Type": content_type})

    async def _page(self, worker: Worker) -> Families | None:
        """The worker's metrics now, else the last read (a busy worker does not dip the sums)."""
        try:
            answer = await self._get(worker, "/metrics", {})
            assert answer.body is not None
            worker.last_page = parse_page(bytes(answer.body).decode())  # type: ignore[arg-type]  # bytes as read
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            log.debug("worker %d metrics: %s", worker.role.index, error)
        return worker.last_page

    async def _pages(self) -> list[Families]:
        pages = await asyncio.gather(*(self._page(w) for w in self.workers if w.alive))
        return [page for page in pages if page is not None]

    async def exposition(self, request: web.Request) -> bytes:
        """The pod's /metrics page: the workers' merged, and the parent's own; `?worker=I`:
        that worker's own page."""
        if "worker" in request.query:
            answer = await self._from_a_worker(request)
            if answer.status != 200:
                raise web.HTTPServiceUnavailable(text=answer.text)
            return bytes(answer.body)  # type: ignore[arg-type]  # a page as read: bytes
        self.merged.families = merge(await self._pages(), self.retired)
        return generate_latest(self.registry)

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_POLL_SECONDS)
            await self._pages()

    async def _from_a_worker(self, request: web.Request) -> web.Response:
        """Other paths (/config, /debug/...) are a worker's: `?worker=I`, else the first serving."""
        query = dict(request.query)
        choice = query.pop("worker", None)
        try:
            worker = self.workers[int(choice)] if choice is not None else next(w for w in self.workers if w.ready)
        except (ValueError, IndexError):
            return web.Response(status=400, text=f"worker: expected 0..{len(self.workers) - 1}, got {choice!r}\n")
        except StopIteration:
            return web.Response(status=503, text="no worker is serving\n")
        try:
            return await self._get(worker, request.path, query)
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            return web.Response(status=503, text=f"worker {worker.role.index}: {error}\n")

    async def _start_servers(self, reviewer: AccessReviewer | None) -> None:
        options = self.serving_options
        self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        servicer = HealthServicer(self.serving, lambda: self.draining)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self.health_server)
        self.health_server.add_insecure_port(f"{options.bind_address}:{options.grpc_health_port}")
        await self.health_server.start()
        app = metrics_app(reviewer=reviewer, exposition=self.exposition)
        app.router.add_get("/{path:.*}", self._from_a_worker)
        self.metrics_runner = await start_metrics_server(app, options.bind_address, options.metrics_port)

    async def _stop_servers(self) -> None:
        if self.health_server is not None:
            await self.health_server.stop(grace=1.0)
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()

    # -- lifecycle ---------------------------------------------------------------------------
    async def _watch(self, stop: asyncio.Event) -> int:
        """Restart workers that die until `stop`; 0, or a worker's exit code if one failed to start."""
        stopped = asyncio.create_task(stop.wait(), name="stop-signal")
        try:
            while True:
                exited = asyncio.create_task(self.exits.get(), name="worker-exit")
                await asyncio.wait((stopped, exited), return_when=asyncio.FIRST_COMPLETED)
                if not exited.done():
                    exited.cancel()
                    return 0
                worker = exited.result()
                ran = time.monotonic() - worker.started_at
                code = await self._reap(worker)
                if not self.started:
                    log.error("worker %d exited (code %d) before all started: stopping", worker.role.index, code)
                    return code or 1
                log.error("worker %d exited (code %d) after %.1fs: restarting it", worker.role.index, code, ran)
                self._schedule_restart(worker, ran)
        finally:
            stopped.cancel()

    async def _drain(self) -> None:
        """SIGTERM every worker (each drains as `picker serve` does), kill those still there after
        --shutdown-delay + --shutdown-grace + a margin."""
        self.draining = True
        for task in self.restarts:
            task.cancel()
        for worker in self.workers:
            if worker.alive and worker.process is not None and worker.process.pid is not None:
                os.kill(worker.process.pid, signal.SIGTERM)
        options = self.serving_options
        deadline = time.monotonic() + options.shutdown_delay + options.shutdown_grace + KILL_MARGIN_SECONDS
        while any(worker.process is not None for worker in self.workers):
            try:
                await self._reap(await asyncio.wait_for(self.exits.get(), max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                for worker in self.workers:
                    if worker.process is not None:
                        log.error("worker %d did not stop in time: killing it", worker.role.index)
                        worker.process.kill()
                deadline = time.monotonic() + KILL_MARGIN_SECONDS

    async def run(self, stop: asyncio.Event, reviewer: AccessReviewer | None) -> int:
        try:
            await self._start_servers(reviewer)
        except (OSError, RuntimeError) as error:  # RuntimeError: gRPC could not bind its port
            log.error("cannot start: %s", error)
            await self._stop_servers()
            return 1
        for worker in self.workers:
            self._spawn(worker)
        pollers = [
            asyncio.create_task(self._poll_health(), name="worker-health"),
            asyncio.create_task(self._poll_metrics(), name="worker-metrics"),
        ]
        code = await self._watch(stop)
        log.info("shutting down %d workers", sum(worker.alive for worker in self.workers))
        await self._drain()
        for task in pollers:
            task.cancel()
        await asyncio.gather(*pollers, return_exceptions=True)
        await self._stop_servers()
        return code


async def supervise(
    serving: ParentServing,
    worker_options: WorkerOptions,
    worker_main: Callable[[WorkerOptions, WorkerRole], None],
    reviewer_factory: ReviewerFactory,
) -> int:
    """Run `serving.workers` workers (each `worker_main(worker_options, role)` in its own
    process) until SIGTERM; the parent's metrics port reviews with `reviewer_factory()`'s reviewer."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        reviewer = await reviewer_factory()
    except ValueError as error:
        log.error("cannot start: %s", error)
        return 1
    run_dir = Path(tempfile.mkdtemp(prefix="picker-workers-"))  # 0700: the workers' ports are private
    try:
        return await Supervisor(serving, worker_options, worker_main, run_dir).run(stop, reviewer)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
