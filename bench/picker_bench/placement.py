"""What placement alone can do for prefix hits: a workload's prompts replayed, in arrival order,
over one LRU cache per pod (`picker_bench.bound.BlockLRU`) under three placements, load aside.

* `affinity`: each prompt to the pod holding its longest cached prefix, ties (and prompts no pod
  holds) to the pod that has computed the fewest blocks: what a perfect cache-aware router does.
* `reuse-class`: the same, except that a prompt with little cached (under a fifth of its blocks)
  whose *class* has rarely been reused goes to a "churn" half of the pods, so its blocks, which
  will most likely never hit, do not push reusable ones out of the other half. A class is
  (whether the prompt hit anything, its length: under 8k, under 32k, longer); its reuse rate is
  learnt online: the share of its prompts of which a later prompt hit a block it computed first.
  This is as far as a router can tell reuse apart without knowing the future.
* `future-oracle`: the same segregation, knowing which prompts' blocks will ever be hit again.
  Not a router: the gap to `reuse-class` is what a better reuse predictor could be worth.

Each figure comes with the work imbalance it costs (the busiest pod's computed blocks over the
mean): segregation that piles work on a few pods buys hits with queueing. Engines evict least
recently used, so a router beats the LRU fleet figure (`picker_bench.bound`) only by keeping
unreused blocks away from reused ones; this says how much of that routing can do on a workload.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from picker_bench.bound import BlockLRU
from picker_bench.runner import arrival_order, pod_blocks, prompt_blocks
from picker_bench.systems import FleetOptions
from picker_bench.workloads import Session

CHURN_BELOW = 0.2  # a class reused less often than this is sent to the churn pods
LITTLE_CACHED = 0.2  # a prompt with less than this share of its blocks cached may be moved
LENGTH_BUCKETS = (8_000, 32_000)  # prompt tokens: the class's length boundaries
MATURITY = 200  # prompts after one before its reuse is judged

Access = tuple[Sequence[int], int]  # a prompt's block hashes and how many leading blocks can hit


@dataclass(frozen=True, slots=True)
class PlacementResult:
    """One placement's hit ratio (of all prompt blocks) and work imbalance (max / mean)."""

    hit_ratio: float
    imbalance: float


@dataclass(slots=True)
class _Prompt:
    index: int
    hashes: Sequence[int]
    limit: int
    matched: list[int]


Placement = Callable[[_Prompt], int]


class _Fleet:
    """Per-pod LRUs and the blocks each pod computed."""

    def __init__(self, pods: int, capacity_blocks: int) -> None:
        self.caches = [BlockLRU(capacity_blocks) for _ in range(pods)]
        self.work = [0] * pods

    def lightest(self, pods: Sequence[int]) -> int:
        return min(pods, key=self.work.__getitem__)

    def holder(self, prompt: _Prompt, pods: Sequence[int]) -> int:
        """The pod of `pods` holding the longest prefix of `prompt`, the lightest of ties."""
        best = max(prompt.matched[p] for p in pods)
        return self.lightest([p for p in pods if prompt.matched[p] == best])


def _replay(accesses: Sequence[Access], fleet: _Fleet, place: Placement, seen: Callable[[_Prompt, int], None]) -> float:
    hits = total = 0
    for index, (hashes, limit) in enumerate(accesses):
        prompt = _Prompt(index, hashes, limit, [c.cached_prefix(hashes, limit) for c in fleet.caches])
        pod = place(prompt)
        hits += prompt.matched[pod]
        total += len(hashes)
        fleet.work[pod] += len(hashes) - prompt.matched[pod]
        fleet.caches[pod].touch(hashes)
        seen(prompt, pod)
    return hits / total if total else 0.0


def _result(
    accesses: Sequence[Access],
    pods: int,
    capacity_blocks: int,
    make: Callable[[_Fleet], tuple[Placement, Callable[[_Prompt, int], None]]],
) -> PlacementResult:
    fleet = _Fleet(pods, capacity_blocks)
    place, seen = make(fleet)
    ratio = _replay(accesses, fleet, place, seen)
    mean = sum(fleet.work) / pods
    return PlacementResult(ratio, max(fleet.work) / mean if mean else 1.0)


def _ignore(prompt: _Prompt, pod: int) -> None:
    return None


def _affinity(fleet: _Fleet) -> tuple[Placement, Callable[[_Prompt, int], None]]:
    everyone = range(len(fleet.caches))
    return (lambda prompt: fleet.holder(prompt, everyone)), _ignore


def _segregated(fleet: _Fleet, churn: Callable[[_Prompt], bool]) -> Placement:
    """Prompts `churn` picks to the churn half, the rest by affinity within the other half (or
    to a churn pod holding more of them)."""
    pods = len(fleet.caches)
    churn_pods, keep_pods = range(pods // 2), range(pods // 2, pods)

    def place(prompt: _Prompt) -> int:
        if churn(prompt):
            return fleet.lightest(churn_pods)
        if max(prompt.matched) == 0:
            return fleet.lightest(keep_pods)
        return fleet.holder(prompt, range(pods))

    return place


def _little_cached(prompt: _Prompt) -> bool:
    return max(prompt.matched) < LITTLE_CACHED * max(1, len(prompt.hashes))


class _ReuseClasses:
    """Per class, of its prompts that computed blocks first, the share a later prompt hit.

    A prompt counts once `MATURITY` prompts have arrived after it: a reuse comes later than the
    prompt, so counting the newest prompts would take every class for unreused at first."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.first: dict[int, int] = {}  # block -> the prompt that computed it first
        self.class_of: dict[int, tuple[bool, int]] = {}  # prompts that computed blocks first
        self.reused: set[int] = set()  # of those, the ones a later prompt hit
        self.pending: deque[int] = deque()  # not yet counted
        self.counted: dict[tuple[bool, int], list[int]] = {}  # class -> [prompts, reused]

    def key(self, prompt: _Prompt) -> tuple[bool, int]:
        tokens = len(prompt.hashes) * self.block_tokens
        return max(prompt.matched) > 0, sum(tokens >= edge for edge in LENGTH_BUCKETS)

    def rate(self, prompt: _Prompt) -> float:
        counts = self.counted.get(self.key(prompt))
        return counts[1] / counts[0] if counts else 1.0  # nothing known: assume reused

    def record(self, prompt: _Prompt, pod: int) -> None:
        for block in prompt.hashes[: prompt.matched[pod]]:
            origin = self.first.get(block)
            if origin is not None:
                self.reused.add(origin)
        key = self.key(prompt)
        for block in prompt.hashes:
            if block not in self.first:
                self.first[block] = prompt.index
                self.class_of[prompt.index] = key
        if prompt.index in self.class_of:
            self.pending.append(prompt.index)
        while self.pending and self.pending[0] <= prompt.index - MATURITY:
            done = self.pending.popleft()
            counts = self.counted.setdefault(self.class_of[done], [0, 0])
            counts[0] += 1
            counts[1] += done in self.reused


def placement_results(
    accesses: Sequence[Access], pods: int, capacity_blocks: int, block_tokens: int
) -> dict[str, PlacementResult]:
    """The three placements (module docstring) of `accesses`, in arrival order, over `pods` pods
    of `capacity_blocks` blocks of `block_tokens` tokens each."""
    last_use: dict[int, int] = {}
    for index, (hashes, limit) in enumerate(accesses):
        for block in hashes[:limit]:
            last_use[block] = index

    def reuse_class(fleet: _Fleet) -> tuple[Placement, Callable[[_Prompt, int], None]]:
        classes = _ReuseClasses(block_tokens)
        return _segregated(fleet, lambda p: _little_cached(p) and classes.rate(p) < CHURN_BELOW), classes.record

    def future_oracle(fleet: _Fleet) -> tuple[Placement, Callable[[_Prompt, int], None]]:
        def never_again(p: _Prompt) -> bool:
            return _little_cached(p) and all(last_use.get(b, -1) <= p.index for b in p.hashes)

        return _segregated(fleet, never_again), _ignore

    if pods < 2:
        raise ValueError("placement needs at least two pods")
    return {
        "affinity": _result(accesses, pods, capacity_blocks, _affinity),
        "reuse-class": _result(accesses, pods, capacity_blocks, reuse_class),
        "future-oracle": _result(accesses, pods, capacity_blocks, future_oracle),
    }


def placement_of(sessions: Sequence[Session], fleet: FleetOptions) -> dict[str, PlacementResult]:
    """`placement_results` of `sessions`' prompts in arrival order on `fleet`'s pods."""
    blocks = prompt_blocks(sessions, fleet.block_size)
    accesses = [(blocks[i][t].hashes, blocks[i][t].limit) for i, t in arrival_order(sessions)]
    return placement_results(accesses, fleet.pods, pod_blocks(fleet), fleet.block_size)


def placement_text(results: dict[str, PlacementResult]) -> str:
    """One line: each placement's hit ratio and the work imbalance it costs."""
    parts = (f"{name} {r.hit_ratio:.1%} (imbalance {r.imbalance:.2f})" for name, r in results.items())
    return "placement alone, load aside: " + ", ".join(parts)
