"""`candidate-narrowing-filter`: large pools are narrowed before the scorers to the prefix
holders, the least loaded and a few at random; pools at or below the bound are left alone."""

from __future__ import annotations

import json
import random

import pytest

from picker.config.runtime import RuntimeHolder
from picker.config.schema import ConfigError
from picker.datastore.endpoint import EndpointState
from picker.datastore.store import Datastore
from picker.framework.cycle_state import CycleState
from picker.prefix.narrowing import NARROWED_CANDIDATES, CandidateNarrowingFilter
from picker.prefix.plugins import ENGINE_CACHED_TOKENS_KEY, PREFIX_MATCH_KEY, PrefixCacheScorer, PrefixMatch
from picker.prefix.prompt_blocks import TOKENS, PromptBlocks
from picker.scheduling.pickers import MaxScorePicker
from picker.scheduling.profile_handler import SingleProfileHandler
from picker.scheduling.scheduler import Scheduler, SchedulerProfile, WeightedScorer
from picker.scheduling.scorers import KVCacheUtilizationScorer, QueueScorer
from picker.telemetry.decisions import DecisionLog
from tests.unit.test_scheduling_plugins import request, state

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def busy_pool(count: int, rng: random.Random) -> list[EndpointState]:
    """Every endpoint with a queue of 3 to 9 and some KV usage."""
    return [state(i, waiting=rng.randrange(3, 10), running=4, kv=rng.random()) for i in range(count)]


def with_prefix(candidates: list[EndpointState], held: dict[int, int], read_by_producer: bool = False) -> CycleState:
    """A 10-block prompt of which candidate i holds held[i] leading blocks (with each
    candidate's blocks read for this list, as the prefix producer leaves them, or not)."""
    cycle_state = CycleState()
    blocks = PromptBlocks(TOKENS, tuple(range(10)), 16, 160, 0)
    matched = {candidates[i].address: n for i, n in held.items()}
    if read_by_producer:
        depths = [held.get(i, 0) for i in range(len(candidates))]
        cycle_state[PREFIX_MATCH_KEY] = PrefixMatch(blocks, matched, candidates=candidates, held=depths)
    else:
        cycle_state[PREFIX_MATCH_KEY] = PrefixMatch(blocks, matched)
    return cycle_state


@pytest.mark.parametrize("count", [1, 8, 63, 64])
def test_at_or_below_the_bound_nothing_changes(count: int) -> None:
    candidates = busy_pool(count, random.Random(count))
    cycle_state = with_prefix(candidates, {0: 3})
    assert CandidateNarrowingFilter("n").filter(request(), cycle_state, candidates) is candidates
    assert NARROWED_CANDIDATES not in (cycle_state.explained() or {})


@pytest.mark.parametrize("seed", range(20))
def test_the_holder_of_a_long_prefix_is_always_kept(seed: int) -> None:
    rng = random.Random(seed)
    candidates = busy_pool(300, rng)
    holder = rng.randrange(300)
    # the busiest endpoint, holding the prompt; 40 others hold its first block only
    candidates[holder] = state(holder, waiting=50, running=4, kv=1.0)
    shallow = {i: 1 for i in rng.sample([i for i in range(300) if i != holder], 40)}
    cycle_state = with_prefix(candidates, {**shallow, holder: 9})
    narrowing = CandidateNarrowingFilter("n", rng=random.Random(seed))
    kept = narrowing.filter(request(), cycle_state, candidates)
    assert candidates[holder] in kept
    assert len(kept) <= 16 + 16 + 4
    assert list(kept) == sorted(kept, key=candidates.index)  # pool order
    assert cycle_state.explain()[NARROWED_CANDIDATES] == [{"filter": "n", "from": 300, "to": len(kept)}]


@pytest.mark.parametrize("seed", range(10))
def test_the_producers_reads_narrow_as_the_filters_own(seed: int) -> None:
    rng = random.Random(seed)
    candidates = busy_pool(300, rng)
    held = {i: rng.randrange(1, 10) for i in rng.sample(range(300), rng.choice([1, 10, 40]))}
    kept = [
        CandidateNarrowingFilter("n", rng=random.Random(seed)).filter(
            request(), with_prefix(candidates, held, read_by_producer), candidates
        )
        for read_by_producer in (False, True)
    ]
    assert kept[0] == kept[1]
    # A list other than the one the producer read (an earlier filter's) is read again.
    fewer = candidates[:200]
    state_read = with_prefix(candidates, held, read_by_producer=True)
    narrowed = CandidateNarrowingFilter("n", rng=random.Random(seed)).filter(request(), state_read, fewer)
    assert narrowed == CandidateNarrowingFilter("n", rng=random.Random(seed)).filter(
        request(), with_prefix(candidates, held), fewer
    )


def test_what_the_engines_report_cached_counts_as_held() -> None:
    candidates = busy_pool(200, random.Random(1))
    cycle_state = CycleState()
    cycle_state[ENGINE_CACHED_TOKENS_KEY] = {candidates[150].address: 512}
    kept = CandidateNarrowingFilter("n", prefix_holders=1, exploration=0).filter(request(), cycle_state, candidates)
    assert candidates[150] in kept


@pytest.mark.parametrize("seed", range(20))
def test_the_least_loaded_is_always_kept(seed: int) -> None:
    rng = random.Random(seed)
    candidates = busy_pool(500, rng)
    idle = rng.randrange(500)
    candidates[idle] = state(idle, waiting=0, running=4, kv=0.9)  # fullest KV, emptiest queue
    kept = CandidateNarrowingFilter("n", least_loaded=1, rng=random.Random(seed)).filter(
        request(), CycleState(), candidates
    )
    assert candidates[idle] in kept
    assert len(kept) <= 16 + 1 + 4


def test_equal_loads_do_not_always_keep_the_same_endpoints() -> None:
    candidates = [state(i) for i in range(100)]
    narrowing = CandidateNarrowingFilter("n", exploration=0, rng=random.Random(7))
    seen = {c.address for _ in range(20) for c in narrowing.filter(request(), CycleState(), candidates)}
    assert len(seen) > 16


def test_a_profile_picks_the_holder_among_narrowed_candidates() -> None:
    """Routing a large pool: the scores over the narrowed candidates still find the holder."""
    candidates = busy_pool(256, random.Random(3))
    candidates[200] = state(200, waiting=4, running=4, kv=0.5)
    profile = SchedulerProfile(
        "default",
        [CandidateNarrowingFilter("candidate-narrowing-filter", rng=random.Random(3))],
        [
            WeightedScorer(QueueScorer("queue-scorer"), 2),
            WeightedScorer(KVCacheUtilizationScorer("kv-cache-utilization-scorer"), 2),
            WeightedScorer(PrefixCacheScorer("prefix-cache-scorer"), 3),
        ],
        MaxScorePicker("max-score-picker"),
    )
    result = profile.run(request(), with_prefix(candidates, {200: 10}), candidates)
    assert result is not None
    assert result.targets == (candidates[200],)
    assert len(result.candidates) < 64


def test_max_candidates_zero_never_narrows() -> None:
    candidates = busy_pool(300, random.Random(2))
    assert CandidateNarrowingFilter("n", max_candidates=0).filter(request(), CycleState(), candidates) is candidates


def test_every_profile_narrows_by_default_and_a_configured_filter_replaces_it() -> None:
    holder = RuntimeHolder(Datastore())
    default = holder.load_text(HEADER + "plugins: [{type: queue-scorer}]\n")
    (narrowing,) = default.scheduler.profiles["default"].filters
    assert isinstance(narrowing, CandidateNarrowingFilter)
    assert (narrowing.max_candidates, narrowing.prefix_holders, narrowing.least_loaded) == (64, 16, 16)
    configured = holder.load_text(
        HEADER + "plugins:\n- type: queue-scorer\n- type: candidate-narrowing-filter\n"
        "  parameters: {maxCandidates: 128, leastLoaded: 32, prefixHolders: 8, exploration: 2}\n"
    )
    (narrowing,) = configured.scheduler.profiles["default"].filters
    assert isinstance(narrowing, CandidateNarrowingFilter)
    assert (narrowing.max_candidates, narrowing.least_loaded, narrowing.prefix_holders) == (128, 32, 8)
    assert narrowing.exploration == 2


@pytest.mark.parametrize(
    ("parameters", "error"),
    [
        ("{maxCandidates: many}", "maxCandidates: must be an integer"),
        ("{leastLoaded: 0}", "leastLoaded: must be >= 1"),
        ("{maxCandidates: 20}", "must not exceed maxCandidates (20)"),
        ("{bound: 5}", "bound"),
    ],
)
def test_parameters_are_strict(parameters: str, error: str) -> None:
    holder = RuntimeHolder(Datastore())
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace(")", r"\)")):
        holder.load_text(
            HEADER + f"plugins:\n- type: queue-scorer\n- type: candidate-narrowing-filter\n  parameters: {parameters}\n"
        )


def test_the_decision_log_explains_the_narrowing() -> None:
    """What /debug/decisions serves: the narrowed candidates, and from how many."""
    log = DecisionLog(capacity=1)
    profile = SchedulerProfile(
        "default",
        [CandidateNarrowingFilter("candidate-narrowing-filter")],
        [WeightedScorer(QueueScorer("queue-scorer"), 1)],
        MaxScorePicker("max-score-picker"),
    )
    scheduler = Scheduler(SingleProfileHandler("single-profile-handler"), [profile], log)
    scheduler.schedule(request(), busy_pool(100, random.Random(4)), CycleState())
    (entry,) = log.entries()
    json.dumps(entry)
    kept = len(entry["profiles"]["default"]["candidates"])
    assert kept <= 16 + 16 + 4
    assert entry["explain"][NARROWED_CANDIDATES] == [{"filter": "candidate-narrowing-filter", "from": 100, "to": kept}]
