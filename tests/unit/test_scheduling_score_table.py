"""Fixed scenarios with their exact scores, totals and snapshots: the per-candidate work of the
scorers, the scheduler and the datastore was made cheaper (issue 29) without changing any
decision, and these pin what every decision was made of before that change."""

from __future__ import annotations

import math

from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.datastore.store import Datastore
from picker.framework.cycle_state import CycleState
from picker.prefix.plugins import PREFIX_MATCH_KEY, PrefixCacheScorer, PrefixMatch
from picker.prefix.prompt_blocks import TOKENS, PromptBlocks
from picker.scheduling.pickers import MaxScorePicker
from picker.scheduling.scheduler import SchedulerProfile, WeightedScorer
from picker.scheduling.scorers import (
    KVCacheUtilizationScorer,
    LoadAwareScorer,
    QueueScorer,
    RunningRequestsSizeScorer,
    TokenLoadScorer,
)
from tests.unit.test_scheduling_plugins import request, state

# (waiting, running, kv usage, in flight, in-flight tokens) of endpoints A..E
POOL = [(0, 4, 0.25, 2, 100), (3, 1, 0.5, 6, 900), (1, 0, 0.0, 0, 0), (0, 2, 1.0, 0, 50), (2, 2, 0.75, 9, 4000)]
# effective waiting max(waiting, in flight - running): 0, 5, 1, 0, 7
# effective running max(running, in flight - waiting): 4, 3, 0, 2, 7


def pool() -> list[EndpointState]:
    return [state(i, waiting=w, running=r, kv=kv, in_flight=n, tokens=t) for i, (w, r, kv, n, t) in enumerate(POOL)]


def prefix_state(candidates: list[EndpointState]) -> CycleState:
    """4 prompt blocks: B holds all 4 but is past the load bound, C holds 2, A 1."""
    a, b, c = (s.address for s in candidates[:3])
    cycle_state = CycleState()
    blocks = PromptBlocks(TOKENS, (11, 12, 13, 14), 16, 64, 0)
    cycle_state[PREFIX_MATCH_KEY] = PrefixMatch(blocks, {b: 4, c: 2, a: 1}, frozenset({b}))
    return cycle_state


def test_load_scorers_exact_scores() -> None:
    candidates, cycle_state = pool(), CycleState()
    table = [
        (QueueScorer("q"), [1.0, (7 - 5) / 7, (7 - 1) / 7, 1.0, 0.0]),
        (RunningRequestsSizeScorer("r"), [(7 - 4) / 7, (7 - 3) / 7, 1.0, (7 - 2) / 7, 0.0]),
        (KVCacheUtilizationScorer("kv"), [0.75, 0.5, 1.0, 0.0, 0.25]),
        (LoadAwareScorer("la"), [0.5, 0.5 * (1 - 5 / 128), 0.5 * (1 - 1 / 128), 0.5, 0.5 * (1 - 7 / 128)]),
        (TokenLoadScorer("t", 1000), [1 - 0.1, 1 - 0.9, 1.0, 1 - 0.05, 0.0]),
    ]
    for scorer, expected in table:
        assert list(scorer.score(request(), cycle_state, candidates)) == expected, scorer.plugin_type


def test_equal_loads_score_one_each() -> None:
    candidates = [state(i, waiting=2, running=1) for i in range(3)]
    assert QueueScorer("q").score(request(), CycleState(), candidates) == [1.0, 1.0, 1.0]


def test_prefix_scorer_exact_scores() -> None:
    candidates = pool()
    scorer = PrefixCacheScorer("p")
    assert list(scorer.score(request(), prefix_state(candidates), candidates)) == [0.25, 0.0, 0.5, 0.0, 0.0]
    assert list(scorer.score(request(), CycleState(), candidates)) == [0.0] * 5


def test_default_profile_totals_and_pick() -> None:
    """The reference default's weights (prefix 3, queue 2, kv 2), summed in profile order."""
    candidates = pool()
    profile = SchedulerProfile(
        "default",
        [],
        [
            WeightedScorer(QueueScorer("queue-scorer"), 2),
            WeightedScorer(KVCacheUtilizationScorer("kv-cache-utilization-scorer"), 2),
            WeightedScorer(PrefixCacheScorer("prefix-cache-scorer"), 3),
        ],
        MaxScorePicker("max-score-picker"),
    )
    result = profile.run(request(), prefix_state(candidates), candidates)
    assert result is not None
    queue = [1.0, (7 - 5) / 7, (7 - 1) / 7, 1.0, 0.0]
    kv = [0.75, 0.5, 1.0, 0.0, 0.25]
    prefix = [0.25, 0.0, 0.5, 0.0, 0.0]
    assert list(result.totals) == [0.0 + q * 2 + k * 2 + p * 3 for q, k, p in zip(queue, kv, prefix)]
    assert [t.address for t in result.targets] == [candidates[2].address]
    assert result.candidates == tuple(candidates)


def test_datastore_snapshots_follow_every_change() -> None:
    """Snapshots equal states built from scratch after each kind of change, in pool order."""
    datastore = Datastore()
    endpoints = [Endpoint(f"10.0.0.{i}", 8000) for i in range(4)]
    datastore.set_endpoints(endpoints)
    a, b, c, d = (e.address for e in endpoints)
    none = EndpointMetrics()
    loaded = EndpointMetrics(waiting_queue_size=2, kv_cache_usage=0.5, update_time=1.0)

    def expected(*rows: tuple[EndpointMetrics, int, int]) -> list[EndpointState]:
        return [EndpointState(e, m, n, t) for e, (m, n, t) in zip(endpoints, rows)]

    assert datastore.snapshot() == expected((none, 0, 0), (none, 0, 0), (none, 0, 0), (none, 0, 0))
    datastore.set_metrics(b, loaded)
    datastore.acquire(c, 30)
    datastore.acquire(c, 12)
    assert datastore.snapshot() == expected((none, 0, 0), (loaded, 0, 0), (none, 2, 42), (none, 0, 0))
    assert datastore.oldest_update_time() == 0.0  # a, c, d never scraped
    datastore.release(c, 12)
    datastore.refresh_update_times([(b, 5.0), (a, 5.0)])  # a never scraped: stays unscraped
    # An unchanged page's scrape builds no state: the states read its time from the datastore.
    assert datastore.snapshot() == expected((none, 0, 0), (loaded, 0, 0), (none, 1, 30), (none, 0, 0))
    assert [s.metrics_age(6.0) for s in datastore.snapshot()] == [math.inf, 1.0, math.inf, math.inf]
    assert datastore.metrics(b) == loaded.stamped(5.0) and datastore.scraped_at(a) == 0.0
    datastore.set_remote_in_flight({a: 3, c: 1}, {a: 7})
    assert datastore.snapshot() == expected((none, 3, 7), (loaded, 0, 0), (none, 2, 30), (none, 0, 0))
    assert datastore.snapshot([d, "10.9.9.9:1", a]) == [
        EndpointState(endpoints[3], none),
        EndpointState(endpoints[0], none, 3, 7),
    ]
    datastore.acquire(a, 1)
    assert datastore.snapshot()[0] == EndpointState(endpoints[0], none, 4, 8)
    datastore.set_remote_in_flight({}, {})
    datastore.set_endpoints([endpoints[2], Endpoint("10.0.0.9", 8000)])
    assert datastore.snapshot() == [
        EndpointState(endpoints[2], none, 1, 30),
        EndpointState(Endpoint("10.0.0.9", 8000), none),
    ]
    datastore.release(a, 1)  # left the pool meanwhile: nothing to release
    datastore.set_metrics(c, loaded.stamped(4.0))
    assert datastore.oldest_update_time() == 0.0
    datastore.set_metrics("10.0.0.9:8000", loaded.stamped(3.0))
    assert datastore.oldest_update_time() == 3.0
    datastore.refresh_update_times([("10.0.0.9:8000", 6.0)])
    assert datastore.oldest_update_time() == 4.0
    assert [s.address for s in datastore.snapshot()] == [c, "10.0.0.9:8000"]
