"""What an EPP costs as its pool grows: `python -m picker_bench.poolsize [--endpoints 8,64,256,1024]
[--seconds S] [--idle-seconds S] [--rate R] [--repeats R] [--scrape-load N] [--reference-epp PATH]
[--json FILE]`.

For each pool size N: N/8 Pods at distinct loopback addresses (127.0.x.y), each with the same 8
target ports, as a team with large pods would run them. One backend process
(`picker_bench.backend --metrics`, uvloop) listens on the 8 ports of every address and answers
both the completions (a fixed small JSON) and GET /metrics (a static 29 KB vLLM page), so the
EPP's scrapes are real HTTP against real pages; the backend's own CPU is reported beside the
EPP's. Then, for picker (`picker serve --endpoints`, the default 50 ms scrapes) and, with
`--reference-epp`, the reference EPP (over a real kube-apiserver, `picker_bench.reference_epp`):

- start to SERVING (process start to its health service answering SERVING);
- idle CPU in cores over `--idle-seconds`, after the first scrapes (what scraping alone costs),
  with the scrapes per second the EPP reports (picker only) and its RSS;
- through Envoy in FULL_DUPLEX_STREAMED mode with response phases (TLS to the EPP) at `--rate`
  req/s for `--seconds` (2 KB completions): p50/p99, those above Envoy alone's (round robin over
  the same endpoints) and the EPP's CPU per request beyond its idle CPU. With `--repeats R`, R
  rounds of Envoy alone then through the EPP, each round's differences taken, the row their
  medians: on a shared VM one 15 s run's p99 (the 30th slowest of 3,000) moves by 2x from one
  run to the next, and alternating keeps a drift of the machine out of the difference.

After the rows, each larger pool over the smallest, per EPP (rows of one size pooled): added
p99, p99 and CPU per request as the ratio of the medians of their rounds, with a 90% bootstrap
interval over the rounds, so a reader sees whether the rounds can tell 1.2x from 1x.

Each EPP runs alone beside the backend and Envoy; everything shares the machine, so run it quiet.

With `--scrape-load N`, a pool smaller than N gets a second picker that serves no traffic and
scrapes N minus its size more endpoints (Pods of their own on the same backend) for the whole
row, Envoy alone's rounds included: every size then carries the scrape load of N endpoints (the
scraping picker's CPU and the backend's), so the rows differ only in the pool the request path
decides over. With real model servers the pages are served elsewhere; here they share two cores
with Envoy, the EPP and the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from itertools import groupby
from pathlib import Path
from statistics import median
from typing import Any

from picker_bench.envoy import EnvoyProcess, baseline_config, picker_config
from picker_bench.overhead import BODY_SIZES, RateResult, body_of, cpu_seconds, fixed_rate
from picker_bench.process import ManagedProcess, free_port, health_serving, port_open
from picker_bench.reference_epp import MAX_TARGET_PORTS, ReferenceEpp
from picker_bench.soak import rss_mib
from picker_bench.startup import PoolLayout

# After SERVING, the first scrapes of every endpoint (connections opened) before measuring idle.
WARM_UP_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class PoolRow:
    """One EPP at one pool size."""

    endpoints: int
    epp: str
    start_to_serving_s: float
    idle_cores: float
    scrapes_per_s: float | None  # picker's own count (picker_scrape_duration_seconds_count)
    rss_mb: float
    backend_idle_cores: float  # what serving the /metrics pages cost the backend meanwhile
    p50_ms: float
    p99_ms: float
    added_p50_ms: float
    added_p99_ms: float
    cpu_us_per_request: float
    errors: int
    rounds: int  # of Envoy alone then the EPP; the figures above are medians over them
    scrape_load: int  # endpoints scraped on the machine meanwhile (`--scrape-load`), this pool's included
    load_scrapes_per_s: float | None  # the second picker's scrapes of the extra endpoints, if any
    # Each round's figures, of which the ones above are the medians: what `Ratio` resamples.
    round_p99_ms: tuple[float, ...]
    round_added_p99_ms: tuple[float, ...]
    round_cpu_us_per_request: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Ratio:
    """One measure at a pool size over the same measure at the smallest size the EPP ran: the
    ratio of the medians of their rounds, and the 90% interval of that ratio when the rounds of
    each are resampled (bootstrap), which says whether the rounds can tell a ratio of 1.2 from 1."""

    epp: str
    measure: str
    endpoints: int
    base_endpoints: int
    ratio: float
    low: float
    high: float

    def line(self) -> str:
        return f"{self.measure} {self.ratio:.2f} [{self.low:.2f}-{self.high:.2f}]"


MEASURES = {  # a Ratio's measure: the rounds it reads
    "added p99": "round_added_p99_ms",
    "p99": "round_p99_ms",
    "CPU per request": "round_cpu_us_per_request",
}
DRAWS = 4000  # bootstrap resamples per ratio


def ratios(rows: list[PoolRow]) -> list[Ratio]:
    """Every measure of every pool size over the smallest size, per EPP, the rounds of rows of
    the same size pooled (`--endpoints 8,256,8,256` alternates them)."""
    pooled: dict[tuple[str, int], list[PoolRow]] = {}
    for row in rows:
        pooled.setdefault((row.epp, row.endpoints), []).append(row)
    found = []
    for (epp, endpoints), group in pooled.items():
        base = min(size for name, size in pooled if name == epp)
        if endpoints == base:
            continue
        for measure, field in MEASURES.items():
            ours = [value for row in group for value in getattr(row, field)]
            theirs = [value for row in pooled[epp, base] for value in getattr(row, field)]
            found.append(Ratio(epp, measure, endpoints, base, *ratio_with_interval(theirs, ours)))
    return found


def ratio_with_interval(base: list[float], other: list[float]) -> tuple[float, float, float]:
    """median(other) / median(base), and its 5th and 95th percentiles over resampled rounds
    (infinite where the base's median is not above zero: an added p99 can be negative)."""

    def ratio(a: list[float], b: list[float]) -> float:
        low = median(a)
        return median(b) / low if low > 0 else math.inf

    rng = random.Random(0)  # the same rounds give the same interval
    draws = sorted(ratio(rng.choices(base, k=len(base)), rng.choices(other, k=len(other))) for _ in range(DRAWS))
    return ratio(base, other), draws[DRAWS // 20], draws[DRAWS - DRAWS // 20 - 1]


def picker_scrapes(metrics_port: int) -> tuple[float, float]:
    """(successful scrapes so far summed over the endpoints, when): from picker's own /metrics;
    the time is the middle of the fetch, as rendering a large pool's page takes a while."""
    began = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    count = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("picker_scrape_duration_seconds_count{")
    )
    return count, (began + time.monotonic()) / 2


def idle_cost(
    pid: int, backend_pid: int, seconds: float, metrics_port: int | None
) -> tuple[float, float, float | None]:
    """(EPP cores, backend cores, EPP scrapes per second) over `seconds` with no requests; the
    CPU excludes the reading of picker's /metrics."""
    first = picker_scrapes(metrics_port) if metrics_port is not None else None
    epp, backend, began = cpu_seconds(pid), cpu_seconds(backend_pid), time.monotonic()
    time.sleep(seconds)  # the measurement itself: the EPP left alone
    epp, backend = cpu_seconds(pid) - epp, cpu_seconds(backend_pid) - backend
    wall = time.monotonic() - began
    rate = scrape_rate(metrics_port, first) if metrics_port is not None and first is not None else None
    return epp / wall, backend / wall, rate


def scrape_rate(metrics_port: int, since: tuple[float, float]) -> float:
    """picker's successful scrapes per second since `since` (a `picker_scrapes` reading)."""
    count, when = picker_scrapes(metrics_port)
    return (count - since[0]) / (when - since[1])


def under_load(
    config: dict[str, Any], name: str, pid: int | None, rate: float, seconds: float, work: Path
) -> tuple[RateResult, float]:
    """Latency at `rate` req/s through Envoy with `config`, and the CPU seconds `pid` used meanwhile."""
    envoy = EnvoyProcess(name, config, work).start()
    try:
        envoy.wait_ready(envoy.ready)
        body = body_of(BODY_SIZES["2KB"])
        url = envoy.url + "/v1/completions"
        asyncio.run(fixed_rate(url, body, rate, 1.0))  # warm-up: connections, caches
        before = cpu_seconds(pid) if pid is not None else 0.0
        began = time.monotonic()
        result = asyncio.run(fixed_rate(url, body, rate, seconds))
        used = cpu_seconds(pid) - before if pid is not None else 0.0
        return result, used / max(time.monotonic() - began, 1e-9) * seconds
    finally:
        envoy.stop()


def start_picker(name: str, pod_ips: list[str], ports: list[int], work: Path) -> tuple[ManagedProcess, int, int, float]:
    """picker on the Pods' endpoints: (process, ext_proc port, metrics port, start to SERVING)."""
    grpc_port, health, metrics = free_port(), free_port(), free_port()
    endpoints = ",".join(f"{ip}:{port}" for ip in pod_ips for port in ports)
    argv = [sys.executable, "-m", "picker.cli", "serve", "--endpoints", endpoints, "--bind-address", "127.0.0.1"]
    argv += ["--grpc-port", str(grpc_port), "--grpc-health-port", str(health), "--metrics-port", str(metrics)]
    argv += ["--secure-serving=true", "--enable-pprof=false", "--tracing=false", "--metrics-endpoint-auth=false"]
    started = time.monotonic()
    picker = ManagedProcess(name, argv, work).start()
    picker.wait_ready(lambda: health_serving("127.0.0.1", health) and port_open("127.0.0.1", grpc_port), timeout=60)
    return picker, grpc_port, metrics, time.monotonic() - started


def measure_pool(
    endpoints: int,
    reference_epp: Path | None,
    rate: float,
    seconds: float,
    idle_seconds: float,
    repeats: int,
    scrape_load: int,
    work: Path,
) -> list[PoolRow]:
    layout = PoolLayout(endpoints)
    # The Pods of the extra endpoints a second picker scrapes, after the pool's own.
    load_pod_ips = PoolLayout(scrape_load).pod_ips[len(layout.pod_ips) :] if scrape_load > endpoints else []
    ports = [free_port("0.0.0.0") for _ in range(MAX_TARGET_PORTS)]
    processes: list[ManagedProcess] = []
    rows: list[PoolRow] = []
    try:
        # Bound to every address: one listening socket per target port serves all the Pods.
        backend = ManagedProcess(
            f"backend-{endpoints}",
            [sys.executable, "-m", "picker_bench.backend", "--metrics", "0.0.0.0", *map(str, ports)],
            work,
        ).start()
        processes.append(backend)
        backend.wait_ready(lambda: all(port_open(layout.pod_ips[-1], port) for port in ports))
        load_metrics_port: int | None = None
        if load_pod_ips:
            load, _, load_metrics_port, _ = start_picker(f"scrape-load-{endpoints}", load_pod_ips, ports, work)
            processes.append(load)
        addresses = [f"{ip}:{port}" for ip in layout.pod_ips for port in ports]
        alone_config = baseline_config("round-robin", ("127.0.0.1", free_port()), addresses, ("127.0.0.1", free_port()))

        def row(epp: str, pid: int, grpc_port: int, serving: float, metrics_port: int | None) -> PoolRow:
            time.sleep(WARM_UP_SECONDS)  # the first scrapes of every endpoint, before measuring idle
            load_first = picker_scrapes(load_metrics_port) if load_metrics_port is not None else None
            idle, backend_idle, scrapes = idle_cost(pid, backend.pid, idle_seconds, metrics_port)
            load_scrapes = None
            if load_metrics_port is not None and load_first is not None:
                load_scrapes = scrape_rate(load_metrics_port, load_first)
            config = picker_config(
                "duplex", ("127.0.0.1", free_port()), ("127.0.0.1", grpc_port), ("127.0.0.1", free_port())
            )
            requests = max(int(rate * seconds), 1)
            rounds = []
            for n in range(repeats):
                alone, _ = under_load(alone_config, f"envoy-alone-{endpoints}-{n}", None, rate, seconds, work)
                loaded, cpu = under_load(config, f"{epp}-{endpoints}-{n}", pid, rate, seconds, work)
                cpu_us = (cpu - idle * seconds) / requests * 1e6
                rounds.append((alone, loaded, cpu_us))
                if repeats > 1:  # each round as it ends: how far apart they are is part of the result
                    print(f"  {endpoints} {epp} round {n + 1}: {round_line(alone, loaded, cpu_us)}", flush=True)
            p99s = tuple(loaded.p99_ms for _, loaded, _ in rounds)
            added_p99s = tuple(loaded.p99_ms - alone.p99_ms for alone, loaded, _ in rounds)
            cpus = tuple(cpu for _, _, cpu in rounds)
            result = PoolRow(
                endpoints=endpoints,
                epp=epp,
                start_to_serving_s=serving,
                idle_cores=idle,
                scrapes_per_s=scrapes,
                rss_mb=rss_mib(pid),
                backend_idle_cores=backend_idle,
                p50_ms=median(loaded.p50_ms for _, loaded, _ in rounds),
                p99_ms=median(p99s),
                added_p50_ms=median(loaded.p50_ms - alone.p50_ms for alone, loaded, _ in rounds),
                added_p99_ms=median(added_p99s),
                cpu_us_per_request=median(cpus),
                errors=sum(loaded.errors for _, loaded, _ in rounds),
                rounds=repeats,
                scrape_load=max(endpoints, scrape_load),
                load_scrapes_per_s=load_scrapes,
                round_p99_ms=p99s,
                round_added_p99_ms=added_p99s,
                round_cpu_us_per_request=cpus,
            )
            print(result_line(result), flush=True)
            return result

        picker, grpc_port, metrics_port, serving = start_picker(f"picker-{endpoints}", layout.pod_ips, ports, work)
        processes.append(picker)
        rows.append(row("picker", picker.pid, grpc_port, serving, metrics_port))
        picker.stop()
        if reference_epp is not None:
            reference = ReferenceEpp(reference_epp, layout.pod_ips, ports, True, work)
            try:
                reference.start()
                rows.append(row("reference EPP", reference.pid, reference.grpc_port, reference.startup_seconds, None))
            finally:
                reference.stop()
    finally:
        for process in reversed(processes):
            process.stop()
    return rows


def round_line(alone: RateResult, loaded: RateResult, cpu_us_per_request: float) -> str:
    return (
        f"Envoy alone p50/p99 {alone.p50_ms:.2f}/{alone.p99_ms:.2f} ms, through the EPP "
        f"{loaded.p50_ms:.2f}/{loaded.p99_ms:.2f} ms, added p99 {loaded.p99_ms - alone.p99_ms:.2f} ms, "
        f"{cpu_us_per_request:.0f} µs/request"
    )


def result_line(row: PoolRow) -> str:
    scrapes = f"{row.scrapes_per_s:7.0f}" if row.scrapes_per_s is not None else "      -"
    return (
        f"| {row.endpoints:5} | {row.epp:13} | {row.idle_cores:5.2f} | {scrapes} | {row.backend_idle_cores:5.2f} | "
        f"{row.cpu_us_per_request:6.0f} | {row.added_p50_ms:6.2f} / {row.added_p99_ms:6.2f} | {row.errors:3} | "
        f"{row.rss_mb:6.0f} | {row.start_to_serving_s:5.2f} |"
    )


HEADER = (
    "| endpoints | EPP | idle CPU (cores) | scrapes/s | backend idle CPU (cores) | CPU µs/request "
    "| added p50 / p99 ms | errors | RSS MB | start -> SERVING s |\n|---:|---|---:|---:|---:|---:|---|---:|---:|---:|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker_bench.poolsize", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--endpoints", default="8,64,256,1024", help="pool sizes, multiples of 8 (default 8,64,256,1024)"
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each fixed-rate run (default 15)")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="length of the idle measurement (default 5)")
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second (default 200)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of Envoy alone then the EPP per row; medians (default 1)"
    )
    parser.add_argument("--reference-epp", type=Path, metavar="PATH", help="also run the reference EPP's binary")
    parser.add_argument(
        "--reference-max-endpoints",
        type=int,
        default=256,
        help="run the reference only on pools up to this size (default 256: at 1,024 it never drains its queue here)",
    )
    parser.add_argument(
        "--scrape-load",
        type=int,
        default=0,
        metavar="N",
        help="a second picker scrapes more endpoints so every size carries the scrape load of N (default: off)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the rows and ratios as JSON to FILE")
    args = parser.parse_args(argv)
    try:
        sizes = [int(n) for n in args.endpoints.split(",")]
        for n in sizes:
            PoolLayout(n)
        if args.scrape_load:
            PoolLayout(args.scrape_load)
    except ValueError as exc:
        parser.error(f"--endpoints, --scrape-load: {exc}")
    if args.seconds <= 0 or args.idle_seconds <= 0 or args.rate <= 0 or args.repeats < 1:
        parser.error("--seconds, --idle-seconds, --rate and --repeats must be positive")
    print(
        f"{args.rate:g} req/s of 2 KB completions for {args.seconds:g} s through Envoy (FULL_DUPLEX + response, TLS); "
        f"idle over {args.idle_seconds:g} s; pages served by picker_bench.backend --metrics (uvloop); "
        f"{args.repeats} round(s) of Envoy alone then the EPP per row, the medians"
        + (f"; every row with the scrape load of {args.scrape_load} endpoints" if args.scrape_load else "")
    )
    print(HEADER, flush=True)
    rows: list[PoolRow] = []
    with tempfile.TemporaryDirectory(prefix="picker-poolsize-") as tmp:
        for n in sizes:
            reference = args.reference_epp if n <= args.reference_max_endpoints else None
            rows += measure_pool(
                n, reference, args.rate, args.seconds, args.idle_seconds, args.repeats, args.scrape_load, Path(tmp)
            )
    found = ratios(rows)
    if found:
        print("Over the smallest pool, the ratio of the medians of all rounds [90% bootstrap interval]:")
    for (epp, endpoints, base), group in groupby(found, key=lambda r: (r.epp, r.endpoints, r.base_endpoints)):
        print(f"  {epp} {endpoints} / {base} endpoints: " + ", ".join(r.line() for r in group))
    if args.json is not None:
        report = {"rows": [asdict(r) for r in rows], "ratios": [asdict(r) for r in found]}
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
