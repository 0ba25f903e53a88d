"""Realistic /metrics pages of vLLM, SGLang and TensorRT-LLM, for tests and the benchmark.

The vLLM page mirrors what a v0.10-era server exports (process and Python collectors, counters,
about ten histograms): roughly 300 lines and 30 KB, most of which the scanner must skip.
"""

from __future__ import annotations

# The engines' latency histograms use the buckets of vLLM's TTFT histogram, as the simulator's.
from picker_sim.stats import TTFT_BUCKETS

_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_REQUEST_SECONDS_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


def _histogram(name: str, doc: str, labels: str, buckets: tuple[float, ...], total: int, mean: float) -> list[str]:
    lines = [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
    cumulative = 0
    for i, bound in enumerate(buckets):
        cumulative = min(total, cumulative + total // (len(buckets) - i + 1))
        lines.append(f'{name}_bucket{{{labels},le="{float(bound)}"}} {float(cumulative)}')
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(total)}')
    lines.append(f"{name}_count{{{labels}}} {float(total)}")
    lines.append(f"{name}_sum{{{labels}}} {total * mean}")
    return lines


def _gauge(name: str, doc: str, series: list[tuple[str, object]], kind: str = "gauge") -> list[str]:
    lines = [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
    for labels, value in series:
        lines.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")
    return lines


def vllm_page(
    *,
    waiting: float = 3,
    running: float = 12,
    kv_usage: float = 0.42,
    running_adapters: str = "sql-lora,chat-lora",
    waiting_adapters: str = "",
    max_lora: int = 4,
    block_size: int = 16,
    num_gpu_blocks: int = 27_000,
    model: str = "meta-llama/Llama-3.1-8B-Instruct",
    legacy_kv_name: bool = False,
) -> bytes:
    """A vLLM /metrics page; `legacy_kv_name` uses `vllm:gpu_cache_usage_perc` (vLLM < 1.3)."""
    m = f'engine="0",model_name="{model}"'
    lines: list[str] = []
    lines += _gauge(
        "python_gc_objects_collected_total",
        "Objects collected during gc",
        [('generation="0"', 18225.0), ('generation="1"', 3497.0), ('generation="2"', 1139.0)],
        "counter",
    )
    lines += _gauge(
        "python_gc_objects_uncollectable_total",
        "Uncollectable objects found during GC",
        [(f'generation="{g}"', 0.0) for g in range(3)],
        "counter",
    )
    lines += _gauge(
        "python_gc_collections_total",
        "Number of times this generation was collected",
        [('generation="0"', 1408.0), ('generation="1"', 127.0), ('generation="2"', 9.0)],
        "counter",
    )
    lines += _gauge(
        "python_info",
        "Python platform information",
        [('implementation="CPython",major="3",minor="12",patchlevel="11",version="3.12.11"', 1.0)],
    )
    for name, doc, value in (
        ("process_virtual_memory_bytes", "Virtual memory size in bytes.", 5.1458912256e10),
        ("process_resident_memory_bytes", "Resident memory size in bytes.", 3.318562816e09),
        ("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", 1.76450213562e09),
        ("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", 2412.53),
        ("process_open_fds", "Number of open file descriptors.", 93.0),
        ("process_max_fds", "Maximum number of open file descriptors.", 1.048576e06),
    ):
        lines += _gauge(name, doc, [("", value)])
    lines += _gauge(
        "vllm:num_requests_running", "Number of requests in model execution batches.", [(m, float(running))]
    )
    lines += _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", [(m, float(waiting))])
    kv_name = "vllm:gpu_cache_usage_perc" if legacy_kv_name else "vllm:kv_cache_usage_perc"
    lines += _gauge(kv_name, "KV-cache usage. 1 means 100 percent usage.", [(m, kv_usage)])
    lines += _gauge(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        [
            (f'max_lora="{max_lora}",running_lora_adapters="",waiting_lora_adapters=""', 1.764502140e09),
            (
                (
                    f'max_lora="{max_lora}",running_lora_adapters="{running_adapters}",'
                    f'waiting_lora_adapters="{waiting_adapters}"'
                ),
                1.764503001e09,
            ),
        ],
    )
    lines += _gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        [
            (
                (
                    f'block_size="{block_size}",cache_dtype="auto",calculate_kv_scales="False",'
                    f'cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
                    f'is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="{num_gpu_blocks}",'
                    f'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",'
                    f'sliding_window="None",swap_space="4",swap_space_bytes="4294967296"'
                ),
                1.0,
            )
        ],
    )
    for name, doc, value in (
        ("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", 17.0),
        ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", 8.812344e06),
        ("vllm:generation_tokens_total", "Number of generation tokens processed.", 1.220993e06),
        ("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", 8.812344e06),
        ("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", 5.10331e06),
    ):
        lines += _gauge(name, doc, [(m, value)], "counter")
    lines += _gauge(
        "vllm:request_success_total",
        "Count of successfully processed requests.",
        [(f'{m},finished_reason="{r}"', v) for r, v in (("stop", 9120.0), ("length", 311.0), ("abort", 4.0))],
        "counter",
    )
    for name, doc, buckets, total, mean in (
        ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", _TOKEN_BUCKETS, 48213, 212.0),
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
            9435,
            0.21,
        ),
        (
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            TTFT_BUCKETS,
            1211558,
            0.024,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_SECONDS_BUCKETS,
            9435,
            3.2,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_SECONDS_BUCKETS,
            9435,
            0.08,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_SECONDS_BUCKETS,
            9435,
            3.1,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_SECONDS_BUCKETS,
            9435,
            0.15,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_SECONDS_BUCKETS,
            9435,
            2.9,
        ),
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKEN_BUCKETS, 9435, 934.0),
        ("vllm:request_generation_tokens", "Number of generation tokens processed.", _TOKEN_BUCKETS, 9435, 129.0),
        (
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            _TOKEN_BUCKETS,
            9435,
            256.0,
        ),
    ):
        lines += _histogram(name, doc, m, buckets, total, mean)
    return ("\n".join(lines) + "\n").encode()


def sglang_page(
    *,
    queue: float = 5,
    running: float = 30,
    token_usage: float = 0.61,
    page_size: int = 1,
    num_pages: int = 480_000,
    model: str = "Qwen/Qwen3-8B",
) -> bytes:
    """An SGLang /metrics page."""
    m = f'model_name="{model}"'
    lines: list[str] = []
    lines += _gauge("sglang:num_running_reqs", "The number of running requests.", [(m, float(running))])
    lines += _gauge("sglang:num_used_tokens", "The number of used tokens.", [(m, 293120.0)])
    lines += _gauge("sglang:token_usage", "The token usage.", [(m, token_usage)])
    lines += _gauge("sglang:gen_throughput", "The generation throughput (token/s).", [(m, 1843.2)])
    lines += _gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", [(m, float(queue))])
    lines += _gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", [(m, 0.44)])
    lines += _gauge(
        "sglang:cache_config_info",
        "Information about the cache configuration.",
        [(f'{m},num_pages="{num_pages}",page_size="{page_size}"', 1.0)],
    )
    lines += _histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        m,
        TTFT_BUCKETS,
        512,
        0.3,
    )
    lines += _gauge("sglang:prompt_tokens_total", "Number of prefill tokens processed.", [(m, 1.2e6)], "counter")
    return ("\n".join(lines) + "\n").encode()


def trtllm_page(
    *,
    waiting: float = 2,
    running: float = 8,
    utilization: float = 0.25,
    tokens_per_block: int = 32,
    max_blocks: int = 9000,
) -> bytes:
    """A trtllm-serve /prometheus/metrics page."""
    m = 'model_name="trt-model",engine_type="trtllm"'
    lines: list[str] = []
    lines += _gauge("trtllm_num_requests_waiting", "Number of waiting requests.", [(m, float(waiting))])
    lines += _gauge("trtllm_num_requests_running", "Number of running requests.", [(m, float(running))])
    lines += _gauge("trtllm_kv_cache_utilization", "KV cache utilization.", [(m, utilization)])
    lines += _gauge("trtllm_kv_cache_tokens_per_block", "Tokens per KV block.", [(m, float(tokens_per_block))])
    lines += _gauge("trtllm_kv_cache_max_blocks", "Maximum KV blocks.", [(m, float(max_blocks))])
    lines += _gauge("trtllm_kv_cache_hit_rate", "KV cache hit rate.", [(m, 0.3)])
    lines += _histogram("trtllm_time_to_first_token_seconds", "Time to first token.", m, TTFT_BUCKETS, 300, 0.2)
    return ("\n".join(lines) + "\n").encode()


def triton_page(
    *,
    waiting: float = 4,
    scheduled: float = 16,
    fraction: float = 0.5,
    tokens_per: int = 64,
    max_blocks: int = 4096,
) -> bytes:
    """A Triton (TensorRT-LLM backend) /metrics page."""
    m = 'model="ensemble",version="1"'
    lines: list[str] = []
    lines += _gauge(
        "nv_trt_llm_request_metrics",
        "TRT LLM request metrics",
        [
            (f'{m},request_type="context"', 2.0),
            (f'{m},request_type="scheduled"', float(scheduled)),
            (f'{m},request_type="max"', 64.0),
            (f'{m},request_type="active"', 20.0),
            (f'{m},request_type="waiting"', float(waiting)),
        ],
    )
    lines += _gauge(
        "nv_trt_llm_kv_cache_block_metrics",
        "TRT LLM KV cache block metrics",
        [
            (f'{m},kv_cache_block_type="fraction"', fraction),
            (f'{m},kv_cache_block_type="tokens_per"', float(tokens_per)),
            (f'{m},kv_cache_block_type="used"', 2048.0),
            (f'{m},kv_cache_block_type="free"', 2048.0),
            (f'{m},kv_cache_block_type="max"', float(max_blocks)),
        ],
    )
    lines += _gauge("nv_inference_request_success", "Number of successful inference requests", [(m, 812.0)], "counter")
    return ("\n".join(lines) + "\n").encode()
