"""What the picker adds to a request through Envoy: latency at a fixed rate, and maximum rate.

`python -m picker_bench.overhead [--seconds S] [--rate R]` starts a fast backend, the picker and
Envoy (alone; with the picker in BUFFERED mode; with the picker in FULL_DUPLEX_STREAMED mode with
response phases, as the reference gateway runs), then for 2 KB and 64 KB bodies measures latency
at a fixed open-loop rate (Python client), latency one request at a time (wrk, one connection:
the steadiest figure of what the picker adds) and the saturation rate (wrk, 64 connections).

`--workers N` also runs a picker of N processes (`picker serve --workers N`) beside the one of a
single process, in the same run; its CPU is that of all its processes.

`--baseline-tree DIR` also runs the picker of another source tree (e.g. a `git worktree` of an
earlier commit) through the same two picker variants, in the same run, to compare a change.
`--picker-config LABEL=FILE` (repeatable) also runs a picker with that EndpointPickerConfig, named
`picker:LABEL`, the same way (e.g. the flowControl gate on and off). With `--one-process` those
configs take turns in one picker instead, swapped in by hot reload before each variant runs:
two pickers of one config differ by up to 30% in added latency here, which would hide a
difference of a few percent between configs.

`--reference-epp PATH` also runs the reference EPP v1.5.0 binary at PATH (`--enable-pprof=false`)
in FULL_DUPLEX_STREAMED mode with response phases, the only mode it answers, over a real
kube-apiserver + etcd (`picker_bench.reference_epp`).

`--endpoints N` gives the backend N ports, so every picker chooses among N endpoints.

`--repeat K` measures every variant K times, round after round (each round goes through all the
variants in turn, every other round in reverse order), and reports each figure's median over the
rounds: a difference of tens of µs between two variants is smaller than one short run's noise.

Every FULL_DUPLEX variant is also measured with streamed responses (`--stream-chunks`, 256 SSE
events per answer, one word each, written separately): at `--stream-rate` req/s, once with plain
answers and once streamed, the extra CPU of the picker divided by the extra ext_proc messages
Envoy sent (from its stats) is the CPU per passed-through response chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from picker_bench.cli import parse_picker_configs
from picker_bench.envoy import EnvoyProcess, baseline_config, picker_config
from picker_bench.process import ManagedProcess, free_port, health_serving, port_open, wait_until
from picker_bench.reference_epp import MAX_TARGET_PORTS, ReferenceEpp

BODY_SIZES = {"2KB": 2048, "64KB": 65536}
STREAMS_PER_CONNECTION = 4  # with --workers: 16 connections for wrk's 64, spread by the kernel


EXT_PROC_MESSAGES = "http.inference_gateway.ext_proc.stream_msgs_sent"  # gateway.yaml's stat prefix


def body_of(size: int, stream_chunks: int = 0) -> bytes:
    """A completions request of exactly `size` bytes; streamed with `stream_chunks` events if > 0."""
    head = b'{"model":"m","max_tokens":1,"prompt":"'
    if stream_chunks:
        head = b'{"model":"m","stream":true,"max_tokens":%d,"prompt":"' % stream_chunks
    tail = b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


@dataclass(frozen=True, slots=True)
class RateResult:
    p50_ms: float
    p99_ms: float
    errors: int


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def fixed_rate(url: str, body: bytes, rate: float, seconds: float) -> RateResult:
    """Open-loop arrivals at `rate`/s for `seconds`; latency of each request."""
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal errors
            start = time.perf_counter()
            try:
                async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        return
            except aiohttp.ClientError:
                errors += 1
                return
            latencies.append(time.perf_counter() - start)

        for _ in range(int(rate)):  # warm the connection pool
            await one()
        latencies.clear()
        tasks = []
        begin = time.perf_counter()
        for i in range(int(rate * seconds)):
            delay = begin + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    if not latencies:
        return RateResult(float("nan"), float("nan"), errors)
    return RateResult(1000 * _percentile(latencies, 0.5), 1000 * _percentile(latencies, 0.99), errors)


def _wrk(url: str, body_file: Path, seconds: float, connections: int) -> str:
    """wrk's report of `connections` connections POSTing `body_file` for `seconds` (whole
    seconds, at least one: wrk reads no fractions), with its latency distribution; raises on a
    non-2xx answer."""
    script = body_file.with_suffix(".lua")
    script.write_text(
        f'wrk.method = "POST"\nlocal f = io.open("{body_file}", "rb")\nwrk.body = f:read("*a")\nf:close()\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
    ).stdout
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    return out


def saturation(url: str, body_file: Path, seconds: int) -> tuple[float, int]:
    """Requests per second wrk reaches with 64 connections, and how many it sent."""
    out = _wrk(url, body_file, seconds, 64)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    sent = re.search(r"(\d+) requests in", out)
    return (float(rate.group(1)) if rate else float("nan")), (int(sent.group(1)) if sent else 0)


_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def one_at_a_time(url: str, body_file: Path, seconds: float) -> float:
    """The median latency in ms of requests sent one after another on one connection: the time
    a request spends in the path with nothing queued anywhere, measured by a native client (the
    open-loop Python client's own scheduling varies by more than a few tens of µs)."""
    out = _wrk(url, body_file, seconds, 1)
    median = re.search(r"^\s*50%\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE)
    return float(median.group(1)) * _WRK_UNITS[median.group(2)] if median else float("nan")


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (the state is [0], the ppid [1])."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores (Linux /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    tick = os.sysconf("SC_CLK_TCK")
    return (total - idle) / tick, total / tick


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process and its live descendants have used so far (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                continue  # gone meanwhile
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = _stat(current)
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        todo += children.get(current, [])
    return total


@dataclass(frozen=True, slots=True)
class ChunkCost:
    """What a passed-through response chunk costs: the extra CPU and ext_proc messages of
    streamed answers over plain ones, at the same rate."""

    messages_per_request: float  # extra ext_proc messages per streamed answer
    cpu_us_per_chunk: float
    errors: int


def chunk_cost(
    envoy: EnvoyProcess, url: str, pid: int, rate: float, seconds: float, size: int, chunks: int
) -> ChunkCost:
    """Plain answers, then answers streamed in `chunks` SSE events, at `rate` for `seconds` each."""
    per_request: list[tuple[float, float]] = []  # (CPU s, Envoy→picker messages) per request
    errors = 0
    for body in (body_of(size), body_of(size, chunks)):
        asyncio.run(fixed_rate(url, body, rate, 1.0))  # warm-up
        cpu, messages = cpu_seconds(pid), envoy.stat(EXT_PROC_MESSAGES)
        result = asyncio.run(fixed_rate(url, body, rate, seconds))
        requests = int(rate * seconds)
        per_request.append(((cpu_seconds(pid) - cpu) / requests, (envoy.stat(EXT_PROC_MESSAGES) - messages) / requests))
        errors += result.errors
    (plain_cpu, plain_messages), (streamed_cpu, streamed_messages) = per_request
    extra = streamed_messages - plain_messages
    return ChunkCost(extra, (streamed_cpu - plain_cpu) / max(extra, 1e-9) * 1e6, errors)


def measure_sizes(
    url: str, pid: int | None, rate: float, seconds: float, saturation_seconds: int, work: Path
) -> dict[str, dict[str, float]]:
    """For each body size: latency at `rate` req/s, then the rate wrk reaches, the CPU per request
    of the process `pid` (the picker; None: none) at that rate and how busy the machine was."""
    figures: dict[str, dict[str, float]] = {}
    for label, size in BODY_SIZES.items():
        body = body_of(size)
        body_file = work / f"body-{label}.json"
        body_file.write_bytes(body)
        fixed = asyncio.run(fixed_rate(url, body, rate, seconds))
        serial_ms = one_at_a_time(url, body_file, seconds)
        cpu_before = cpu_seconds(pid) if pid is not None else 0.0
        busy_before, total_before = machine_cpu()
        sat, sent = saturation(url, body_file, saturation_seconds)
        # The picker's own CPU per request at saturation: steadier than rates on a shared box.
        cpu_us = (cpu_seconds(pid) - cpu_before) / max(sent, 1) * 1e6 if pid is not None else 0.0
        # How busy the whole machine was meanwhile: near 100%, no variant can go faster here.
        busy_after, total_after = machine_cpu()
        busy = (busy_after - busy_before) / max(total_after - total_before, 1e-9)
        figures[label] = {
            "serial_p50_ms": serial_ms,
            "p50_ms": fixed.p50_ms,
            "p99_ms": fixed.p99_ms,
            "errors": fixed.errors,
            "max_rps": sat,
            "picker_cpu_us": cpu_us,
            "machine_busy": busy,
        }
    return figures


def with_added_latency(results: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """`results` (one round) with each variant's latency above Envoy alone's in the same round."""
    base = results["envoy alone"]
    for by_size in results.values():
        for label, figures in by_size.items():
            figures["added_serial_p50_ms"] = figures["serial_p50_ms"] - base[label]["serial_p50_ms"]
            figures["added_p50_ms"] = figures["p50_ms"] - base[label]["p50_ms"]
            figures["added_p99_ms"] = figures["p99_ms"] - base[label]["p99_ms"]
    return results


def median_over(rounds: list[dict[str, dict[str, dict[str, float]]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Each figure's median over the rounds (every round measures the same variants and sizes)."""
    first = rounds[0]
    return {
        name: {
            label: {key: statistics.median(r[name][label][key] for r in rounds) for key in figures}
            for label, figures in by_size.items()
        }
        for name, by_size in first.items()
    }


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that makes `python -m picker...` import `tree`'s sources. PYTHONPATH alone
    is not enough: `-m` puts the working directory (this checkout) ahead of it on sys.path, so a
    baseline started from here ran this checkout's code; PYTHONSAFEPATH (Python 3.11) leaves it out."""
    return {**os.environ, "PYTHONPATH": str(tree.resolve()), "PYTHONSAFEPATH": "1"}


class StartedPicker(NamedTuple):
    process: ManagedProcess
    grpc_port: int
    metrics_port: int
    seconds_to_serving: float


def start_picker(
    label: str,
    tree: Path | None,
    backend_ports: list[int],
    tls: str,
    work: Path,
    processes: list[ManagedProcess],
    workers: int = 1,
    config: Path | None = None,
) -> StartedPicker:
    """Start a picker (from `tree`'s sources when given, with `config` when given) of `workers`
    processes in front of the backend."""
    grpc_port, health, metrics = free_port(), free_port(), free_port()
    env = None if tree is None else tree_env(tree)
    endpoints = ",".join(f"127.0.0.1:{port}" for port in backend_ports)
    argv = [sys.executable, "-m", "picker.cli", "serve", "--endpoints", endpoints]
    argv += ["--bind-address", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", str(health)]
    argv += ["--metrics-port", str(metrics), f"--secure-serving={tls}", "--workers", str(workers)]
    if config is not None:
        argv += ["--config-file", str(config)]
    started = time.monotonic()
    picker = ManagedProcess(label, argv, work, env=env).start()
    processes.append(picker)
    # With workers, the health port answers SERVING only once all of them serve.
    picker.wait_ready(lambda: health_serving("127.0.0.1", health) and port_open("127.0.0.1", grpc_port), timeout=60)
    return StartedPicker(picker, grpc_port, metrics, time.monotonic() - started)


def swap_config(path: Path, text: str, metrics_port: int) -> None:
    """Write `text` to the config file a picker watches and wait until that config is in force."""
    staged = path.with_suffix(".new")
    staged.write_text(text)
    os.replace(staged, path)  # the watcher never reads half a file
    wanted = sha256(text.encode()).hexdigest()

    def in_force() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/config", timeout=5) as response:
            return bool(json.loads(response.read())["sha256"] == wanted)

    wait_until(in_force, 10, f"the config of {path} to be in force")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker_bench.overhead")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each fixed-rate run")
    parser.add_argument("--rate", type=float, default=200.0, help="fixed open-loop rate, req/s")
    parser.add_argument("--saturation-seconds", type=int, default=8)
    parser.add_argument("--tls", default="true", choices=["true", "false"], help="TLS between Envoy and picker")
    parser.add_argument("--baseline-tree", type=Path, help="also run the picker of this source tree, side by side")
    parser.add_argument(
        "--workers", type=int, default=1, help="also run a picker of this many processes, side by side (N > 1)"
    )
    parser.add_argument(
        "--picker-config",
        action="append",
        default=[],
        metavar="LABEL=FILE",
        help="also run a picker with this EndpointPickerConfig, as picker:LABEL; repeatable",
    )
    parser.add_argument(
        "--reference-epp", type=Path, help="also run the reference EPP binary at this path (duplex), side by side"
    )
    parser.add_argument("--endpoints", type=int, default=1, help="backend ports = endpoints to choose among")
    parser.add_argument("--stream-chunks", type=int, default=256, help="SSE events per streamed answer; 0: skip")
    parser.add_argument("--stream-rate", type=float, default=20.0, help="req/s of the streamed-response runs")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over all variants; figures are medians")
    parser.add_argument(
        "--one-process", action="store_true", help="the --picker-config configs take turns in one picker (hot reload)"
    )
    args = parser.parse_args(argv)
    try:
        configs = parse_picker_configs(args.picker_config)
    except ValueError as e:
        parser.error(str(e))
    if "" in configs:
        parser.error("--picker-config needs a label: LABEL=FILE")
    if shutil.which("wrk") is None:
        print("wrk is required for the saturation runs: apt-get install wrk", file=sys.stderr)
        return 2
    if args.endpoints < 1 or args.stream_chunks < 0 or args.stream_rate <= 0 or args.repeat < 1:
        parser.error("--endpoints and --repeat must be at least 1, --stream-chunks at least 0, --stream-rate positive")
    if args.reference_epp is not None and not os.access(args.reference_epp, os.X_OK):
        parser.error(f"--reference-epp {args.reference_epp}: not an executable file")
    if args.reference_epp is not None and args.endpoints > MAX_TARGET_PORTS:
        parser.error(f"--reference-epp takes at most {MAX_TARGET_PORTS} --endpoints (an InferencePool's limit)")
    tls = args.tls == "true"
    work = Path(tempfile.mkdtemp(prefix="picker-overhead-"))
    processes: list[ManagedProcess] = []
    reference: ReferenceEpp | None = None
    try:
        backend_ports = [free_port() for _ in range(args.endpoints)]
        backend = ManagedProcess(
            "backend",
            [sys.executable, "-m", "picker_bench.backend", "127.0.0.1", *map(str, backend_ports)],
            work,
        ).start()
        processes.append(backend)
        backend.wait_ready(lambda: all(port_open("127.0.0.1", port) for port in backend_ports))
        # name → (Envoy config, the PID of the picker it calls if any, what to do first if anything)
        variants: dict[str, tuple[dict[str, Any], int | None, Callable[[], None] | None]] = {
            "envoy alone": (
                baseline_config(
                    "round-robin",
                    ("127.0.0.1", free_port()),
                    [f"127.0.0.1:{port}" for port in backend_ports],
                    ("127.0.0.1", free_port()),
                ),
                None,
                None,
            ),
        }
        # label → (source tree, processes, config); None: this tree, the default config
        trees: dict[str, tuple[Path | None, int, Path | None]] = {"picker": (None, 1, None)}
        if args.workers > 1:
            trees[f"picker x{args.workers}"] = (None, args.workers, None)
        if args.baseline_tree is not None:
            trees["baseline"] = (args.baseline_tree, 1, None)
        swapped = work / "swapped-config.yaml"  # --one-process: the file the configs take turns in
        if args.one_process and configs:
            swapped.write_text(next(iter(configs.values())).read_text())
            trees["picker:swapped"] = (None, 1, swapped)
        else:
            trees.update({f"picker:{label}": (None, 1, config) for label, config in configs.items()})
        pickers = {
            label: start_picker(
                label.replace(" ", "-").replace(":", "-"),
                tree,
                backend_ports,
                args.tls,
                work,
                processes,
                workers,
                config,
            )
            for label, (tree, workers, config) in trees.items()
        }
        # Start to SERVING (polled every 20 ms or so), one start each on a shared machine.
        startup = {label: picker.seconds_to_serving for label, picker in pickers.items()}
        if args.reference_epp is not None:
            reference = ReferenceEpp(args.reference_epp, ["127.0.0.1"], backend_ports, tls, work)
            reference.start()
            startup["reference EPP"] = reference.startup_seconds
        for label, seconds in startup.items():
            print(f"{label:32} start to SERVING {seconds:.2f} s", flush=True)
        # Several connections for the workers to share; the same Envoy config for every picker.
        streams_per_connection = STREAMS_PER_CONNECTION if args.workers > 1 else None
        # Interleaved by mode, so a change and its baseline meet the machine in the same state.
        for mode, name in (("buffered", "BUFFERED"), ("duplex", "FULL_DUPLEX + response")):
            for label, picker in pickers.items():
                # the picker's own config, or (--one-process) each of the configs in turn
                turns = (
                    {f"picker:{c}": path.read_text() for c, path in configs.items()}
                    if label == "picker:swapped"
                    else {label: None}
                )
                for turn, text in turns.items():
                    config = picker_config(
                        mode,
                        ("127.0.0.1", free_port()),
                        ("127.0.0.1", picker.grpc_port),
                        ("127.0.0.1", free_port()),
                        tls=tls,
                        streams_per_connection=streams_per_connection,
                    )
                    swap = None if text is None else functools.partial(swap_config, swapped, text, picker.metrics_port)
                    variants[f"{turn} {name}"] = (config, picker.process.pid, swap)
        if reference is not None:  # it answers only FULL_DUPLEX_STREAMED
            config = picker_config(
                "duplex",
                ("127.0.0.1", free_port()),
                ("127.0.0.1", reference.grpc_port),
                ("127.0.0.1", free_port()),
                tls=tls,
            )
            variants["reference EPP FULL_DUPLEX + response"] = (config, reference.pid, None)
        rounds: list[dict[str, dict[str, dict[str, float]]]] = []
        chunk_costs: dict[str, ChunkCost] = {}
        for round_number in range(1, args.repeat + 1):
            results: dict[str, dict[str, dict[str, float]]] = {}
            # Every other round in reverse, so no variant always runs after the others.
            order = list(variants.items()) if round_number % 2 else list(reversed(variants.items()))
            for name, (config, pid, first) in order:
                if first is not None:
                    first()
                envoy = EnvoyProcess(name.replace(" ", "-").replace("+", ""), config, work).start()
                processes.append(envoy)
                envoy.wait_ready(envoy.ready)
                url = envoy.url + "/v1/completions"
                results[name] = measure_sizes(url, pid, args.rate, args.seconds, args.saturation_seconds, work)
                for label, r in results[name].items():
                    print(
                        f"{round_number}/{args.repeat} {name:32} {label:5} one at a time {r['serial_p50_ms']:6.3f} ms  "
                        f"p50 {r['p50_ms']:6.2f} ms  "
                        f"p99 {r['p99_ms']:6.2f} ms  errors {r['errors']:.0f}  max {r['max_rps']:7.0f} req/s  "
                        f"picker CPU {r['picker_cpu_us']:6.0f} µs/req  machine {r['machine_busy']:4.0%} busy",
                        flush=True,
                    )
                if round_number == 1 and pid is not None and "FULL_DUPLEX" in name and args.stream_chunks:
                    cost = chunk_cost(
                        envoy, url, pid, args.stream_rate, args.seconds, BODY_SIZES["2KB"], args.stream_chunks
                    )
                    chunk_costs[name] = cost
                    print(
                        f"{name:32} streamed {args.stream_chunks} events: +{cost.messages_per_request:.0f} ext_proc "
                        f"messages per answer, {cost.cpu_us_per_chunk:.1f} µs CPU per chunk, errors {cost.errors}",
                        flush=True,
                    )
                envoy.stop()
            rounds.append(with_added_latency(results))
        results = median_over(rounds)
        print(
            "\n| variant | body | one at a time p50 ms | added | p50 ms | p99 ms | added p50 ms | added p99 ms "
            "| max req/s | picker CPU µs/req | machine busy at max |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, by_size in results.items():
            for label, r in by_size.items():
                print(
                    f"| {name} | {label} | {r['serial_p50_ms']:.3f} | {r['added_serial_p50_ms']:.3f} | "
                    f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                    f"{r['added_p50_ms']:.2f} | {r['added_p99_ms']:.2f} | "
                    f"{r['max_rps']:.0f} | {r['picker_cpu_us']:.0f} | {r['machine_busy']:.0%} |"
                )
        if chunk_costs:
            print(f"\nStreamed answers: {args.stream_chunks} SSE events, 2 KB requests, {args.stream_rate:g} req/s")
            print("| variant | extra ext_proc messages per answer | CPU µs per passed-through chunk |")
            print("|---|---|---|")
            for name, cost in chunk_costs.items():
                print(f"| {name} | {cost.messages_per_request:.0f} | {cost.cpu_us_per_chunk:.1f} |")
        summary = {
            "variants": results,
            "rounds": rounds,
            "chunk_cost": {name: asdict(cost) for name, cost in chunk_costs.items()},
            "start_to_serving_seconds": startup,
        }
        (work / "results.json").write_text(json.dumps(summary, indent=2))
        print(f"\nresults: {work / 'results.json'}")
    finally:
        for proc in reversed(processes):
            proc.stop()
        if reference is not None:
            reference.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
