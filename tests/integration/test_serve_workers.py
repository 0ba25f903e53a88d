"""`picker serve --workers 2` with real processes: the workers share the ext_proc port behind
real Envoy, the parent's /metrics sums their counters, its health reflects them, a worker
killed with -9 under load fails only its requests in flight and comes back, SIGTERM drains all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from grpc_health.v1 import health_pb2

from picker.workers.metrics import parse_page
from picker_bench.envoy import EnvoyProcess, picker_config
from picker_bench.process import free_port, wait_until
from tests.integration.test_reliability_faults import post
from tests.stack import Picker, health_status, serving, start_picker

KILL_NOTICE_SECONDS = 0.2  # a dead worker's connection reset reaching Envoy
LOAD_THREADS = 8


def worker_pids(parent: int) -> set[int]:
    """The parent's spawned workers (not multiprocessing's resource tracker)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rpartition(")")[2].split()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, NotADirectoryError):
            continue
        if int(stat[1]) == parent and b"spawn_main" in cmdline:
            pids.add(int(entry.name))
    return pids


def metric(picker: Picker, name: str, worker: int | None = None) -> float:
    """One metric of the parent's page (or of worker `worker`'s own), summed over its labels."""
    query = "" if worker is None else f"?worker={worker}"
    with urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/metrics{query}", timeout=5) as r:
        page = parse_page(r.read().decode())
    return sum(s.value for f in page for s in f.samples if s.name == name)


def envoy_for(picker: Picker, log_dir: Path, name: str) -> EnvoyProcess:
    """BUFFERED Envoy sending one stream per connection: each request opens its own, so the
    kernel spreads them over the workers."""
    config = picker_config(
        "buffered",
        ("127.0.0.1", free_port()),
        ("127.0.0.1", picker.grpc_port),
        ("127.0.0.1", free_port()),
        streams_per_connection=1,
    )
    envoy = EnvoyProcess(name, config, log_dir).start()
    envoy.wait_ready(envoy.ready)
    return envoy


@contextmanager
def load(url: str) -> Iterator[list[tuple[float, float, int]]]:
    """LOAD_THREADS clients looping through Envoy; (start, end, status) of every request."""
    results: list[tuple[float, float, int]] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            begin = time.monotonic()
            status, _ = post(url, timeout=10)
            results.append((begin, time.monotonic(), status))

    threads = [threading.Thread(target=loop) for _ in range(LOAD_THREADS)]
    for thread in threads:
        thread.start()
    try:
        yield results
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def start_workers(backends: tuple[list[str], object], log_dir: Path, name: str, *extra: str) -> Picker:
    return start_picker(log_dir, "--endpoints", ",".join(backends[0]), "--workers", "2", *extra, name=name, tls=True)


def routed(picker: Picker, worker: int | None = None) -> float:
    return metric(picker, "picker_requests_routed_total", worker)


def test_two_workers_serve_one_port_and_the_parent_sums_their_counters(
    backends: tuple[list[str], object], log_dir: Path
) -> None:
    picker = start_workers(backends, log_dir, "picker-workers-share")
    envoy = envoy_for(picker, log_dir, "envoy-workers-share")
    try:
        assert len(worker_pids(picker.process.pid)) == 2
        assert metric(picker, "picker_workers_ready") == 2
        with load(envoy.url) as results:
            wait_until(lambda: len(results) >= 200, 30, "200 requests")
        assert {status for _, _, status in results} == {200}
        own = [routed(picker, 0), routed(picker, 1)]
        assert all(count > 0 for count in own), own  # the kernel gave each worker connections
        assert routed(picker) == sum(own) == len(results)
    finally:
        envoy.stop()
        picker.stop()


def test_a_worker_killed_under_load_fails_only_its_requests_in_flight_and_comes_back(
    backends: tuple[list[str], object], log_dir: Path
) -> None:
    picker = start_workers(backends, log_dir, "picker-workers-kill")
    envoy = envoy_for(picker, log_dir, "envoy-workers-kill")
    try:
        doomed = min(worker_pids(picker.process.pid))
        with load(envoy.url) as results:
            wait_until(lambda: len(results) >= 100, 30, "load to run")
            before = routed(picker)
            killed_at = time.monotonic()
            os.kill(doomed, signal.SIGKILL)
            wait_until(lambda: metric(picker, "picker_worker_restarts_total") == 1, 20, "the worker's restart")
            wait_until(lambda: metric(picker, "picker_workers_ready") == 2, 30, "both workers serving again")
            back_at = time.monotonic()
            wait_until(lambda: sum(1 for b, _, _ in results if b > back_at) >= 100, 30, "load after the restart")
        failed = [(begin, status) for begin, _, status in results if status != 200]
        # FailClose: the requests whose streams the dead worker held get Envoy's 500 (or a cut
        # response): those in flight at the kill, and those Envoy put on the dead connection in
        # the moment before the kernel's reset reached it (a client whose request failed at once
        # may send another into that moment: their number is not bounded by the clients); none
        # later.
        assert all(begin < killed_at + KILL_NOTICE_SECONDS for begin, _ in failed), (killed_at, failed)
        assert serving(picker.health_port)  # the other worker served meanwhile: the pod stayed ready
        pids = worker_pids(picker.process.pid)
        assert len(pids) == 2 and doomed not in pids
        assert routed(picker) >= before  # the dead worker's counts stay in the sum
        # New connections reach the restarted worker too.
        fresh = envoy_for(picker, log_dir, "envoy-workers-kill-fresh")
        try:
            counts = [routed(picker, 0), routed(picker, 1)]
            with load(fresh.url) as more:
                wait_until(lambda: len(more) >= 100, 30, "load on fresh connections")
            assert {status for _, _, status in more} == {200}
            assert all(after > was for after, was in zip([routed(picker, 0), routed(picker, 1)], counts, strict=True))
        finally:
            fresh.stop()
    finally:
        envoy.stop()
        picker.stop()


def test_sigterm_drains_every_worker_with_the_shutdown_delay(backends: tuple[list[str], object], log_dir: Path) -> None:
    picker = start_workers(backends, log_dir, "picker-workers-drain", "--shutdown-delay", "5s")
    envoy = envoy_for(picker, log_dir, "envoy-workers-drain")
    try:
        workers = worker_pids(picker.process.pid)
        assert picker.process.proc is not None
        os.kill(picker.process.pid, signal.SIGTERM)  # the parent alone, as the kubelet does
        wait_until(lambda: not serving(picker.health_port), 5.0, "NOT_SERVING after SIGTERM")
        assert health_status(picker.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING
        # NOT_SERVING comes first; then, within --shutdown-delay, the workers still route, and
        # the parent waits the delay out rather than stop once idle.
        statuses = [post(envoy.url)[0] for _ in range(10)]
        assert statuses == [200] * 10 and picker.process.proc.poll() is None
        assert picker.process.proc.wait(20) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
    finally:
        envoy.stop()
        picker.stop()


def test_a_worker_that_cannot_start_stops_the_picker_with_its_error(log_dir: Path) -> None:
    argv = [sys.executable, "-m", "picker.cli", "serve", "--workers", "2", "--endpoints", "127.0.0.1:1"]
    argv += ["--bind-address", "127.0.0.1", "--grpc-port", str(free_port()), "--grpc-health-port", str(free_port())]
    argv += ["--metrics-port", str(free_port()), "--config-text", "plugins: [{type: no-such-plugin}]"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "no-such-plugin" in done.stderr and "before all started" in done.stderr
