"""One /metrics page for all `--workers`: the parent reads each worker's page and merges them.

Why not prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR): it covers the
picker's counters, gauges and histograms, but it cannot remove a series (`remove()` and
`clear()` only warn), so a departed endpoint's gauges and the previous `picker_config_info`
would stay on the page with their last values. Reading the workers' own pages keeps each
worker's series exactly as one process shows them.

Counters and histograms are summed over the workers, and a worker that died keeps its last
counts in the sum (a restart does not move the pod's counters back). Gauges are merged as
each one means (GAUGE_MERGE): a count of what each worker holds is summed, a view of the
shared pool is averaged, a worst case takes the max or min.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

Families = list[Metric]
_SampleKey = tuple[str, tuple[tuple[str, str], ...]]

_MERGES: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "mean": statistics.fmean,
    "max": max,
    "min": min,
}
# Every gauge the picker exports (tests check none is missing), and the process gauges of
# prometheus_client's default collectors.
GAUGE_MERGE: dict[str, str] = {
    # what each worker holds: the pod holds the sum
    "inference_objective_running_requests": "sum",
    "picker_in_flight_requests": "sum",
    "picker_extproc_streams_active": "sum",
    "inference_extension_flow_control_queue_size": "sum",
    "inference_extension_flow_control_queue_bytes": "sum",
    "inference_extension_prefix_indexer_size": "sum",  # each worker has its own index
    "process_resident_memory_bytes": "sum",
    "process_virtual_memory_bytes": "sum",
    "process_open_fds": "sum",
    # each worker's view of the same pool: their mean
    "inference_pool_average_kv_cache_utilization": "mean",
    "inference_pool_average_queue_size": "mean",
    "inference_pool_average_running_requests": "mean",
    "inference_pool_per_pod_queue_size": "mean",
    # worst cases: the pod is as stale, saturated or blind as its worst worker
    "inference_pool_ready_pods": "min",
    "picker_kv_events_state_known": "min",
    "picker_state_store_connected": "min",
    "picker_metrics_age_seconds": "max",
    "inference_extension_flow_control_pool_saturation": "max",
    # the same in every worker (1 per label set, a load time): one value
    "inference_extension_info": "max",
    "picker_config_info": "max",
    "picker_config_last_reload_success_timestamp_seconds": "max",
    "python_info": "max",
    "process_max_fds": "max",
    "process_start_time_seconds": "min",
}


def parse_page(text: str) -> Families:
    """A worker's /metrics page as metric families."""
    return list(text_string_to_metric_families(text))


def _key(sample: Sample) -> _SampleKey:
    return sample.name, tuple(sorted(sample.labels.items()))


def merge(live: Sequence[Families], retired: Families | None = None) -> Families:
    """The pod's families from the live workers' and what dead workers counted (`retired`,
    cumulative families only). `_created` samples are dropped: a sum of them means nothing."""
    sources: list[tuple[Families, bool]] = [(families, True) for families in live]
    if retired is not None:
        sources.append((retired, False))
    kinds: dict[str, Metric] = {}
    values: dict[str, dict[_SampleKey, list[float]]] = {}
    for families, alive in sources:
        for family in families:
            if family.type == "gauge" and not alive:
                continue
            kinds.setdefault(family.name, family)
            by_key = values.setdefault(family.name, {})
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    by_key.setdefault(_key(sample), []).append(sample.value)
    merged: Families = []
    for name, family in kinds.items():
        rule = GAUGE_MERGE.get(name, "max") if family.type == "gauge" else "sum"
        out = Metric(name, family.documentation, family.type, family.unit)
        for (sample_name, labels), observed in values[name].items():
            out.add_sample(sample_name, dict(labels), _MERGES[rule](observed))
        merged.append(out)
    return merged


def retire(retired: Families | None, last: Families) -> Families:
    """What dead workers counted, with one more dead worker's last page folded in."""
    return merge([], [*(retired or []), *last])  # as a dead source: its gauges are dropped


class FamiliesCollector:
    """A prometheus_client collector yielding families set from outside (the merged page)."""

    def __init__(self) -> None:
        self.families: Families = []

    def collect(self) -> Iterable[Metric]:
        return list(self.families)
