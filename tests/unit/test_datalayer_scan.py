"""The compiled core's line scan (`picker_extproc_core.wanted_lines`, what the scraper hands to
Python) gives `parse_page` exactly what the whole page gives it, on realistic and hostile pages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from picker_extproc_core import wanted_lines

from picker.datalayer.engines import BUILTIN_ENGINES, EngineSpec
from picker.datalayer.parse import ParsedPage, parse_page
from picker.datastore.endpoint import EndpointMetrics
from picker_bench.metric_pages import sglang_page, triton_page, trtllm_page, vllm_page
from tests.unit.test_datalayer_parse import PAGE_TOKENS

PREVIOUS = EndpointMetrics(waiting_queue_size=99, kv_cache_usage=0.5, cache_block_size=8, update_time=1.0)

PAGES = {
    "vllm": vllm_page(waiting=7, running=21, kv_usage=0.83, running_adapters="a, b", waiting_adapters="c"),
    "vllm-legacy": vllm_page(kv_usage=0.5, legacy_kv_name=True),
    "sglang": sglang_page(queue=4, running=9, token_usage=0.3, page_size=64, num_pages=100),
    "trtllm": trtllm_page(waiting=2, running=8, utilization=0.25),
    "triton": triton_page(waiting=4, scheduled=16, fraction=0.5),
    "crlf-no-final-newline": b"vllm:num_requests_waiting 3\r\nvllm:num_requests_running 4",
    "prefix-sharing-names": b"vllm:num_requests_waiting_total 8\nvllm:num_requests_waiting\t2\n",
    "escapes-and-braces": b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="x}\\"y",'
    b'waiting_lora_adapters=""} 5\n',
    "malformed": b'vllm:num_requests_waiting{model_name="m" 7\nvllm:kv_cache_usage_perc NaN\n\xff\xfe junk\n',
    "timestamps": b"vllm:num_requests_waiting 1 200\nvllm:num_requests_waiting 2 100\nvllm:num_requests_waiting 3\n",
    "empty": b"",
}


def _both(page: bytes, spec: EngineSpec) -> tuple[ParsedPage, ParsedPage]:
    lines = wanted_lines(page, sorted(spec.families))
    return parse_page(page, spec, PREVIOUS, 2.0), parse_page(lines, spec, PREVIOUS, 2.0)


@pytest.mark.parametrize("engine", sorted(BUILTIN_ENGINES))
@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_scanned_lines_parse_as_the_whole_page(page: str, engine: str) -> None:
    whole, scanned = _both(PAGES[page], BUILTIN_ENGINES[engine])
    assert scanned == whole


def test_the_scan_keeps_only_the_wanted_sample_lines() -> None:
    spec = BUILTIN_ENGINES["vllm"]
    page = PAGES["vllm"]
    lines = wanted_lines(page, sorted(spec.families)).splitlines()
    assert 0 < len(lines) < page.count(b"\n") // 20  # a handful of ~300
    assert all(line.split(b"{")[0].split()[0] in spec.families for line in lines)
    assert _both(page, spec)[0].extracted == 5


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.sampled_from(sorted(BUILTIN_ENGINES)))
def test_random_bytes_parse_the_same(noise: bytes, engine: str) -> None:
    spec = BUILTIN_ENGINES[engine]
    for page in (noise, b"vllm:lora_requests_info{" + noise, b"vllm:num_requests_waiting" + noise):
        whole, scanned = _both(page, spec)
        assert scanned == whole


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PAGE_TOKENS), max_size=40), st.sampled_from(sorted(BUILTIN_ENGINES)))
def test_shuffled_tokens_parse_the_same(tokens: list[bytes], engine: str) -> None:
    whole, scanned = _both(b"".join(tokens), BUILTIN_ENGINES[engine])
    assert scanned == whole
