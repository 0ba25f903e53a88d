"""Which metrics to read from each model-server engine's /metrics page.

The built-in specs follow the reference EPP's `core-metrics-extractor`; an `engineConfigs`
entry of the same name replaces a built-in spec completely, and an empty spec string turns
that metric off.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from picker.datastore.endpoint import Endpoint

ENGINE_LABEL_KEY = "inference.networking.k8s.io/engine-type"
DEFAULT_ENGINE = "vllm"

_SELECTOR = re.compile(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^",}\s]*))\s*(?:,|$)')


@dataclass(frozen=True, slots=True)
class MetricSelector:
    """A PromQL-style selector: a metric name and label equalities a series must have."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()
    # The name as the scanner searches for it in the page bytes.
    family: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", self.name.encode())

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inner = ",".join(f'{k}="{v}"' for k, v in self.labels)
        return f"{self.name}{{{inner}}}"


def parse_selector(text: str) -> MetricSelector | None:
    """Parse `name` or `name{label="value",...}` (quotes optional); "" means disabled (None).

    Raises ValueError with the offending text on anything else.
    """
    if not text.strip():
        return None
    match = _SELECTOR.fullmatch(text)
    if match is None:
        raise ValueError(f'invalid metric spec {text!r}: expected name or name{{label="value"}}')
    name, inner = match.group(1), match.group(2)
    labels: list[tuple[str, str]] = []
    pos = 0
    inner = (inner or "").strip()
    while pos < len(inner):
        matcher = _MATCHER.match(inner, pos)
        if matcher is None or matcher.end() == pos:
            raise ValueError(f"invalid label matcher in metric spec {text!r}")
        value = matcher.group(2) if matcher.group(2) is not None else matcher.group(3)
        labels.append((matcher.group(1), value.replace('\\"', '"').replace("\\\\", "\\")))
        pos = matcher.end()
    return MetricSelector(name, tuple(labels))


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """The selectors for one engine; None disables a metric.

    `kv_usage` lists alternatives tried in order (vLLM renamed its KV metric in v1.3.0).
    Cache geometry comes either from the labels of an info series (`cache_info`: vLLM's
    `block_size`/`num_gpu_blocks`, SGLang's `page_size`/`num_pages`) or from two gauges
    (`cache_block_size`, `cache_num_blocks`: TensorRT-LLM).
    """

    name: str
    queued: MetricSelector | None = None
    running: MetricSelector | None = None
    kv_usage: tuple[MetricSelector, ...] = ()
    lora: MetricSelector | None = None
    cache_info: MetricSelector | None = None
    cache_block_size: MetricSelector | None = None
    cache_num_blocks: MetricSelector | None = None
    # Every family name the spec reads, for the page scanner.
    families: frozenset[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        selectors = (
            self.queued,
            self.running,
            *self.kv_usage,
            self.lora,
            self.cache_info,
            self.cache_block_size,
            self.cache_num_blocks,
        )
        object.__setattr__(self, "families", frozenset(s.family for s in selectors if s is not None))


def _spec(name: str, **selectors: str | tuple[str, ...]) -> EngineSpec:
    parsed: dict[str, Any] = {}
    for key, text in selectors.items():
        if isinstance(text, tuple):
            parsed[key] = tuple(s for s in map(parse_selector, text) if s is not None)
        else:
            parsed[key] = parse_selector(text)
    return EngineSpec(name, **parsed)


_TRITON_KV = "nv_trt_llm_kv_cache_block_metrics"
BUILTIN_ENGINES: Mapping[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        _spec(
            "vllm",
            queued="vllm:num_requests_waiting",
            running="vllm:num_requests_running",
            kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            lora="vllm:lora_requests_info",
            cache_info="vllm:cache_config_info",
        ),
        _spec(
            "sglang",
            queued="sglang:num_queue_reqs",
            running="sglang:num_running_reqs",
            kv_usage=("sglang:token_usage",),
            cache_info="sglang:cache_config_info",
        ),
        _spec(
            "trtllm-serve",
            queued="trtllm_num_requests_waiting",
            running="trtllm_num_requests_running",
            kv_usage=("trtllm_kv_cache_utilization",),
            cache_block_size="trtllm_kv_cache_tokens_per_block",
            cache_num_blocks="trtllm_kv_cache_max_blocks",
        ),
        _spec(
            "triton-tensorrt-llm",
            queued='nv_trt_llm_request_metrics{request_type="waiting"}',
            running='nv_trt_llm_request_metrics{request_type="scheduled"}',
            kv_usage=(f'{_TRITON_KV}{{kv_cache_block_type="fraction"}}',),
            cache_block_size=f'{_TRITON_KV}{{kv_cache_block_type="tokens_per"}}',
            cache_num_blocks=f'{_TRITON_KV}{{kv_cache_block_type="max"}}',
        ),
    )
}

# engineConfigs keys → EngineSpec fields. The first five are the reference EPP's; the two
# gauge keys are the picker's, for engines that export cache geometry as plain gauges.
_CONFIG_KEYS = {
    "queuedRequestsSpec": "queued",
    "runningRequestsSpec": "running",
    "kvUsageSpec": "kv_usage",
    "loraSpec": "lora",
    "cacheInfoSpec": "cache_info",
    "cacheBlockSizeSpec": "cache_block_size",
    "cacheNumBlocksSpec": "cache_num_blocks",
}


def engine_spec_from_config(entry: Mapping[str, Any]) -> EngineSpec:
    """One `engineConfigs` entry (`{name, queuedRequestsSpec, ...}`) → EngineSpec.

    Keys left out disable their metric, as in the reference EPP. Raises ValueError on an
    empty name, an unknown key, a non-string spec or an unparsable selector.
    """
    if not isinstance(entry, Mapping):
        raise ValueError(f"engine config must be a mapping, got {type(entry).__name__}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("engine config name cannot be empty")
    unknown = set(entry) - set(_CONFIG_KEYS) - {"name"}
    if unknown:
        raise ValueError(f"engine config {name!r}: unknown keys {sorted(unknown)}")
    selectors: dict[str, Any] = {}
    for key, attr in _CONFIG_KEYS.items():
        text = entry.get(key, "")
        if not isinstance(text, str):
            raise ValueError(f"engine config {name!r}: {key} must be a string")
        try:
            selector = parse_selector(text)
        except ValueError as exc:
            raise ValueError(f"engine config {name!r}: {key}: {exc}") from None
        if attr == "kv_usage":
            selectors[attr] = (selector,) if selector is not None else ()
        else:
            selectors[attr] = selector
    return EngineSpec(name, **selectors)


def build_engine_specs(engine_configs: Iterable[Mapping[str, Any]] | None = None) -> dict[str, EngineSpec]:
    """The built-in specs with each `engineConfigs` entry replacing the one of its name."""
    specs = dict(BUILTIN_ENGINES)
    seen: set[str] = set()
    for entry in engine_configs or ():
        spec = engine_spec_from_config(entry)
        if spec.name in seen:
            raise ValueError(f"duplicate engine config {spec.name!r}")
        seen.add(spec.name)
        specs[spec.name] = spec
    return specs


@dataclass(frozen=True, slots=True)
class EngineCatalog:
    """Engine specs plus the rule choosing one per endpoint: the engine label, else the default."""

    specs: Mapping[str, EngineSpec]
    default_engine: str = DEFAULT_ENGINE
    label_key: str = ENGINE_LABEL_KEY

    def __post_init__(self) -> None:
        if self.default_engine not in self.specs:
            raise ValueError(
                f"defaultEngine {self.default_engine!r} not found in engine configs "
                f"(known: {', '.join(sorted(self.specs))})"
            )

    @classmethod
    def builtin(cls, default_engine: str = DEFAULT_ENGINE) -> EngineCatalog:
        return cls(BUILTIN_ENGINES, default_engine)

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any] | None) -> EngineCatalog:
        """From `core-metrics-extractor` parameters: `engineLabelKey`, `defaultEngine`, `engineConfigs`."""
        params = dict(parameters or {})
        unknown = set(params) - {"engineLabelKey", "defaultEngine", "engineConfigs"}
        if unknown:
            raise ValueError(f"core-metrics-extractor: unknown parameters {sorted(unknown)}")
        configs = params.get("engineConfigs") or []
        if not isinstance(configs, list):
            raise ValueError("core-metrics-extractor: engineConfigs must be a list")
        return cls(
            build_engine_specs(configs),
            params.get("defaultEngine") or DEFAULT_ENGINE,
            params.get("engineLabelKey") or ENGINE_LABEL_KEY,
        )

    def spec_for(self, endpoint: Endpoint) -> EngineSpec:
        """The endpoint's engine spec; an unknown engine label falls back to the default."""
        engine = endpoint.labels.get(self.label_key)
        spec = self.specs.get(engine) if engine else None
        return spec if spec is not None else self.specs[self.default_engine]
