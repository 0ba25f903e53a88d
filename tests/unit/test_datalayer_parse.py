"""The targeted Prometheus text scanner: values, LoRA and cache info, and hostile pages."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from picker.datalayer.engines import BUILTIN_ENGINES, engine_spec_from_config
from picker.datalayer.parse import parse_page
from picker.datastore.endpoint import EndpointMetrics
from picker_bench.metric_pages import (
    sglang_page,
    triton_page,
    trtllm_page,
    vllm_page,
)

VLLM = BUILTIN_ENGINES["vllm"]


def test_realistic_vllm_page() -> None:
    page = vllm_page(
        waiting=7,
        running=21,
        kv_usage=0.83,
        running_adapters="a, b",
        waiting_adapters="c",
        max_lora=8,
        block_size=32,
        num_gpu_blocks=1234,
    )
    assert 250 <= page.count(b"\n") <= 350  # the benchmark's "300-line page"
    parsed = parse_page(page, VLLM)
    assert parsed.missing == frozenset()
    assert parsed.extracted == 5
    assert parsed.metrics == EndpointMetrics(
        waiting_queue_size=7,
        running_requests_size=21,
        kv_cache_usage=0.83,
        active_models=frozenset({"a", "b"}),
        waiting_models=frozenset({"c"}),
        max_active_models=8,
        cache_block_size=32,
        cache_num_blocks=1234,
    )


def test_vllm_before_1_3_uses_gpu_cache_usage_perc() -> None:
    parsed = parse_page(vllm_page(kv_usage=0.5, legacy_kv_name=True), VLLM)
    assert parsed.metrics.kv_cache_usage == 0.5
    assert parsed.missing == frozenset()


def test_sglang_trtllm_and_triton_pages() -> None:
    sglang = parse_page(
        sglang_page(queue=4, running=9, token_usage=0.3, page_size=64, num_pages=100), BUILTIN_ENGINES["sglang"]
    )
    assert (sglang.metrics.waiting_queue_size, sglang.metrics.running_requests_size) == (4, 9)
    assert (sglang.metrics.kv_cache_usage, sglang.metrics.cache_block_size, sglang.metrics.cache_num_blocks) == (
        0.3,
        64,
        100,
    )
    assert sglang.missing == frozenset()

    trt = parse_page(
        trtllm_page(waiting=1, running=2, utilization=0.9, tokens_per_block=64, max_blocks=77),
        BUILTIN_ENGINES["trtllm-serve"],
    )
    assert trt.metrics == EndpointMetrics(1, 2, 0.9, cache_block_size=64, cache_num_blocks=77)

    triton = parse_page(
        triton_page(waiting=5, scheduled=6, fraction=0.7, tokens_per=128, max_blocks=99),
        BUILTIN_ENGINES["triton-tensorrt-llm"],
    )
    assert triton.metrics == EndpointMetrics(5, 6, 0.7, cache_block_size=128, cache_num_blocks=99)
    assert triton.extracted == 5


def test_lora_takes_the_series_with_the_largest_value_wherever_it_is() -> None:
    page = (
        b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="new",waiting_lora_adapters="w1,w2"} 1700000009\n'
        b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1700000001\n'
    )
    metrics = parse_page(page, VLLM).metrics
    assert metrics.active_models == {"new"}
    assert metrics.waiting_models == {"w1", "w2"}
    assert metrics.max_active_models == 2


def test_several_matching_series_use_the_latest_timestamp() -> None:
    page = (
        b'vllm:num_requests_waiting{engine="0"} 5 1000\n'
        b'vllm:num_requests_waiting{engine="1"} 9 3000\n'
        b'vllm:num_requests_waiting{engine="2"} 7 2000\n'
        b'vllm:num_requests_running{engine="0"} 1\n'
        b'vllm:num_requests_running{engine="1"} 2\n'
    )
    metrics = parse_page(page, VLLM).metrics
    assert metrics.waiting_queue_size == 9
    assert metrics.running_requests_size == 1  # no timestamps: the first series


def test_label_selector_picks_the_matching_series_only() -> None:
    spec = engine_spec_from_config({"name": "x", "queuedRequestsSpec": 'q{pool="b"}', "kvUsageSpec": 'kv{x="1"}'})
    page = b'q{pool="a"} 1\nq{pool="b",zone="z"} 2\nkv{x="2"} 0.5\n'
    parsed = parse_page(page, spec)
    assert parsed.metrics.waiting_queue_size == 2
    assert parsed.missing == {'kv{x="1"}'}


def test_escaped_label_values_and_braces_inside_them() -> None:
    page = (
        b'vllm:lora_requests_info{max_lora="3",running_lora_adapters="a\\"q\\",b}\\\\x",'
        b'waiting_lora_adapters="line\\nbreak"} 5\n'
    )
    metrics = parse_page(page, VLLM).metrics
    assert metrics.active_models == {'a"q"', "b}\\x"}
    assert metrics.waiting_models == {"line\nbreak"}


def test_malformed_lines_are_skipped_and_good_ones_still_read() -> None:
    page = (
        b"vllm:num_requests_waiting{broken 3\n"
        b'vllm:num_requests_waiting{model_name="m"} abc\n'
        b'vllm:num_requests_waiting{model_name="m"} 1 2 3\n'
        b"vllm:num_requests_waiting\n"
        b'vllm:num_requests_waiting{model_name="m} 4\n'
        b'vllm:num_requests_waiting{model_name="m"} 6\n'
        b"\x00\xff garbage \xfe\n"
        b"vllm:num_requests_running 2 notatimestamp\n"
        b"vllm:num_requests_running{} 8\n"
        b'vllm:lora_requests_info{max_lora="x",running_lora_adapters=unquoted} 9\n'
        b'vllm:cache_config_info{block_size="None",num_gpu_blocks="None"} 1\n'
    )
    parsed = parse_page(page, VLLM)
    assert parsed.metrics.waiting_queue_size == 6
    assert parsed.metrics.running_requests_size == 8
    assert parsed.missing == {"vllm:kv_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info"}


def test_nan_and_inf_are_not_usable_values_and_keep_the_previous_ones() -> None:
    previous = EndpointMetrics(waiting_queue_size=3, running_requests_size=4, kv_cache_usage=0.25, update_time=10.0)
    page = (
        b"vllm:num_requests_waiting NaN\n"
        b"vllm:num_requests_running +Inf\n"
        b"vllm:kv_cache_usage_perc -Inf\n"
        b"vllm:gpu_cache_usage_perc 0.5\n"
    )
    parsed = parse_page(page, VLLM, previous, update_time=20.0)
    assert (parsed.metrics.waiting_queue_size, parsed.metrics.running_requests_size) == (3, 4)
    assert parsed.metrics.kv_cache_usage == 0.5  # the legacy name still had a finite value
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running"} <= parsed.missing
    assert parsed.metrics.update_time == 20.0


def test_missing_families_keep_previous_values_and_do_not_refresh_update_time() -> None:
    previous = EndpointMetrics(waiting_queue_size=3, kv_cache_usage=0.25, cache_block_size=16, update_time=10.0)
    page = b"# HELP vllm:num_requests_waiting Number of requests waiting.\n# TYPE vllm:num_requests_waiting gauge\nother 1\n"
    parsed = parse_page(page, VLLM, previous, update_time=20.0)
    assert parsed.extracted == 0
    assert parsed.metrics == previous
    assert parsed.missing == {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info",
        "vllm:cache_config_info",
    }


def test_longer_names_sharing_a_prefix_are_not_confused() -> None:
    page = (
        b'vllm:num_requests_waiting_by_reason{reason="capacity"} 50\n'
        b"vllm:num_requests_waiting_total 60\n"
        b"vllm:num_requests_waiting\t2\n"
    )
    assert parse_page(page, VLLM).metrics.waiting_queue_size == 2


def test_first_line_crlf_and_missing_final_newline() -> None:
    page = b'vllm:num_requests_waiting 4\r\nvllm:num_requests_running{a="b"} 5\r\nvllm:kv_cache_usage_perc 0.125'
    metrics = parse_page(page, VLLM).metrics
    assert (metrics.waiting_queue_size, metrics.running_requests_size, metrics.kv_cache_usage) == (4, 5, 0.125)


def test_disabled_metrics_are_neither_read_nor_missing() -> None:
    spec = engine_spec_from_config({"name": "q-only", "queuedRequestsSpec": "vllm:num_requests_waiting"})
    parsed = parse_page(vllm_page(waiting=11), spec)
    assert parsed.extracted == 1 and parsed.missing == frozenset()
    assert parsed.metrics == EndpointMetrics(waiting_queue_size=11)


def test_huge_page_with_the_wanted_lines_at_the_end() -> None:
    filler = b"".join(b'filler_metric{i="%d"} %d\n' % (i, i) for i in range(150_000))
    page = filler + b'vllm:num_requests_waiting{model_name="m"} 13\n' + b"x" * 1_000_000
    assert len(page) > 5_000_000
    parsed = parse_page(page, VLLM)
    assert parsed.metrics.waiting_queue_size == 13


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.sampled_from(sorted(BUILTIN_ENGINES)))
def test_random_bytes_never_raise(noise: bytes, engine: str) -> None:
    parse_page(noise, BUILTIN_ENGINES[engine])
    parse_page(b"vllm:lora_requests_info{" + noise, BUILTIN_ENGINES[engine])


# Pieces of sample lines, shuffled into pages by the property tests here and in test_datalayer_scan.
PAGE_TOKENS = [
    b"vllm:num_requests_waiting",
    b"vllm:num_requests_running",
    b"vllm:lora_requests_info",
    b"vllm:cache_config_info",
    b"sglang:num_queue_reqs",
    b"{",
    b"}",
    b'"',
    b"\\",
    b"=",
    b",",
    b" ",
    b"\n",
    b"\r",
    b"1",
    b"NaN",
    b"block_size",
    b'max_lora="',
    b"\t",
    b"1e400",
    b"-3",
    b"_x",
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PAGE_TOKENS), max_size=40))
def test_shuffled_tokens_never_raise(tokens: list[bytes]) -> None:
    parse_page(b"".join(tokens), VLLM)
