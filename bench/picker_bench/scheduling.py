"""Benchmark: scheduling time per decision with the default config (or `--config-file`).

    python -m picker_bench.scheduling [--endpoints 8,64,512] [--decisions 20000] [--config-file F]

Endpoints get random fresh metrics and in-flight counts; each decision is one
`Scheduler.schedule` call (producers, filters, scorers, picker, metrics), timed over a loop.
The per-plugin split comes from the plugin-duration histogram the scheduler fills anyway.
"""

from __future__ import annotations

import argparse
import random
import time

from picker.config.runtime import Runtime, RuntimeHolder
from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.framework.request import Api, InferenceRequest
from picker.requestcontrol.director import schedule
from picker.telemetry.metrics import PLUGIN_DURATION


def endpoints(count: int, rng: random.Random) -> list[EndpointState]:
    now = time.monotonic()
    return [
        EndpointState(
            Endpoint(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 8000, name=f"pod-{i}"),
            EndpointMetrics(
                waiting_queue_size=rng.randrange(8),
                running_requests_size=rng.randrange(32),
                kv_cache_usage=rng.random(),
                update_time=now,
            ),
            in_flight_requests=rng.randrange(8),
        )
        for i in range(count)
    ]


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


def measure(runtime: Runtime, count: int, decisions: int) -> tuple[float, float, dict[str, float]]:
    """Mean wall and CPU seconds per decision over `decisions` calls at `count` endpoints, and
    mean wall seconds per timed plugin call. CPU time is the figure to trust on a shared, loaded
    machine."""
    rng = random.Random(count)
    candidates = endpoints(count, rng)
    request = InferenceRequest(
        request_id="bench", api=Api.CHAT_COMPLETIONS, model="m", target_model="m", prompt_text="hello " * 200
    )
    for _ in range(min(1000, decisions)):
        schedule(runtime, request, candidates)
    before = plugin_totals()
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(decisions):
        schedule(runtime, request, candidates)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
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
    holder = RuntimeHolder()
    if args.config_file:
        holder.load_file(args.config_file)
    print(f"{'endpoints':>9}  {'wall µs':>8}  {'cpu µs':>8}  per plugin (wall µs)")
    for count in (int(c) for c in args.endpoints.split(",")):
        decisions = max(200, args.decisions * 8 // max(count, 8))
        wall, cpu, per_plugin = measure(holder.current, count, decisions)
        split = ", ".join(f"{name} {seconds * 1e6:.1f}" for name, seconds in sorted(per_plugin.items()))
        print(f"{count:>9}  {wall * 1e6:>8.1f}  {cpu * 1e6:>8.1f}  {split}")


if __name__ == "__main__":
    main()
