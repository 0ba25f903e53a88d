"""Engine metric specs: the built-in table, selectors, engineConfigs overrides, engine choice."""

from __future__ import annotations

import pytest

from picker.datalayer.engines import (
    BUILTIN_ENGINES,
    ENGINE_LABEL_KEY,
    EngineCatalog,
    MetricSelector,
    build_engine_specs,
    engine_spec_from_config,
    parse_selector,
)
from picker.datastore.endpoint import Endpoint


def _texts(name: str) -> dict[str, object]:
    spec = BUILTIN_ENGINES[name]

    def one(selector: MetricSelector | None) -> str | None:
        return str(selector) if selector is not None else None

    return {
        "queued": one(spec.queued),
        "running": one(spec.running),
        "kv": [str(s) for s in spec.kv_usage],
        "lora": one(spec.lora),
        "cache_info": one(spec.cache_info),
        "block_size": one(spec.cache_block_size),
        "num_blocks": one(spec.cache_num_blocks),
    }


def test_builtin_specs_follow_the_reference_table() -> None:
    assert set(BUILTIN_ENGINES) == {"vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm"}
    assert _texts("vllm") == {
        "queued": "vllm:num_requests_waiting",
        "running": "vllm:num_requests_running",
        "kv": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        "lora": "vllm:lora_requests_info",
        "cache_info": "vllm:cache_config_info",
        "block_size": None,
        "num_blocks": None,
    }
    assert _texts("sglang") == {
        "queued": "sglang:num_queue_reqs",
        "running": "sglang:num_running_reqs",
        "kv": ["sglang:token_usage"],
        "lora": None,
        "cache_info": "sglang:cache_config_info",
        "block_size": None,
        "num_blocks": None,
    }
    assert _texts("trtllm-serve") == {
        "queued": "trtllm_num_requests_waiting",
        "running": "trtllm_num_requests_running",
        "kv": ["trtllm_kv_cache_utilization"],
        "lora": None,
        "cache_info": None,
        "block_size": "trtllm_kv_cache_tokens_per_block",
        "num_blocks": "trtllm_kv_cache_max_blocks",
    }
    assert _texts("triton-tensorrt-llm") == {
        "queued": 'nv_trt_llm_request_metrics{request_type="waiting"}',
        "running": 'nv_trt_llm_request_metrics{request_type="scheduled"}',
        "kv": ['nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}'],
        "lora": None,
        "cache_info": None,
        "block_size": 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"}',
        "num_blocks": 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"}',
    }


def test_spec_families_list_every_metric_name_once() -> None:
    assert BUILTIN_ENGINES["triton-tensorrt-llm"].families == {
        b"nv_trt_llm_request_metrics",
        b"nv_trt_llm_kv_cache_block_metrics",
    }
    assert b"vllm:gpu_cache_usage_perc" in BUILTIN_ENGINES["vllm"].families


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:num_requests_waiting", MetricSelector("vllm:num_requests_waiting")),
        ("  m  ", MetricSelector("m")),
        ("m{a=b}", MetricSelector("m", (("a", "b"),))),
        ('m{a="b", c = "d,}"}', MetricSelector("m", (("a", "b"), ("c", "d,}")))),
        ('m{a="say \\"hi\\""}', MetricSelector("m", (("a", 'say "hi"'),))),
        ("m{}", MetricSelector("m")),
    ],
)
def test_parse_selector_accepts_promql_style(text: str, expected: MetricSelector) -> None:
    assert parse_selector(text) == expected


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_selector_means_disabled(text: str) -> None:
    assert parse_selector(text) is None


@pytest.mark.parametrize("text", ["9metric", "m{a}", "m{a=", 'm{a="b"', "m n", "m{a=b c=d}", "{a=b}"])
def test_parse_selector_rejects_garbage_clearly(text: str) -> None:
    with pytest.raises(ValueError, match="metric spec"):
        parse_selector(text)


def test_engine_config_replaces_builtin_completely_and_empty_disables() -> None:
    specs = build_engine_specs(
        [
            {
                "name": "vllm",
                "queuedRequestsSpec": "my_queue",
                "runningRequestsSpec": "",
                "kvUsageSpec": 'my_kv{kind="gpu"}',
            },
            {"name": "custom", "queuedRequestsSpec": "q", "cacheBlockSizeSpec": "bs", "cacheNumBlocksSpec": "nb"},
        ]
    )
    vllm = specs["vllm"]
    assert vllm.queued == MetricSelector("my_queue")
    assert vllm.running is None
    assert vllm.kv_usage == (MetricSelector("my_kv", (("kind", "gpu"),)),)
    assert vllm.lora is None and vllm.cache_info is None  # left out → off, no built-in fallback
    assert specs["custom"].cache_block_size == MetricSelector("bs")
    assert specs["sglang"] is BUILTIN_ENGINES["sglang"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"queuedRequestsSpec": "q"}, "name cannot be empty"),
        ({"name": ""}, "name cannot be empty"),
        ({"name": "x", "queuedSpec": "q"}, "unknown keys"),
        ({"name": "x", "kvUsageSpec": 3}, "must be a string"),
        ({"name": "x", "loraSpec": "a{b"}, "loraSpec"),
        ("vllm", "must be a mapping"),
    ],
)
def test_bad_engine_config_is_a_clear_error(entry: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine_spec_from_config(entry)  # type: ignore[arg-type]


def test_duplicate_engine_config_is_an_error() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        build_engine_specs([{"name": "a"}, {"name": "a"}])


def _endpoint(labels: dict[str, str]) -> Endpoint:
    return Endpoint("10.0.0.1", 8000, labels=labels)


def test_catalog_picks_engine_by_label_else_default() -> None:
    catalog = EngineCatalog.builtin()
    assert catalog.spec_for(_endpoint({})).name == "vllm"
    assert catalog.spec_for(_endpoint({ENGINE_LABEL_KEY: "sglang"})).name == "sglang"
    assert catalog.spec_for(_endpoint({ENGINE_LABEL_KEY: "unknown-engine"})).name == "vllm"
    assert EngineCatalog.builtin("trtllm-serve").spec_for(_endpoint({})).name == "trtllm-serve"


def test_catalog_from_extractor_parameters() -> None:
    catalog = EngineCatalog.from_parameters(
        {
            "engineLabelKey": "example.com/engine",
            "defaultEngine": "mine",
            "engineConfigs": [{"name": "mine", "queuedRequestsSpec": "mine_queue"}],
        }
    )
    assert catalog.spec_for(_endpoint({})).queued == MetricSelector("mine_queue")
    assert catalog.spec_for(_endpoint({"example.com/engine": "sglang"})).name == "sglang"
    assert catalog.spec_for(_endpoint({ENGINE_LABEL_KEY: "sglang"})).name == "mine"
    assert EngineCatalog.from_parameters(None).default_engine == "vllm"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"defaultEngine": "nope"}, "defaultEngine 'nope' not found"),
        ({"engineConfigs": {"name": "x"}}, "must be a list"),
        ({"engineConfig": []}, "unknown parameters"),
    ],
)
def test_bad_extractor_parameters_are_clear_errors(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineCatalog.from_parameters(params)
