"""`EndpointDurations`, the scrape-duration histogram observed once per scrape result: read by
Prometheus exactly as prometheus_client's own Histogram with the same observations reads."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from picker.telemetry.metrics import EndpointDurations

BUCKETS = (0.0005, 0.001, 0.01, 1.0)
# on a bound, between bounds, past the last one, and zero
OBSERVED = {"10.0.0.1:8000": (0.0005, 0.0007, 0.2, 3.0, 0.0), "10.0.0.2:8000": (0.001,)}


def exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_the_page_is_prometheus_clients_for_the_same_observations() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    durations = EndpointDurations("picker_test_seconds", "Test durations.", BUCKETS, registry=ours)
    histogram = Histogram("picker_test_seconds", "Test durations.", ("endpoint",), buckets=BUCKETS, registry=theirs)
    for endpoint, values in OBSERVED.items():
        for value in values:
            durations.labels(endpoint).observe(value)
            histogram.labels(endpoint).observe(value)
    assert exposition(ours) == exposition(theirs)
    assert ours.get_sample_value("picker_test_seconds_count", {"endpoint": "10.0.0.1:8000"}) == 5


def test_a_removed_endpoint_leaves_the_page_and_starts_again_from_zero() -> None:
    registry = CollectorRegistry()
    durations = EndpointDurations("picker_test_seconds", "Test durations.", BUCKETS, registry=registry)
    durations.labels("10.0.0.1:8000").observe(0.002)
    durations.labels("10.0.0.2:8000").observe(0.002)
    durations.remove("10.0.0.1:8000")
    assert registry.get_sample_value("picker_test_seconds_count", {"endpoint": "10.0.0.1:8000"}) is None
    assert registry.get_sample_value("picker_test_seconds_count", {"endpoint": "10.0.0.2:8000"}) == 1
    durations.labels("10.0.0.1:8000").observe(0.002)
    assert registry.get_sample_value("picker_test_seconds_count", {"endpoint": "10.0.0.1:8000"}) == 1
