"""What the picker adds to a request through Envoy: latency at a fixed rate, and maximum rate.

`python -m picker.bench.overhead [--seconds S] [--rate R]` starts a fast backend, the picker and
Envoy (alone; with the picker in BUFFERED mode; with the picker in FULL_DUPLEX_STREAMED mode with
response phases, as the reference gateway runs), then for 2 KB and 64 KB bodies measures latency
at a fixed open-loop rate (Python client) and the saturation rate (wrk, 64 connections).

`--workers N` also runs a picker of N processes (`picker serve --workers N`) beside the one of a
single process, in the same run; its CPU is that of all its processes.

`--baseline-tree DIR` also runs the picker of another source tree (e.g. a `git worktree` of an
earlier commit) through the same two picker variants, in the same run, to compare a change.
`--picker-config LABEL=FILE` (repeatable) also runs a picker with that EndpointPickerConfig, named
`picker:LABEL`, the same way (e.g. the flowControl gate on and off).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from picker.bench.cli import parse_picker_configs
from picker.bench.envoy import EnvoyProcess, baseline_config, picker_config
from picker.bench.process import ManagedProcess, free_port, health_serving, port_open

BODY_SIZES = {"2KB": 2048, "64KB": 65536}
STREAMS_PER_CONNECTION = 4  # with --workers: 16 connections for wrk's 64, spread by the kernel


def body_of(size: int) -> bytes:
    """A completions request of exactly `size` bytes."""
    head, tail = b'{"model":"m","max_tokens":1,"prompt":"', b'"}'
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


def saturation(url: str, body_file: Path, seconds: int) -> tuple[float, int]:
    """Requests per second wrk reaches with 64 connections, and how many it sent (non-2xx
    counted as failures)."""
    script = body_file.with_suffix(".lua")
    script.write_text(
        f'wrk.method = "POST"\nlocal f = io.open("{body_file}", "rb")\nwrk.body = f:read("*a")\nf:close()\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    out = subprocess.run(
        ["wrk", "-t1", "-c64", f"-d{seconds}s", "-s", str(script), url],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
    ).stdout
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    sent = re.search(r"(\d+) requests in", out)
    return (float(rate.group(1)) if rate else float("nan")), (int(sent.group(1)) if sent else 0)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (the state is [0], the ppid [1])."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


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


def start_picker(
    label: str,
    tree: Path | None,
    backend_port: int,
    tls: str,
    work: Path,
    processes: list[ManagedProcess],
    workers: int = 1,
    config: Path | None = None,
) -> tuple[ManagedProcess, int]:
    """Start a picker (from `tree`'s sources when given, with `config` when given) of `workers`
    processes in front of the backend; it and its gRPC port."""
    grpc_port, health, metrics = free_port(), free_port(), free_port()
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree.resolve())}
    argv = [sys.executable, "-m", "picker.cli", "serve", "--endpoints", f"127.0.0.1:{backend_port}"]
    argv += ["--bind-address", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", str(health)]
    argv += ["--metrics-port", str(metrics), f"--secure-serving={tls}", "--workers", str(workers)]
    if config is not None:
        argv += ["--config-file", str(config)]
    picker = ManagedProcess(label, argv, work, env=env).start()
    processes.append(picker)
    # With workers, the health port answers SERVING only once all of them serve.
    picker.wait_ready(lambda: health_serving("127.0.0.1", health) and port_open("127.0.0.1", grpc_port), timeout=60)
    return picker, grpc_port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker.bench.overhead")
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
    tls = args.tls == "true"
    work = Path(tempfile.mkdtemp(prefix="picker-overhead-"))
    processes: list[ManagedProcess] = []
    try:
        backend_port = free_port()
        backend = ManagedProcess(
            "backend", [sys.executable, "-m", "picker.bench.backend", "127.0.0.1", str(backend_port)], work
        ).start()
        processes.append(backend)
        backend.wait_ready(lambda: port_open("127.0.0.1", backend_port))
        # name → (Envoy config, the picker it calls, if any)
        variants: dict[str, tuple[dict[str, Any], ManagedProcess | None]] = {
            "envoy alone": (
                baseline_config(
                    "round-robin", ("127.0.0.1", free_port()), [f"127.0.0.1:{backend_port}"], ("127.0.0.1", free_port())
                ),
                None,
            ),
        }
        # label → (source tree, processes, config); None: this tree, the default config
        trees: dict[str, tuple[Path | None, int, Path | None]] = {"picker": (None, 1, None)}
        if args.workers > 1:
            trees[f"picker x{args.workers}"] = (None, args.workers, None)
        if args.baseline_tree is not None:
            trees["baseline"] = (args.baseline_tree, 1, None)
        trees.update({f"picker:{label}": (None, 1, config) for label, config in configs.items()})
        pickers = {
            label: start_picker(
                label.replace(" ", "-").replace(":", "-"),
                tree,
                backend_port,
                args.tls,
                work,
                processes,
                workers,
                config,
            )
            for label, (tree, workers, config) in trees.items()
        }
        # Several connections for the workers to share; the same Envoy config for every picker.
        streams_per_connection = STREAMS_PER_CONNECTION if args.workers > 1 else None
        # Interleaved by mode, so a change and its baseline meet the machine in the same state.
        for mode, name in (("buffered", "BUFFERED"), ("duplex", "FULL_DUPLEX + response")):
            for label, (picker, grpc_port) in pickers.items():
                config = picker_config(
                    mode,
                    ("127.0.0.1", free_port()),
                    ("127.0.0.1", grpc_port),
                    ("127.0.0.1", free_port()),
                    tls=tls,
                    streams_per_connection=streams_per_connection,
                )
                variants[f"{label} {name}"] = (config, picker)
        results: dict[str, dict[str, dict[str, float]]] = {}
        for name, (config, process) in variants.items():
            envoy = EnvoyProcess(name.replace(" ", "-").replace("+", ""), config, work).start()
            processes.append(envoy)
            envoy.wait_ready(envoy.ready)
            url = envoy.url + "/v1/completions"
            for label, size in BODY_SIZES.items():
                body = body_of(size)
                body_file = work / f"body-{label}.json"
                body_file.write_bytes(body)
                rate = asyncio.run(fixed_rate(url, body, args.rate, args.seconds))
                cpu_before = cpu_seconds(process.pid) if process is not None else 0.0
                sat, sent = saturation(url, body_file, args.saturation_seconds)
                # The picker's own CPU per request at saturation: steadier than rates on a shared box.
                cpu_us = (cpu_seconds(process.pid) - cpu_before) / max(sent, 1) * 1e6 if process is not None else 0.0
                results.setdefault(name, {})[label] = {
                    "p50_ms": rate.p50_ms,
                    "p99_ms": rate.p99_ms,
                    "errors": rate.errors,
                    "max_rps": sat,
                    "picker_cpu_us": cpu_us,
                }
                print(
                    f"{name:32} {label:5} p50 {rate.p50_ms:6.2f} ms  p99 {rate.p99_ms:6.2f} ms  "
                    f"errors {rate.errors}  max {sat:7.0f} req/s  picker CPU {cpu_us:6.0f} µs/req",
                    flush=True,
                )
            envoy.stop()
        base = results["envoy alone"]
        print("\n| variant | body | p50 ms | p99 ms | added p50 ms | added p99 ms | max req/s | picker CPU µs/req |")
        print("|---|---|---|---|---|---|---|---|")
        for name, by_size in results.items():
            for label, r in by_size.items():
                print(
                    f"| {name} | {label} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                    f"{r['p50_ms'] - base[label]['p50_ms']:.2f} | {r['p99_ms'] - base[label]['p99_ms']:.2f} | "
                    f"{r['max_rps']:.0f} | {r['picker_cpu_us']:.0f} |"
                )
        (work / "results.json").write_text(json.dumps(results, indent=2))
        print(f"\nresults: {work / 'results.json'}")
    finally:
        for proc in reversed(processes):
            proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
