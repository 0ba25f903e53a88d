"""Merging the `--workers` metrics pages: counters summed (a dead worker's kept), gauges as
each means, every picker gauge with a rule."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from picker.telemetry import metrics
from picker.workers.metrics import GAUGE_MERGE, Families, FamiliesCollector, merge, parse_page, retire


def worker_page(routed: float, in_flight: float, ready_pods: float, latency: float) -> Families:
    """A worker's page as its own registry writes it."""
    registry = CollectorRegistry()
    Counter("picker_requests_routed", "routed", ("endpoint",), registry=registry).labels("a").inc(routed)
    Gauge("picker_in_flight_requests", "in flight", ("endpoint",), registry=registry).labels("a").set(in_flight)
    Gauge("inference_pool_ready_pods", "ready", ("name",), registry=registry).labels("p").set(ready_pods)
    Histogram("picker_scrape_duration_seconds", "d", buckets=(0.1, 1.0), registry=registry).observe(latency)
    return parse_page(generate_latest(registry).decode())


def values(families: Families) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_a_counter_incremented_in_two_workers_shows_the_sum() -> None:
    merged = values(merge([worker_page(3, 1, 2, 0.05), worker_page(4, 2, 3, 0.5)]))
    assert merged["picker_requests_routed_total", (("endpoint", "a"),)] == 7
    assert merged["picker_scrape_duration_seconds_bucket", (("le", "0.1"),)] == 1
    assert merged["picker_scrape_duration_seconds_bucket", (("le", "1.0"),)] == 2
    assert merged["picker_scrape_duration_seconds_count", ()] == 2
    assert not any(name.endswith("_created") for name, _ in merged)


def test_gauges_merge_as_they_mean() -> None:
    merged = values(merge([worker_page(3, 1, 2, 0.05), worker_page(4, 2, 3, 0.5)]))
    assert merged["picker_in_flight_requests", (("endpoint", "a"),)] == 3  # what each holds: summed
    assert merged["inference_pool_ready_pods", (("name", "p"),)] == 2  # the worst worker's view


def test_a_dead_workers_counts_stay_in_the_sum_and_its_gauges_leave() -> None:
    retired = retire(None, worker_page(5, 9, 2, 0.05))
    retired = retire(retired, worker_page(1, 9, 2, 0.05))
    merged = values(merge([worker_page(2, 1, 3, 0.5)], retired))
    assert merged["picker_requests_routed_total", (("endpoint", "a"),)] == 8
    assert merged["picker_scrape_duration_seconds_count", ()] == 3
    assert merged["picker_in_flight_requests", (("endpoint", "a"),)] == 1


def test_the_merged_families_render_as_one_page() -> None:
    registry = CollectorRegistry()
    collector = FamiliesCollector()
    registry.register(collector)
    collector.families = merge([worker_page(3, 1, 2, 0.05), worker_page(4, 2, 3, 0.5)])
    page = generate_latest(registry).decode()
    assert "# TYPE picker_requests_routed_total counter" in page
    assert 'picker_requests_routed_total{endpoint="a"} 7.0' in page
    assert values(parse_page(page)) == values(collector.families)


def test_every_picker_gauge_has_a_merge_rule() -> None:
    gauges = {m._name for m in vars(metrics).values() if isinstance(m, Gauge)}
    assert gauges and gauges <= set(GAUGE_MERGE), sorted(gauges - set(GAUGE_MERGE))
