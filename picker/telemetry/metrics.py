"""Every Prometheus metric the picker exports, in one place.

Names follow the reference EPP where one exists (so its dashboards keep working), and llm-d's
for its P/D decision; the picker's own additions are prefixed `picker_`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

_M = ("model_name", "target_model_name")
_DURATION_BUCKETS = (
    0.005,
    0.025,
    0.05,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    1.25,
    1.5,
    2,
    3,
    4,
    5,
    6,
    8,
    10,
    15,
    20,
    30,
    45,
    60,
    120,
    180,
    240,
    300,
    360,
    480,
    600,
    900,
    1200,
    1800,
    2700,
    3600,
)
_TOKEN_BUCKETS = (
    1,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32778,
    65536,
    131072,
    262144,
    524288,
    1048576,
)
_SIZE_BUCKETS = tuple(64 * 4**i for i in range(13))  # 64 B .. 1 GiB
_SCHED_BUCKETS = (
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
)
_TTFT_BUCKETS = (
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

# -- per request (reference names) -----------------------------------------------------------
REQUEST_TOTAL = Counter("inference_objective_request", "Requests routed, by model and priority.", (*_M, "priority"))
REQUEST_ERROR_TOTAL = Counter(
    "inference_objective_request_error", "Requests that failed, by error code.", (*_M, "error_code")
)
REQUEST_DURATION = Histogram(
    "inference_objective_request_duration_seconds",
    "Time from the picker's decision to the end of the response.",
    _M,
    buckets=_DURATION_BUCKETS,
)
REQUEST_SIZES = Histogram(
    "inference_objective_request_sizes", "Request body sizes in bytes.", _M, buckets=_SIZE_BUCKETS
)
RESPONSE_SIZES = Histogram(
    "inference_objective_response_sizes", "Response body sizes in bytes.", _M, buckets=_SIZE_BUCKETS
)
INPUT_TOKENS = Histogram(
    "inference_objective_input_tokens", "Prompt tokens from response usage.", _M, buckets=_TOKEN_BUCKETS
)
OUTPUT_TOKENS = Histogram(
    "inference_objective_output_tokens", "Completion tokens from response usage.", _M, buckets=_TOKEN_BUCKETS
)
CACHED_TOKENS = Histogram(
    "inference_objective_prompt_cached_tokens",
    "Prompt tokens served from the engine's prefix cache (usage.prompt_tokens_details.cached_tokens).",
    _M,
    buckets=_TOKEN_BUCKETS,
)
RUNNING_REQUESTS = Gauge("inference_objective_running_requests", "Requests in flight, by model.", ("model_name",))
TTFT = Histogram(
    "inference_objective_request_ttft_seconds",
    "Time from the picker's decision to the first response body byte.",
    _M,
    buckets=_TTFT_BUCKETS,
)

# -- pool (reference names) -------------------------------------------------------------------
POOL_KV_CACHE = Gauge(
    "inference_pool_average_kv_cache_utilization", "Mean KV-cache utilisation of fresh endpoints.", ("name",)
)
POOL_QUEUE = Gauge("inference_pool_average_queue_size", "Mean waiting queue of fresh endpoints.", ("name",))
POOL_RUNNING = Gauge("inference_pool_average_running_requests", "Mean running requests of fresh endpoints.", ("name",))
POOL_READY_PODS = Gauge("inference_pool_ready_pods", "Endpoints with fresh metrics.", ("name",))
POOL_PER_POD_QUEUE = Gauge(
    "inference_pool_per_pod_queue_size", "Waiting queue per endpoint.", ("name", "model_server_pod")
)

# -- scheduler (reference names) --------------------------------------------------------------
SCHEDULER_E2E = Histogram(
    "inference_extension_scheduler_e2e_duration_seconds",
    "Time spent scheduling one request.",
    buckets=_SCHED_BUCKETS,
)
SCHEDULER_ATTEMPTS = Counter(
    "inference_extension_scheduler_attempts", "Scheduling attempts by outcome.", ("status", "target_model_name")
)
MODEL_REWRITE_DECISIONS = Counter(
    "inference_extension_model_rewrite_decisions",
    "Requests whose model an InferenceModelRewrite rewrote, by resource, requested and target model.",
    ("model_rewrite_name", "model_name", "target_model"),
)
PLUGIN_DURATION = Histogram(
    "inference_extension_plugin_duration_seconds",
    "Time spent in each plugin (one request in eight is timed; see PLUGIN_TIMING_SAMPLE).",
    ("extension_point", "plugin_type", "plugin_name"),
    buckets=_SCHED_BUCKETS,
)
# -- flow control (reference names, labels and buckets) ----------------------------------------
_FLOW = ("fairness_id", "priority")
_FLOW_CYCLE_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
FLOW_QUEUE_DURATION = Histogram(
    "inference_extension_flow_control_request_queue_duration_seconds",
    "Distribution of total time requests spend in the Flow Control layer (from enqueue to final outcome).",
    (*_FLOW, "outcome", "inference_pool", *_M),
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
FLOW_DISPATCH_CYCLE = Histogram(
    "inference_extension_flow_control_dispatch_cycle_duration_seconds",
    "Distribution of time taken for each internal dispatch cycle in the Flow Control layer.",
    buckets=_FLOW_CYCLE_BUCKETS,
)
FLOW_ENQUEUE_DURATION = Histogram(
    "inference_extension_flow_control_request_enqueue_duration_seconds",
    "Distribution of time taken to enqueue requests into the Flow Control layer.",
    (*_FLOW, "outcome"),
    buckets=_FLOW_CYCLE_BUCKETS,
)
FLOW_QUEUE_SIZE = Gauge(
    "inference_extension_flow_control_queue_size",
    "Current number of requests actively held in the Flow Control queue.",
    (*_FLOW, "inference_pool", *_M),
)
FLOW_QUEUE_BYTES = Gauge(
    "inference_extension_flow_control_queue_bytes",
    "Current total size in bytes of requests actively held in the Flow Control queue.",
    (*_FLOW, "inference_pool", *_M),
)
FLOW_POOL_SATURATION = Gauge(
    "inference_extension_flow_control_pool_saturation",
    "Current saturation level of the inference pool (0.0 = empty, 1.0 = fully saturated).",
    ("inference_pool",),
)
INFO = Gauge("inference_extension_info", "Build information.", ("commit", "build_ref"))

# llm-d's name: how pd-profile-handler routed each request (decision_type "decode-only" or
# "prefill-decode"; the picker counts what happened, so a request whose prefill profile found no
# pod counts as decode-only).
PD_DECISIONS = Counter(
    "llm_d_inference_scheduler_pd_decision", "Total number of P/D disaggregation decisions made", ("decision_type",)
)
# picker's own: of those decode-only requests, the ones that were to be prefilled remotely but
# found no prefill pod (a fleet without one, or all filtered out), which llm-d's count cannot tell apart.
PD_PREFILL_UNAVAILABLE = Counter(
    "picker_pd_prefill_unavailable",
    "Requests pd-profile-handler meant to prefill on a prefill pod but decoded alone: no prefill pod passed "
    "the prefill profile.",
)

# -- picker's own -----------------------------------------------------------------------------
ROUTED_TOTAL = Counter("picker_requests_routed", "Requests sent to each endpoint.", ("endpoint",))
IN_FLIGHT = Gauge(
    "picker_in_flight_requests", "Requests in flight per endpoint, as the picker counts them.", ("endpoint",)
)
STREAMS_ACTIVE = Gauge("picker_extproc_streams_active", "Open ext_proc streams.")
STREAM_ERRORS = Counter("picker_extproc_stream_errors", "ext_proc streams that ended in an error.", ("reason",))

# -- config (picker/config) -------------------------------------------------------------------
CONFIG_RELOADS = Counter(
    "picker_config_reloads",
    "EndpointPickerConfig reloads from a watched file or ConfigMap, by result.",
    ("result",),
)
CONFIG_LAST_RELOAD = Gauge(
    "picker_config_last_reload_success_timestamp_seconds",
    "Unix time the config in force was loaded (its last successful load).",
)
CONFIG_INFO = Gauge(
    "picker_config_info",
    "1 for the EndpointPickerConfig in force: the first 16 hex digits of its text's sha256 and where it came "
    "from (a file, --config-text, ConfigMap ns/name, or default); GET /config on this port shows it whole.",
    ("hash", "source"),
)

# -- data layer: scraping model-server /metrics (picker/datalayer) ---------------------------
SCRAPE_ERRORS = Counter(
    "picker_scrape_errors",
    "Failed scrapes of model-server /metrics pages, by endpoint and reason.",
    ("endpoint", "reason"),
)


class EndpointDurations:
    """One duration histogram per endpoint for the event loop's hottest observer: a scrape
    result (5,000 a second at 256 endpoints, 50 ms apart). An observation is a bucket search
    and two additions, about 0.13 µs where prometheus_client's Histogram, a lock per bucket
    and per sum, takes 0.7. Read as a collector of the default registry; `labels` and
    `remove` as prometheus_client's. Observed and read on the event loop only."""

    def __init__(
        self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry = REGISTRY
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.buckets = buckets
        self.labelnames = ("endpoint",)
        self._series: dict[str, EndpointDurationSeries] = {}
        registry.register(self)

    def labels(self, endpoint: str) -> EndpointDurationSeries:
        series = self._series.get(endpoint)
        if series is None:
            series = self._series[endpoint] = EndpointDurationSeries(self.buckets)
        return series

    def remove(self, endpoint: str) -> None:
        self._series.pop(endpoint, None)

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        bounds = [*map(floatToGoString, self.buckets), "+Inf"]
        for endpoint, series in self._series.items():
            family.add_metric([endpoint], list(zip(bounds, accumulate(series.counts))), series.total)
        yield family


class EndpointDurationSeries:
    """One endpoint's series of an `EndpointDurations`."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last +Inf; cumulated when read
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1  # le: a bound holds itself
        self.total += seconds


SCRAPE_DURATION = EndpointDurations(
    "picker_scrape_duration_seconds",
    "Time to fetch and parse one successful scrape of an endpoint's /metrics page.",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
METRICS_AGE = Gauge(
    "picker_metrics_age_seconds",
    "Seconds since an endpoint's metrics were last scraped successfully (+Inf if never).",
    ("endpoint",),
)

# -- KV-cache events and the precise prefix index (picker/kvevents) ----------------------------
KV_EVENTS = Counter(
    "picker_kv_events", "KV-cache events applied to the precise index, by endpoint and type.", ("endpoint", "type")
)
KV_EVENT_GAPS = Counter(
    "picker_kv_event_gaps", "Sequence gaps (lost KV-event messages) detected, by endpoint.", ("endpoint",)
)
KV_EVENT_REPLAYS = Counter(
    "picker_kv_event_replays",
    "Replay requests to a publisher's ROUTER socket, by outcome (complete, incomplete, failed).",
    ("endpoint", "outcome"),
)
KV_EVENT_DECODE_ERRORS = Counter(
    "picker_kv_event_decode_errors", "KV-event messages that could not be decoded, by endpoint.", ("endpoint",)
)
KV_EVENT_PUBLISHER_RESTARTS = Counter(
    "picker_kv_event_publisher_restarts", "Publisher restarts seen (sequence went back), by endpoint.", ("endpoint",)
)
KV_BLOCKS_EVICTED = Counter(
    "picker_kv_blocks_evicted", "KV blocks an engine reported evicted (BlockRemoved), by endpoint.", ("endpoint",)
)
KV_STATE_KNOWN = Gauge(
    "picker_kv_events_state_known",
    "1 while the precise index has every KV event of the endpoint, 0 after unrecovered loss.",
    ("endpoint",),
)

# -- state sync between picker processes (picker/state) ---------------------------------------
STATE_PUBLISHED_INSERTS = Counter(
    "picker_state_published_inserts", "Prefix-index inserts this process published to the state store."
)
STATE_UNPUBLISHED_INSERTS = Counter(
    "picker_state_unpublished_inserts",
    "Updates (prefix-index inserts, TTFT lessons) dropped unpublished: the pending buffer was full while"
    " the state store was down or slow.",
)
STATE_APPLIED_INSERTS = Counter(
    "picker_state_applied_inserts", "Prefix-index inserts from other picker processes applied to the local index."
)
STATE_SKIPPED_INSERTS = Counter(
    "picker_state_skipped_inserts",
    "Prefix-index inserts from other picker processes not applied: an endpoint or index this process does not have.",
)
STATE_BAD_MESSAGES = Counter(
    "picker_state_bad_messages", "State-store stream entries that could not be decoded, skipped."
)
STATE_MISSED_BATCHES = Counter(
    "picker_state_missed_batches",
    "Batches of other processes never read (sequence gaps: trimmed from the stream before they were read).",
)
STATE_STORE_ERRORS = Counter(
    "picker_state_store_errors", "Failed state-store operations, by operation (publish, read).", ("operation",)
)
STATE_STORE_CONNECTED = Gauge(
    "picker_state_store_connected", "1 while the state store answers (the last publish and read succeeded), else 0."
)

# -- completion-time cost (picker/latency/e2e.py) ----------------------------------------------
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
E2E_PREDICTION_RATIO = Histogram(
    "picker_e2e_prediction_ratio",
    "Per request routed by e2e-cost-scorer: observed over predicted at the chosen endpoint (1 = exact), "
    "for the completion time (part=total) and, for streamed responses, its first token (ttft) and the rest (decode).",
    ("model_name", "part"),
    buckets=_RATIO_BUCKETS,
)
E2E_OUTPUT_TOKENS_RATIO = Histogram(
    "picker_e2e_output_tokens_ratio",
    "Per request routed by e2e-cost-scorer: its completion tokens over the tokens expected, by where the "
    "expectation came from (max_tokens, session, model, default).",
    ("model_name", "source"),
    buckets=_RATIO_BUCKETS,
)

# -- prefix-cache routing (picker/prefix) ------------------------------------------------------
PREFIX_INDEXER_SIZE = Gauge(
    "inference_extension_prefix_indexer_size", "Entries in the approximate prefix index (all endpoints' LRUs)."
)
PREFIX_INDEXER_HIT_RATIO = Histogram(
    "inference_extension_prefix_indexer_hit_ratio",
    "Per request, the best endpoint's matched prefix blocks over the prompt's blocks.",
    buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
PREFIX_INDEXER_HIT_BYTES = Histogram(
    "inference_extension_prefix_indexer_hit_bytes",
    "Per request, the best endpoint's matched prefix length in bytes (blocks × block tokens × 4).",
    buckets=_SIZE_BUCKETS,
)
PREFIX_EXPECTED_HIT_RATIO = Histogram(
    "picker_prefix_expected_hit_ratio",
    "Per routed request, the share of its prompt tokens the picker expects the chosen endpoint to have cached.",
    ("model_name", "endpoint"),
    buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
PREFIX_PROMPT_TOKENS = Counter(
    "picker_prefix_prompt_tokens",
    "Prompt tokens of completed requests (usage), the denominator of the cached-token ratios.",
    ("model_name", "endpoint"),
)
PREFIX_EXPECTED_CACHED_TOKENS = Counter(
    "picker_prefix_expected_cached_tokens",
    "Prompt tokens the picker expected to be cached at the chosen endpoint, for completed requests.",
    ("model_name", "endpoint"),
)
PREFIX_SAVED_PREFILL_TOKENS = Counter(
    "picker_prefix_saved_prefill_tokens",
    "Prompt tokens the engine actually served from its prefix cache (usage cached_tokens): prefill saved.",
    ("model_name", "endpoint"),
)
PREFIX_SAVED_GPU_SECONDS = Counter(
    "picker_prefix_saved_gpu_seconds",
    "Estimated prefill GPU time saved: cached tokens / the endpoint's learnt prefill rate.",
    ("model_name", "endpoint"),
)
PREFIX_FIRST_BLOCK = Counter(
    "picker_prefix_first_block",
    "Routed requests by whether their first prompt block was seen before (seen=false: a new prompt start).",
    ("model_name", "tenant", "seen"),
)
PREFIX_TOKENIZE_SEGMENTS = Counter(
    "picker_prefix_tokenize_segments",
    "Prompt text segments tokenized (outcome=miss) or reused from the token cache (outcome=hit).",
    ("outcome",),
)
