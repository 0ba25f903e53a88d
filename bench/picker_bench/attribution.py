"""Where one system's prefix-cache hits went: every prompt token of a run, attributed offline.

The request records (`requests/<system>.jsonl`: pod, due time, latency, cached tokens) are
replayed in the order the requests were dispatched, against a model of each pod's KV cache: an
LRU of the pod's `num_gpu_blocks` blocks of the fleet's block size (`picker_bench.bound.BlockLRU`),
into which each request's prompt blocks are inserted at the pod that served it. Each request's
prompt tokens then fall, in this order, into:

- `hit`: what the engine reported cached (`cached_tokens`);
- `model_only`: cached on the chosen pod according to the model but not the engine: typically an
  earlier request with that prefix was still prefilling there (engines share only computed
  blocks), or the engine evicted sooner than the model (its cache also holds the running
  requests' blocks and their outputs);
- `other_pod`: another pod's model cache held a longer prefix at dispatch time: a router that
  knew could have hit it;
- `evicted_chosen`: the chosen pod had held those blocks before, and evicted them;
- `evicted_everywhere`: an earlier prompt had them, the chosen pod never did, no pod holds them now;
- `never_seen`: no earlier prompt had them, and the block holding the last prompt token (always
  computed) and the partial last block: no router can avoid these.

The missed leading blocks up to the infinite-cache prefix (blocks any earlier prompt had) are
the ones a router could have turned into hits, in the middle four categories. The model also
predicts each request's cached tokens; how often it agrees with the engine says how far to trust
the split. For `other_pod` misses the records also tell part of why the scheduler chose as it did:
how many requests the holder (the pod with the longest prefix, the least busy of those on a tie)
and the chosen pod had in flight at dispatch time, from the records' due and end times.

The model's cache follows the order requests were *due* (time waiting for the client's
concurrency cap included) and counts only prompt blocks, so it is a model, not a replay of the
engines; one pass, O(blocks) per request.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from picker_bench.bound import BlockLRU, PromptBlocks, leading_run
from picker_bench.loadgen import RequestResult

# Category -> label, in the order each request's prompt tokens are split.
CATEGORIES = {
    "hit": "hit",
    "model_only": "cached on the chosen pod per the model only",
    "other_pod": "on another pod",
    "evicted_chosen": "evicted from the chosen pod",
    "evicted_everywhere": "evicted everywhere",
    "never_seen": "never seen",
}


@dataclass(frozen=True, slots=True)
class Attribution:
    """One system's prompt tokens by category (module doc), and how far the cache model agrees."""

    requests: int  # successful requests with a known pod: the ones attributed
    prompt_tokens: int
    tokens: dict[str, int]  # category -> prompt tokens, summing to prompt_tokens
    model_hit_tokens: int  # cached tokens the model predicts on the chosen pods
    model_exact: float  # share of requests whose predicted cached tokens equal the engine's
    other_pod_requests: int  # requests with `other_pod` tokens
    holder_busier: float | None  # share of those whose holder had more requests in flight than the chosen pod
    in_flight_gap_p50: float | None  # median over those of (holder's in flight - chosen pod's)

    @property
    def model_ratio(self) -> float:
        """The cached share of the prompt tokens the model predicts (0 for none)."""
        return self.model_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def share(self, category: str) -> float:
        """The category's tokens / all attributed prompt tokens (0 for none)."""
        return self.tokens[category] / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> str:
        """One line: hit and model, the avoidable misses by cause, the unavoidable rest."""
        avoidable = ", ".join(
            f"{self.share(key) * 100:.1f}% {CATEGORIES[key]}"
            for key in ("other_pod", "evicted_chosen", "evicted_everywhere", "model_only")
        )
        line = (
            f"{self.share('hit') * 100:.1f}% hit (model {self.model_ratio * 100:.1f}%, "
            f"exact on {self.model_exact * 100:.0f}% of requests); missed: {avoidable}; "
            f"{self.share('never_seen') * 100:.1f}% never seen"
        )
        if self.holder_busier is not None:
            line += (
                f"; on another pod in {self.other_pod_requests} requests, the holder busier in "
                f"{self.holder_busier * 100:.0f}% (median {self.in_flight_gap_p50:+g} in flight)"
            )
        return line


def attribute(
    results: Sequence[RequestResult],
    blocks: Sequence[Sequence[PromptBlocks]],
    block_size: int,
    pod_blocks: int,
) -> Attribution:
    """Attribute the prompt tokens of `results` (module doc); `blocks[session][turn]` are the
    workload's prompts in the fleet's blocks of `block_size` tokens, `pod_blocks` each pod's KV blocks."""
    served = sorted(
        ((r, r.pod) for r in results if r.error is None and r.pod is not None),
        key=lambda served: (served[0].due_s, served[0].session, served[0].turn),
    )
    pods = sorted({pod for _, pod in served})
    caches = {pod: BlockLRU(pod_blocks) for pod in pods}
    bit = {pod: 1 << i for i, pod in enumerate(pods)}
    everyone = (1 << len(pods)) - 1
    ever: dict[int, int] = {}  # block -> mask of the pods that held it at some point
    ends: dict[str, list[float]] = {pod: [] for pod in pods}  # per pod: end times of requests in flight (heap)
    tokens = dict.fromkeys(CATEGORIES, 0)
    prompt_total = model_hits = exact = 0
    gaps: list[int] = []
    for r, pod in served:
        prompt = blocks[r.session][r.turn]
        hashes, limit = prompt.hashes, prompt.limit
        for heap in ends.values():
            while heap and heap[0] <= r.due_s:
                heapq.heappop(heap)
        held = {name: cache.cached_prefix(hashes, limit) for name, cache in caches.items()}
        chosen = held.pop(pod)
        mine = bit[pod]
        seen = _ever_held(ever, hashes, limit, everyone)
        once = _ever_held(ever, hashes, limit, mine)
        holder = min(held, key=lambda name: (-held[name], len(ends[name])), default=None)
        other = held[holder] if holder is not None else 0
        # Cut points in tokens, each category running from the previous cut to its own.
        cut = r.cached_tokens
        tokens["hit"] += cut
        for key, end in (
            ("model_only", chosen),
            ("other_pod", other),
            ("evicted_chosen", once),
            ("evicted_everywhere", seen),
        ):
            reach = min(max(cut, end * block_size), r.prompt_tokens)
            tokens[key] += reach - cut
            if key == "other_pod" and reach > cut and holder is not None:
                gaps.append(len(ends[holder]) - len(ends[pod]))
            cut = reach
        tokens["never_seen"] += max(0, r.prompt_tokens - cut)
        prompt_total += r.prompt_tokens
        model_hits += chosen * block_size
        exact += chosen * block_size == r.cached_tokens
        caches[pod].touch(hashes)
        for h in hashes:
            ever[h] = ever.get(h, 0) | mine
        if r.e2e_s is not None:
            heapq.heappush(ends[pod], r.due_s + r.e2e_s)
    return Attribution(
        requests=len(served),
        prompt_tokens=prompt_total,
        tokens=tokens,
        model_hit_tokens=model_hits,
        model_exact=exact / len(served) if served else 0.0,
        other_pod_requests=len(gaps),
        holder_busier=sum(g > 0 for g in gaps) / len(gaps) if gaps else None,
        in_flight_gap_p50=statistics.median(gaps) if gaps else None,
    )


def _ever_held(ever: dict[int, int], hashes: Sequence[int], limit: int, pods: int) -> int:
    """How many leading blocks of `hashes` (at most `limit`) one of the `pods` (a mask) ever held.
    A pod held a block only if it held every block before it in the chain, so these form a
    leading run, found by binary search."""
    return leading_run(limit, lambda j: ever.get(hashes[j], 0) & pods != 0)
