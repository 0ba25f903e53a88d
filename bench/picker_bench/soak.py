"""Soak: a steady mixed load through Envoy and the picker to `picker sim` pods, for minutes.

    python -m picker_bench.soak --minutes 10

Every request must be answered as expected (200, or the documented 400 for the deliberately
bad ones), the picker's p99 decision time must not drift, its RSS must grow less than 10%
after warm-up, and the approximate prefix index must stay within its configured capacity.
Exit status 0 when every check holds; the figures are printed (and written with `--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from picker_bench.envoy import EnvoyProcess, picker_config
from picker_bench.process import ManagedProcess, free_port, port_open, wait_until

MODEL = "sim-model"
SCHEDULER_HISTOGRAM = "inference_extension_scheduler_e2e_duration_seconds"
INDEX_SIZE = "inference_extension_prefix_indexer_size"
# A scheduler config whose prefix index is small enough to fill (and evict) during a soak.
CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: approx-prefix-cache-producer
  parameters: {{autoTune: false, lruCapacityPerServer: {capacity}}}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""


@dataclass(frozen=True, slots=True)
class SoakOptions:
    """The shape of one soak run."""

    seconds: float = 600.0
    rate: float = 25.0  # requests per second, steady (open loop)
    pods: int = 4
    warmup_s: float = 30.0  # RSS and decision-time baselines are taken after this
    window_s: float = 30.0  # one p99 / RSS sample per window
    lru_capacity: int = 400  # prefix-index entries per pod
    max_rss_growth: float = 0.10
    log_dir: Path | None = None


@dataclass(slots=True)
class Window:
    """One sampling window: how the picker looked at its end."""

    end_s: float
    requests: int
    p99_decision_ms: float | None
    rss_mib: float
    index_size: int


@dataclass(slots=True)
class SoakReport:
    """What a soak run saw; `failures` is empty when every check held."""

    seconds: float
    rate: float
    pods: int
    sent: int = 0
    answered_as_expected: int = 0
    lost: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    unexpected: dict[str, int] = field(default_factory=dict)
    windows: list[Window] = field(default_factory=list)
    rss_baseline_mib: float = 0.0
    rss_final_mib: float = 0.0
    index_capacity: int = 0
    index_max: int = 0
    streams_active_after: float = 0.0
    in_flight_after: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> float:
        return (self.rss_final_mib - self.rss_baseline_mib) / self.rss_baseline_mib if self.rss_baseline_mib else 0.0

    def summary(self) -> str:
        p99s = [w.p99_decision_ms for w in self.windows if w.p99_decision_ms is not None]
        lines = [
            f"soak: {self.seconds:.0f} s at {self.rate:g} req/s over {self.pods} sim pods "
            "(Envoy duplex, TLS to the picker)",
            f"  sent {self.sent}, answered as expected {self.answered_as_expected}, lost {self.lost}",
            "  by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(self.by_kind.items())),
            f"  p99 decision time per {len(self.windows)} windows (ms, bucket bound): "
            + " ".join(f"{p:g}" for p in p99s),
            (
                f"  picker RSS: {self.rss_baseline_mib:.1f} MiB after warm-up -> {self.rss_final_mib:.1f} MiB "
                f"at the end ({self.rss_growth * 100:+.1f}%)"
            ),
            f"  prefix index: max {self.index_max} entries, capacity {self.index_capacity}",
            f"  after the run: {self.streams_active_after:g} ext_proc streams open, {self.in_flight_after:g} in flight",
        ]
        if self.unexpected:
            lines.append(f"  unexpected outcomes: {self.unexpected}")
        lines.append("  PASS" if not self.failures else "  FAIL: " + "; ".join(self.failures))
        return "\n".join(lines)


# -- the mixed workload ----------------------------------------------------------------------

_SYSTEM_PROMPTS = [" ".join(f"system{s} rule{i} keep answers short and precise" for i in range(40)) for s in range(8)]


def _request(n: int, rng: random.Random) -> tuple[str, str, str, bytes | None, int]:
    """(kind, method, path, body, expected status) of the n-th request of the mix."""
    roll = rng.random()
    if roll < 0.35:
        prompt = rng.choice(_SYSTEM_PROMPTS) + f" question {n}"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
        return "shared-prefix", "POST", "/v1/completions", json.dumps(body).encode(), 200
    if roll < 0.60:
        turns = [{"role": "system", "content": _SYSTEM_PROMPTS[n % 3]}]
        for t in range(rng.randint(1, 4)):
            turns += [
                {"role": "user", "content": f"turn {t} of chat {n % 50}"},
                {"role": "assistant", "content": f"answer {t}"},
            ]
        turns.append({"role": "user", "content": f"follow-up {n}"})
        body = {"model": MODEL, "messages": turns, "max_tokens": 8}
        return "chat", "POST", "/v1/chat/completions", json.dumps(body).encode(), 200
    if roll < 0.75:
        body = {
            "model": MODEL,
            "prompt": f"stream {n} " + "word " * rng.randint(5, 200),
            "max_tokens": 8,
            "stream": True,
        }
        return "streaming", "POST", "/v1/completions", json.dumps(body).encode(), 200
    if roll < 0.90:
        words = " ".join(f"u{rng.getrandbits(32):x}" for _ in range(rng.randint(10, 400)))
        body = {"model": MODEL, "prompt": words, "max_tokens": 4}
        return "unique", "POST", "/v1/completions", json.dumps(body).encode(), 200
    if roll < 0.95:
        return "models", "GET", "/v1/models", None, 200
    return "bad-request", "POST", "/v1/completions", b'{"model": "sim-model", "prompt": ', 400


async def _send(session: aiohttp.ClientSession, base: str, item: tuple[str, str, str, bytes | None, int]) -> str | None:
    """None when the answer is the expected one, else what went wrong."""
    kind, method, path, body, expected = item
    headers = {"content-type": "application/json"} if body is not None else {}
    try:
        async with session.request(method, base + path, data=body, headers=headers) as r:
            raw = await r.read()
            if r.status != expected:
                return f"{kind}: status {r.status}"
            if expected == 200 and kind == "streaming" and not raw.rstrip().endswith(b"data: [DONE]"):
                return f"{kind}: truncated stream"
            if expected != 200 and b'"error"' not in raw:
                return f"{kind}: error without an OpenAI-style body"
            return None
    except (TimeoutError, aiohttp.ClientError) as e:
        return f"{kind}: {type(e).__name__}"


# -- observing the picker --------------------------------------------------------------------


def scrape(metrics_port: int) -> dict[str, float]:
    """Every sample on the picker's /metrics page, keyed by its full line name (labels included)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        samples = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples


def histogram_buckets(samples: dict[str, float], name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of an unlabelled histogram, ascending."""
    prefix = f'{name}_bucket{{le="'
    buckets = [(float(k[len(prefix) : -2]), v) for k, v in samples.items() if k.startswith(prefix)]
    return sorted(buckets)


def p99_between(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float | None:
    """The p99 of the observations between two bucket snapshots (its bucket's upper bound, s)."""
    start = dict(before)
    delta = [(bound, count - start.get(bound, 0.0)) for bound, count in after]
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return None
    for bound, count in delta:
        if count >= 0.99 * total:
            return bound
    return None


def sum_of(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def rss_mib(pid: int) -> float:
    """Resident set size of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- the run ---------------------------------------------------------------------------------


def start_sim_pods(pods: int, log_dir: Path, *flags: str, name: str = "soak-sim") -> tuple[ManagedProcess, list[str]]:
    """`picker sim` (tiny profile, free ports, extra `flags`) and its pods' `ip:port` addresses."""
    sim = ManagedProcess(
        name,
        [
            sys.executable,
            "-m",
            "picker.cli",
            "sim",
            "--pods",
            str(pods),
            "--base-port",
            "0",
            "--profile",
            "tiny",
            "--model",
            MODEL,
            *flags,
        ],
        log_dir,
    )
    sim.log_path.unlink(missing_ok=True)  # its pod lines are read back from this log
    sim.start()
    sim.wait_ready(lambda: "ready" in sim.log_path.read_text(errors="replace").split(), timeout=30)
    addresses = [
        line.split()[2].removeprefix("http://")
        for line in sim.log_path.read_text().splitlines()
        if line.startswith("pod ")
    ]
    return sim, addresses


def _start_picker(addresses: list[str], capacity: int, log_dir: Path) -> tuple[ManagedProcess, int, int]:
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    picker = ManagedProcess(
        "soak-picker",
        [
            sys.executable,
            "-m",
            "picker.cli",
            "serve",
            "--bind-address",
            "127.0.0.1",
            "--grpc-port",
            str(grpc_port),
            "--grpc-health-port",
            str(health_port),
            "--metrics-port",
            str(metrics_port),
            "--endpoints",
            ",".join(addresses),
            "--config-text",
            CONFIG.format(capacity=capacity),
        ],
        log_dir,
    ).start()
    picker.wait_ready(lambda: port_open("127.0.0.1", grpc_port) and port_open("127.0.0.1", metrics_port))
    return picker, grpc_port, metrics_port


async def _drive(options: SoakOptions, base: str, metrics_port: int, picker_pid: int, report: SoakReport) -> None:
    rng = random.Random(7)
    connector = aiohttp.TCPConnector(limit=512)
    timeout = aiohttp.ClientTimeout(total=60)
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()

    async def one(item: tuple[str, str, str, bytes | None, int]) -> None:
        problem = await _send(session, base, item)
        if problem is None:
            report.answered_as_expected += 1
        else:
            report.unexpected[problem] = report.unexpected.get(problem, 0) + 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = loop.time()
        next_window = start + options.window_s
        last_buckets = histogram_buckets(await asyncio.to_thread(scrape, metrics_port), SCHEDULER_HISTOGRAM)
        window_sent = 0
        n = 0
        while (now := loop.time()) < start + options.seconds:
            due = start + n / options.rate
            if due > now:
                await asyncio.sleep(due - now)  # pacing the open-loop arrivals
                continue
            item = _request(n, rng)
            report.by_kind[item[0]] = report.by_kind.get(item[0], 0) + 1
            task = asyncio.create_task(one(item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
            window_sent += 1
            if loop.time() >= next_window:
                samples = await asyncio.to_thread(scrape, metrics_port)
                buckets = histogram_buckets(samples, SCHEDULER_HISTOGRAM)
                p99 = p99_between(last_buckets, buckets)
                last_buckets = buckets
                report.windows.append(
                    Window(
                        end_s=round(loop.time() - start, 1),
                        requests=window_sent,
                        p99_decision_ms=None if p99 is None else p99 * 1000,
                        rss_mib=round(rss_mib(picker_pid), 1),
                        index_size=int(sum_of(samples, INDEX_SIZE)),
                    )
                )
                window_sent = 0
                next_window += options.window_s
        report.sent = n
        if tasks:
            await asyncio.wait(tasks, timeout=90)


def _judge(options: SoakOptions, report: SoakReport) -> None:
    report.lost = report.sent - report.answered_as_expected
    if report.lost:
        report.failures.append(f"{report.lost} requests not answered as expected")
    warm = [w for w in report.windows if w.end_s > options.warmup_s] or report.windows
    if warm:
        report.rss_baseline_mib = warm[0].rss_mib
        if report.rss_growth >= options.max_rss_growth:
            report.failures.append(f"RSS grew {report.rss_growth * 100:.1f}% after warm-up")
        p99s = [w.p99_decision_ms for w in warm if w.p99_decision_ms is not None]
        # Stable: the late windows' p99 within one histogram bucket step (x2.5) of the early ones.
        if len(p99s) >= 2:
            half = len(p99s) // 2
            early, late = max(p99s[:half]), max(p99s[half:])
            if late > 2.5 * early:
                report.failures.append(f"p99 decision time drifted: early {early} ms, late {late} ms")
    report.index_capacity = options.pods * options.lru_capacity
    report.index_max = max((w.index_size for w in report.windows), default=0)
    if report.index_max > report.index_capacity:
        report.failures.append(f"prefix index held {report.index_max} entries, over its capacity")
    if report.streams_active_after or report.in_flight_after:
        report.failures.append("streams or in-flight counts left open after the run")


def run_soak(options: SoakOptions) -> SoakReport:
    """Start sim pods, the picker and Envoy; drive the load; stop everything; judge."""
    log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="picker-soak-"))
    report = SoakReport(seconds=options.seconds, rate=options.rate, pods=options.pods)
    started: list[ManagedProcess] = []
    try:
        sim, addresses = start_sim_pods(options.pods, log_dir)
        started.append(sim)
        picker, grpc_port, metrics_port = _start_picker(addresses, options.lru_capacity, log_dir)
        started.append(picker)
        listen = ("127.0.0.1", free_port())
        envoy = EnvoyProcess(
            "soak-envoy", picker_config("duplex", listen, ("127.0.0.1", grpc_port), ("127.0.0.1", free_port())), log_dir
        ).start()
        started.append(envoy)
        envoy.wait_ready(envoy.ready)
        asyncio.run(_drive(options, envoy.url, metrics_port, picker.pid, report))
        report.rss_final_mib = round(rss_mib(picker.pid), 1)

        def settled() -> bool:
            samples = scrape(metrics_port)
            report.streams_active_after = sum_of(samples, "picker_extproc_streams_active")
            report.in_flight_after = sum_of(samples, "picker_in_flight_requests")
            return not report.streams_active_after and not report.in_flight_after

        try:
            wait_until(settled, 10, "streams to close")
        except TimeoutError:
            pass  # reported as a failure by _judge
        if not picker.alive():
            report.failures.append("the picker exited during the soak")
    finally:
        for proc in reversed(started):
            proc.stop()
    _judge(options, report)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m picker_bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long to hold the load (default 10)")
    p.add_argument("--rate", type=float, default=25.0, help="requests per second (default 25)")
    p.add_argument("--pods", type=int, default=4, help="simulated pods (default 4)")
    p.add_argument("--window", type=float, default=30.0, help="sampling window in seconds (default 30)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before baselines (default: one window)")
    p.add_argument("--json", type=Path, help="also write the report here as JSON")
    p.add_argument("--log-dir", type=Path, help="where the processes' logs go (default: a temp dir)")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0 or args.pods < 1 or args.window <= 0:
        p.error("--minutes, --rate and --window must be positive and --pods at least 1")
    options = SoakOptions(
        seconds=args.minutes * 60,
        rate=args.rate,
        pods=args.pods,
        window_s=args.window,
        warmup_s=args.window if args.warmup is None else args.warmup,
        log_dir=args.log_dir,
    )
    report = run_soak(options)
    print(report.summary())
    if args.json:
        args.json.write_text(json.dumps({**asdict(report), "rss_growth": report.rss_growth}, indent=2))
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
