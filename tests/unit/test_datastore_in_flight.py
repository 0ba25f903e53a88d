"""The datastore's in-flight counts: this process's own, plus the other picker processes' that
state sync hands it (`set_remote_in_flight`), which every scheduling snapshot adds."""

from __future__ import annotations

import time
from dataclasses import replace

from picker.datastore.endpoint import EndpointMetrics
from picker.datastore.rate import RATE_MIN_COUNT, RATE_WINDOW_SECONDS
from picker.datastore.store import Datastore
from picker.discovery.static import parse_endpoint_flag

A, B = "10.0.0.5:8000", "10.0.0.6:8000"


def datastore() -> Datastore:
    store = Datastore()
    store.set_endpoints(parse_endpoint_flag(f"{A},{B}"))
    return store


def test_snapshots_add_the_other_processes_counts_to_the_own() -> None:
    store = datastore()
    store.acquire(A, 100)
    store.set_remote_in_flight({A: 2, B: 1, "10.0.0.9:8000": 5}, {A: 30, B: 7, "10.0.0.9:8000": 1})
    assert [(s.address, s.in_flight_requests, s.in_flight_tokens) for s in store.snapshot()] == [
        (A, 3, 130),
        (B, 1, 7),
    ]  # an endpoint outside the pool is not in it
    assert store.in_flight(A) == 1  # the process's own (its metric)
    assert store.local_in_flight() == [(A, 1, 100)]
    store.release(A, 100)
    assert store.local_in_flight() == []
    assert [s.in_flight_requests for s in store.snapshot([B, A])] == [1, 2]


def test_every_in_flight_listener_hears_of_every_acquire_and_release_until_removed() -> None:
    store = datastore()
    calls: list[int] = []
    others: list[int] = []

    def listener() -> None:
        calls.append(store.in_flight(A))

    store.add_in_flight_listener(listener)
    store.add_in_flight_listener(lambda: others.append(store.in_flight(A)))
    store.acquire(A, 1)
    store.acquire(A, 1)
    store.release(A, 1)
    assert calls == others == [1, 2, 1]
    store.remove_in_flight_listener(listener)
    store.release(A, 1)
    assert calls == [1, 2, 1] and others == [1, 2, 1, 0]


def test_flow_control_hears_when_other_processes_free_capacity() -> None:
    store = datastore()
    changes: list[None] = []
    store.add_load_listener(lambda: changes.append(None))
    store.set_remote_in_flight({A: 2}, {A: 10})
    assert changes == []  # more load elsewhere frees nothing
    store.set_remote_in_flight({A: 1, B: 4}, {A: 5, B: 4})
    assert len(changes) == 1
    store.set_remote_in_flight({}, {})  # their reports expired
    assert len(changes) == 2


def test_the_completion_rate_counts_releases_over_the_last_window() -> None:
    store = datastore()
    assert store.completion_rate(A) == 0.0  # none seen: unknown
    for _ in range(RATE_MIN_COUNT):
        assert store.completion_rate(A) == 0.0  # too few to tell a rate
        store.acquire(A, 10)
        store.release(A, 10)
    now = time.monotonic()
    assert store.completion_rate(A, now) == RATE_MIN_COUNT / RATE_WINDOW_SECONDS
    assert store.completion_rate(B, now) == 0.0
    assert store.completion_rate(A, now + RATE_WINDOW_SECONDS + 1) == 0.0  # they aged out
    store.set_endpoints(parse_endpoint_flag(B))
    assert store.completion_rate(A, now) == 0.0  # forgotten with the endpoint


def test_a_kept_snapshot_follows_every_change_and_is_never_shared() -> None:
    """The whole pool's snapshot is kept between changes; each change shows in the next one."""
    store = datastore()

    def view() -> list[tuple[str, int, int, int]]:
        return [
            (s.address, s.in_flight_requests, s.in_flight_tokens, s.metrics.waiting_queue_size)
            for s in store.snapshot()
        ]

    first = store.snapshot()
    first.clear()  # a caller's list is its own
    assert view() == [(A, 0, 0, 0), (B, 0, 0, 0)]
    store.acquire(A, 10)
    assert view() == [(A, 1, 10, 0), (B, 0, 0, 0)]
    store.set_metrics(B, EndpointMetrics(waiting_queue_size=3, update_time=1.0))
    assert view() == [(A, 1, 10, 0), (B, 0, 0, 3)]
    store.set_remote_in_flight({B: 2}, {B: 5})
    assert view() == [(A, 1, 10, 0), (B, 2, 5, 3)]
    store.release(A, 10)
    assert view() == [(A, 0, 0, 0), (B, 2, 5, 3)]
    store.set_endpoints(parse_endpoint_flag(B))
    assert view() == [(B, 2, 5, 3)]


def test_refreshed_update_times_keep_the_values_and_reach_snapshots() -> None:
    store = datastore()
    loads: list[None] = []
    store.add_load_listener(lambda: loads.append(None))
    metrics = EndpointMetrics(4, 5, 0.5, frozenset({"a"}), frozenset({"b"}), 2, 16, 100, update_time=1.0)
    store.set_metrics(A, metrics)
    assert store.snapshot()[0].metrics_age(3.0) == 2.0
    loads.clear()
    # B was never scraped and the third endpoint is not in the pool: both are skipped.
    store.refresh_update_times([(A, 2.5), (B, 2.5), ("10.0.0.9:8000", 2.5)])
    assert store.metrics(A) == replace(metrics, update_time=2.5)
    assert store.metrics(B) == EndpointMetrics()
    assert [s.metrics_age(3.0) for s in store.snapshot()] == [0.5, float("inf")]
    assert len(loads) == 1  # one batch, one notice
