"""Benchmark: scheduling time per decision with the default config (or `--config-file`).

    python -m picker_bench.scheduling [--endpoints 8,64,512] [--decisions 20000] [--config-file F]

Endpoints get random fresh metrics and in-flight counts; each decision is one request routed
by the director as the ext_proc server routes it (parse, admission, data producers, admitters,
the scheduler's filters, scorers and picker, pre-request hooks, metrics) and then finished with
no response seen, timed over a loop. The per-plugin split comes from the plugin-duration
histogram the director and the scheduler fill anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import orjson

from picker.config.runtime import RuntimeHolder
from picker.datastore.endpoint import Endpoint, EndpointMetrics
from picker.datastore.store import Datastore
from picker.requestcontrol.director import Director
from picker.telemetry.metrics import PLUGIN_DURATION

HEADERS = {":path": "/v1/chat/completions", "x-request-id": "bench"}
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 200}]})


def pool(count: int, rng: random.Random) -> Datastore:
    """`count` endpoints with random fresh metrics and in-flight counts."""
    datastore = Datastore()
    datastore.set_endpoints(
        Endpoint(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 8000, name=f"pod-{i}") for i in range(count)
    )
    now = time.monotonic()
    for address in datastore.endpoints():
        metrics = EndpointMetrics(
            waiting_queue_size=rng.randrange(8),
            running_requests_size=rng.randrange(32),
            kv_cache_usage=rng.random(),
            update_time=now,
        )
        datastore.set_metrics(address, metrics)
        for _ in range(rng.randrange(8)):
            datastore.acquire(address, 0)
    return datastore


def plugin_totals() -> dict[str, tuple[float, float]]:
    """(seconds, timed calls) observed so far per `extension_point/plugin_name`."""
    totals: dict[str, list[float]] = {}
    for family in PLUGIN_DURATION.collect():
        for sample in family.samples:
            key = f"{sample.labels['extension_point']}/{sample.labels['plugin_name']}"
            if sample.name.endswith("_sum"):
                totals.setdefault(key, [0.0, 0.0])[0] = sample.value
            elif sample.name.endswith("_count"):
                totals.setdefault(key, [0.0, 0.0])[1] = sample.value
    return {key: (seconds, calls) for key, (seconds, calls) in totals.items()}


async def route(director: Director, warmup: int, decisions: int) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """Route `warmup`, then `decisions` requests one after another, each finished at once: the
    wall and CPU seconds the decisions took, and the plugin totals before them."""
    for _ in range(warmup):
        (await director.route(BODY, HEADERS, None)).finish()
    before = plugin_totals()
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(decisions):
        (await director.route(BODY, HEADERS, None)).finish()
    return time.perf_counter() - started, time.process_time() - cpu_started, before


def measure(config_file: str | None, count: int, decisions: int) -> tuple[float, float, dict[str, float]]:
    """Mean wall and CPU seconds per decision over `decisions` routed requests at `count`
    endpoints, and mean wall seconds per timed plugin call. CPU time is the figure to trust on a
    shared, loaded machine."""
    datastore = pool(count, random.Random(count))
    holder = RuntimeHolder(datastore)
    if config_file:
        holder.load_file(config_file)
    elapsed, cpu, before = asyncio.run(route(Director(datastore, holder), min(1000, decisions), decisions))
    after = plugin_totals()
    per_plugin = {}
    for key, (seconds, calls) in after.items():
        seconds_before, calls_before = before.get(key, (0.0, 0.0))
        if calls > calls_before:  # one decision in PLUGIN_TIMING_SAMPLE is timed per plugin
            per_plugin[key] = (seconds - seconds_before) / (calls - calls_before)
    return elapsed / decisions, cpu / decisions, per_plugin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", default="8,64,512", help="comma-separated endpoint counts")
    parser.add_argument("--decisions", type=int, default=20000, help="decisions at 8 endpoints (fewer above)")
    parser.add_argument("--config-file", help="EndpointPickerConfig to measure instead of the default")
    args = parser.parse_args()
    print(f"{'endpoints':>9}  {'wall µs':>8}  {'cpu µs':>8}  per plugin (wall µs)")
    for count in (int(c) for c in args.endpoints.split(",")):
        decisions = max(200, args.decisions * 8 // max(count, 8))
        wall, cpu, per_plugin = measure(args.config_file, count, decisions)
        split = ", ".join(f"{name} {seconds * 1e6:.1f}" for name, seconds in sorted(per_plugin.items()))
        print(f"{count:>9}  {wall * 1e6:>8.1f}  {cpu * 1e6:>8.1f}  {split}")


if __name__ == "__main__":
    main()
