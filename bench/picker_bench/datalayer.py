"""Benchmark of the data layer: `python -m picker_bench.datalayer [--endpoints N] [--seconds S]`.

Prints (1) CPU per parse of a realistic ~300-line vLLM page, next to prometheus_client's
parser; (2) CPU per full scrape cycle (timer, HTTP request over a kept-alive connection,
read, parse, datastore write, metrics) against real HTTP servers in a separate process, so
only the picker side is counted, with 20 and with `--endpoints` endpoints; (3) from that, how
many endpoints one core keeps fresh at the interval, next to the scrape rate achieved and the
metrics ages seen. The per-scrape cost falls as the rate rises (fewer idle wake-ups), so the
larger run gives the better capacity estimate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from picker_extproc_core import wanted_lines

from picker.datalayer.collector import MAX_PAGE_BYTES, MetricsCollector
from picker.datalayer.engines import BUILTIN_ENGINES
from picker.datalayer.parse import parse_page
from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.telemetry.metrics import SCRAPE_DURATION
from picker_bench.metric_pages import vllm_page

SERVER_HOST = "127.0.0.2"


def _cpu_per_call(fn: object, calls: int) -> float:
    """Process CPU seconds per call of `fn`, best of three runs."""
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(calls):
            fn()  # type: ignore[operator]
        best = min(best, (time.process_time() - start) / calls)
    return best


def bench_parse() -> None:
    page = vllm_page()
    spec = BUILTIN_ENGINES["vllm"]
    per_parse = _cpu_per_call(lambda: parse_page(page, spec), 5000)
    families = sorted(spec.families)
    per_scan = _cpu_per_call(lambda: wanted_lines(page, families), 5000)
    wanted = wanted_lines(page, families)
    per_lines = _cpu_per_call(lambda: parse_page(wanted, spec), 5000)
    lines = page.count(b"\n")
    print(f"page: {lines} lines, {len(page)} bytes (picker_bench.metric_pages.vllm_page)")
    print(f"targeted scan in Python, CPU per parse: {per_parse * 1e6:8.1f} µs   (the https path)")
    print(f"the core's line scan, CPU per page:     {per_scan * 1e6:8.1f} µs   (every http scrape, off the loop)")
    print(f"parse_page of those lines:              {per_lines * 1e6:8.1f} µs   (only when they changed)")
    from prometheus_client.parser import text_string_to_metric_families

    text = page.decode()
    reference = _cpu_per_call(lambda: list(text_string_to_metric_families(text)), 30)
    print(f"prometheus_client parser, CPU per parse: {reference * 1e6:8.1f} µs")
    filler = b"".join(b'filler_metric{i="%d"} %d\n' % (i, i) for i in range(200_000))
    capped = (page + filler)[:MAX_PAGE_BYTES]
    per_big = _cpu_per_call(lambda: parse_page(capped, spec), 5)
    print(
        f"a page at the 4 MiB cap, CPU per parse:  {per_big * 1e3:8.2f} ms   (the most one scrape can block the loop)"
    )


async def _serve(count: int) -> None:
    """Serve the vLLM page on `count` ports of SERVER_HOST; print the ports as JSON, run until killed."""
    from aiohttp import web

    page = vllm_page()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ports = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((SERVER_HOST, 0))
        ports.append(sock.getsockname()[1])
        await web.SockSite(runner, sock, backlog=1024).start()
    print(json.dumps(ports), flush=True)
    await asyncio.Event().wait()


def _start_servers(count: int) -> tuple[subprocess.Popen[str], list[int]]:
    server = subprocess.Popen(
        [sys.executable, "-m", "picker_bench.datalayer", "--serve", str(count)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert server.stdout is not None
    line = server.stdout.readline()
    if not line:
        server.kill()
        raise RuntimeError("benchmark server did not start")
    return server, json.loads(line)


def _scrapes_done() -> float:
    """Successful scrapes so far, over every endpoint (picker_scrape_duration_seconds_count)."""
    samples = (sample for family in SCRAPE_DURATION.collect() for sample in family.samples)
    return sum(sample.value for sample in samples if sample.name.endswith("_count"))


async def _run_collector(ports: list[int], interval: float, seconds: float) -> dict[str, float]:
    datastore = Datastore()
    datastore.set_endpoints(Endpoint(SERVER_HOST, port) for port in ports)
    collector = MetricsCollector(datastore, interval=interval)
    await collector.start()
    try:
        # Warm up: every endpoint scraped once (connections open), then measure.
        deadline = time.monotonic() + 10
        while any(datastore.metrics(f"{SERVER_HOST}:{p}").update_time == 0 for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("endpoints not scraped within 10 s")
            await asyncio.sleep(0.05)
        ages: list[float] = []
        times0, wall0, scrapes0 = os.times(), time.monotonic(), _scrapes_done()
        while time.monotonic() - wall0 < seconds:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            ages.extend(s.metrics_age(now) for s in datastore.snapshot())
        times, wall, scrapes = os.times(), time.monotonic() - wall0, _scrapes_done() - scrapes0
    finally:
        await collector.stop()
    ages.sort()
    return {
        "scrapes": scrapes,
        "cpu": (times.user - times0.user) + (times.system - times0.system),
        "sys": times.system - times0.system,
        "wall": wall,
        "age_p50": statistics.median(ages),
        "age_p99": ages[int(0.99 * (len(ages) - 1))],
        "age_max": ages[-1],
    }


def bench_scrape(endpoints: int, seconds: float, interval: float) -> None:
    server, ports = _start_servers(max(endpoints, 20))
    try:
        for count in sorted({20, endpoints}):
            run = asyncio.run(_run_collector(ports[:count], interval, seconds))
            per_scrape = run["cpu"] / run["scrapes"]
            ideal = count * run["wall"] / interval
            print(f"{count} endpoints every {interval * 1e3:.0f} ms for {run['wall']:.1f} s:")
            print(
                f"  CPU per scrape cycle incl. HTTP:  {per_scrape * 1e6:6.0f} µs"
                f"   ({run['sys'] / run['scrapes'] * 1e6:.0f} µs of it in the kernel)"
            )
            print(f"  => endpoints one core keeps fresh at {interval * 1e3:.0f} ms: ~{interval / per_scrape:.0f}")
            print(
                f"  scrapes {run['scrapes']:.0f} of {ideal:.0f} ideal ({run['scrapes'] / ideal:.0%});"
                f" picker CPU {run['cpu'] / run['wall']:.0%} of a core"
            )
            print(
                f"  metrics age p50 {run['age_p50'] * 1e3:.0f} ms, p99 {run['age_p99'] * 1e3:.0f} ms,"
                f" max {run['age_max'] * 1e3:.0f} ms"
            )
    finally:
        server.terminate()
        server.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker_bench.datalayer", description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=50, help="endpoints in the check run (default 50)")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each scrape run (default 3)")
    parser.add_argument("--interval", type=float, default=0.05, help="refresh interval in seconds (default 0.05)")
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server subprocess
    args = parser.parse_args(argv)
    if not args.no_uvloop:
        import uvloop

        uvloop.install()
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    if args.endpoints < 1 or args.seconds <= 0 or args.interval <= 0:
        parser.error("--endpoints, --seconds and --interval must be positive")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"event loop: {'asyncio' if args.no_uvloop else 'uvloop'}; {os.cpu_count()} CPUs, load average {load}")
    print("CPU = user+system time of the picker-side process only (servers run in a subprocess)")
    bench_parse()
    bench_scrape(args.endpoints, args.seconds, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
