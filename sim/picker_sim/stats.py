"""Per-engine counters and histograms, rendered as a vLLM-style Prometheus page.

Written by hand (no prometheus_client registry) so a scrape costs a few string joins.
Names, label shapes and histogram buckets follow vLLM v1 (`vllm/v1/metrics/loggers.py`).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from picker_sim.engine import Engine, Request

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# vLLM's NixlPromMetrics: transfer seconds, and bytes per transfer from 2 KiB to 8 GiB.
KV_TRANSFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
KV_TRANSFER_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Histogram:
    """A cumulative-on-render histogram: one bisect per observation."""

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> Iterable[str]:
        running = 0
        for bound, n in zip(self.buckets, self.counts[:-1], strict=True):
            running += n
            yield f'{name}_bucket{{{labels},le="{float(bound)}"}} {running}'
        yield f'{name}_bucket{{{labels},le="+Inf"}} {self.count}'
        yield f"{name}_sum{{{labels}}} {self.sum}"
        yield f"{name}_count{{{labels}}} {self.count}"


class EngineStats:
    """Everything the /metrics page reports that is not derived from live engine state."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        # Where finished requests' prompt tokens came from: computed here, this engine's prefix
        # cache, or a remote prefill's KV transfer.
        self.prompt_by_source: dict[str, int] = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0
        self.external_queries = 0  # prompt tokens of requests with a remote prefill
        self.external_hits = 0  # prompt tokens received from a remote engine
        self.failed_transfers = 0  # remote prefills whose blocks could not be fetched
        self.kv_expired_reqs = 0  # pinned blocks no consumer took in time (producer side)
        self.kv_transfer_time = Histogram(KV_TRANSFER_TIME_BUCKETS)
        self.kv_bytes_transferred = Histogram(KV_TRANSFER_BYTES_BUCKETS)
        self.success: dict[str, int] = {"length": 0, "stop": 0, "abort": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_hist = Histogram(TOKEN_BUCKETS)
        self.generation_hist = Histogram(TOKEN_BUCKETS)

    def record_finished(self, req: Request, now: float) -> None:
        self.success[req.finish_reason or "stop"] = self.success.get(req.finish_reason or "stop", 0) + 1
        self.prompt_tokens += req.prompt_len
        cached = max(req.num_cached, 0)
        external = min(req.num_external, cached)
        by_source = self.prompt_by_source
        by_source["local_compute"] += req.prompt_len - cached
        by_source["local_cache_hit"] += cached - external
        by_source["external_kv_transfer"] += external
        self.generation_tokens += req.num_output
        self.e2e.observe(now - req.arrival)
        self.inference_time.observe(now - req.scheduled_at)
        self.decode_time.observe(now - req.first_token_at)
        self.prompt_hist.observe(req.prompt_len)
        self.generation_hist.observe(req.num_output)


def render_metrics(engine: Engine, model: str) -> str:
    """The pod's /metrics page in Prometheus text format."""
    cfg = engine.config
    s = engine.stats
    lab = f'engine="0",model_name="{model}"'
    out: list[str] = []

    def gauge(name: str, help_: str, value: float, labels: str = lab) -> None:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} gauge\n{name}{{{labels}}} {value}")

    def counter(name: str, help_: str, value: float) -> None:
        out.append(f"# HELP {name}_total {help_}\n# TYPE {name}_total counter\n{name}_total{{{lab}}} {value}")

    def histogram(name: str, help_: str, h: Histogram) -> None:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} histogram\n" + "\n".join(h.lines(name, lab)))

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(engine.running))
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(engine.waiting))
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.cache.usage)
    cache_labels = (
        f'block_size="{cfg.block_size}",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
        f'gpu_memory_utilization="0.9",num_cpu_blocks="0",num_gpu_blocks="{cfg.num_gpu_blocks}",'
        f'prefix_caching_hash_algo="xxhash"'
    )
    gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1.0, cache_labels)
    lora_max = cfg.max_loras
    if lora_max > 0:
        running = ",".join(sorted({r.lora for r in engine.running if r.lora}))
        waiting = ",".join(sorted({r.lora for r in engine.waiting if r.lora}))
        lora_labels = f'max_lora="{lora_max}",running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"'
        gauge("vllm:lora_requests_info", "Running stats on lora requests.", time.time(), lora_labels)
    counter(
        "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", s.prefix_queries
    )
    counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_hits)
    counter(
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, "
        "in terms of number of queried tokens.",
        s.external_queries,
    )
    counter(
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, "
        "in terms of number of cached tokens.",
        s.external_hits,
    )
    counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.", s.failed_transfers)
    counter("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire.", s.kv_expired_reqs)
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
    counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
    counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local prefix cache and KV connector).",
        s.prompt_by_source["local_cache_hit"] + s.prompt_by_source["external_kv_transfer"],
    )
    by_source = "\n".join(
        f'vllm:prompt_tokens_by_source_total{{{lab},source="{source}"}} {n}'
        for source, n in sorted(s.prompt_by_source.items())
    )
    out.append(
        "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.\n"
        f"# TYPE vllm:prompt_tokens_by_source_total counter\n{by_source}"
    )
    success = "\n".join(
        f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {n}' for reason, n in sorted(s.success.items())
    )
    out.append(
        "# HELP vllm:request_success_total Count of successfully processed requests.\n"
        f"# TYPE vllm:request_success_total counter\n{success}"
    )
    histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", s.ttft)
    histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", s.itl)
    histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", s.e2e)
    histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", s.queue_time)
    histogram(
        "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", s.prefill_time
    )
    histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", s.decode_time)
    histogram(
        "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", s.inference_time
    )
    histogram(
        "vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", s.kv_transfer_time
    )
    histogram(
        "vllm:nixl_bytes_transferred",
        "Histogram of bytes transferred per NIXL KV Cache transfers.",
        s.kv_bytes_transferred,
    )
    histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", s.prompt_hist)
    histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", s.generation_hist)
    return "\n".join(out) + "\n"
