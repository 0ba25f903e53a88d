"""The approximate prefix index: which endpoints were recently sent which prefix blocks.

Like the reference's indexer: a global map `block hash → endpoints` plus, per endpoint, an LRU
of the hashes it holds; evicting a hash from an endpoint's LRU removes the endpoint from the
global map. Keys are chained hashes (each encodes its whole prefix), so one index serves char
blocks and token blocks alike; seeds keep the two (and every model/salt/tenant scope) apart.

The index also knows which blocks each endpoint was sent *again* within the last
`reuse_window_s` (its reused working set): a prompt's one-off tail is never reused, a shared
prefix is. Placing new blocks where they push reused ones out of the cache costs future hits.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from picker.prefix.holders import NOBODY, HolderSets

DEFAULT_LRU_CAPACITY = 31250  # reference lruCapacityPerServer: ~500K tokens / 16 per block
DEFAULT_REUSE_WINDOW_S = 30.0


class _RecentReuse:
    """One endpoint's blocks reused within the window: last reuse time per block, and a log of
    reuses in time order so expiry is amortised O(1)."""

    __slots__ = ("last", "log")

    def __init__(self) -> None:
        self.last: dict[int, float] = {}
        self.log: deque[tuple[float, list[int]]] = deque()

    def touch(self, blocks: list[int], now: float) -> None:
        last = self.last
        for block in blocks:
            last[block] = now
        self.log.append((now, blocks))

    def expire(self, cutoff: float) -> None:
        log, last = self.log, self.last
        while log and log[0][0] < cutoff:
            when, blocks = log.popleft()
            for block in blocks:
                if last.get(block) == when:  # not reused again since
                    del last[block]


class PrefixIndex:
    """Block hashes per endpoint (by address), bounded by an LRU per endpoint."""

    def __init__(
        self,
        default_capacity: int = DEFAULT_LRU_CAPACITY,
        reuse_window_s: float = DEFAULT_REUSE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if default_capacity < 1:
            raise ValueError(f"LRU capacity must be >= 1, got {default_capacity}")
        self.default_capacity = default_capacity
        self.reuse_window_s = reuse_window_s
        self._clock = clock
        self._owners: dict[int, frozenset[str]] = {}  # interned: see picker.prefix.holders
        self._holder_sets = HolderSets()
        self._lrus: dict[str, OrderedDict[int, None]] = {}
        self._capacities: dict[str, int] = {}
        self._reuse: dict[str, _RecentReuse] = {}
        self._size = 0
        self.version = 0  # changes whenever what `match` answers may change

    def __len__(self) -> int:
        """Total LRU entries over all endpoints (the reference's indexer size)."""
        return self._size

    def endpoints(self) -> list[str]:
        return list(self._lrus)

    def capacity(self, endpoint: str) -> int | None:
        """The LRU capacity of `endpoint`, or None if it holds nothing yet."""
        return self._capacities.get(endpoint)

    def reused_blocks(self, endpoint: str) -> int:
        """Blocks `endpoint` holds that it was sent again within the reuse window."""
        reuse = self._reuse.get(endpoint)
        if reuse is None:
            return 0
        reuse.expire(self._clock() - self.reuse_window_s)
        return len(reuse.last)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `hashes` each endpoint holds without a gap.

        The walk stops at the first block no endpoint holds (as the reference does); an
        endpoint stops counting at its own first missing block, since an engine can only reuse
        an unbroken prefix.
        """
        owners_of = self._owners
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        depth = 0
        for block in hashes:
            owners = owners_of.get(block)
            if not owners:
                break
            if alive is None:
                alive = set(owners)
            elif not alive <= owners:
                for endpoint in alive - owners:
                    matched[endpoint] = depth
                alive &= owners
                if not alive:
                    break
            depth += 1
        if alive:
            for endpoint in alive:
                matched[endpoint] = depth
        return matched

    def insert(
        self, endpoint: str, hashes: Sequence[int], capacity: int | None = None, count_reuse: bool = True
    ) -> None:
        """Record that `endpoint` now holds every block of `hashes`.

        `capacity` applies when the endpoint's LRU is created (the reference's autoTune sets it
        from the engine's KV block count then). Blocks are touched last-to-first so the first
        blocks are the most recent: eviction then drops a prefix's tail before its head, as an
        engine does, and matches stay unbroken. With `count_reuse` False, blocks already held are not
        counted as sent again (the same request's prompt, extended by its answer).
        """
        self.version += 1
        lru = self._lrus.get(endpoint)
        if lru is None:
            lru = self._lrus[endpoint] = OrderedDict()
            self._capacities[endpoint] = capacity if capacity and capacity > 0 else self.default_capacity
        owners_of = self._owners
        holder_sets = self._holder_sets
        added = 0
        reused: list[int] = []
        for block in reversed(hashes):
            if block in lru:
                lru.move_to_end(block)
                if count_reuse:
                    reused.append(block)
                continue
            lru[block] = None
            added += 1
            owners_of[block] = holder_sets.add(owners_of.get(block, NOBODY), endpoint)
        self._size += added
        reuse = self._reuse.get(endpoint)
        if reused:
            if reuse is None:
                reuse = self._reuse[endpoint] = _RecentReuse()
            now = self._clock()
            reuse.touch(reused, now)
            reuse.expire(now - self.reuse_window_s)  # bounded even if nobody asks for the count
        self._trim(endpoint, lru, reuse)

    def _trim(self, endpoint: str, lru: OrderedDict[int, None], reuse: _RecentReuse | None) -> None:
        """Evict `endpoint`'s least recent blocks beyond its capacity."""
        limit = self._capacities[endpoint]
        while len(lru) > limit:
            block, _ = lru.popitem(last=False)
            self._drop_owner(block, endpoint)
            if reuse is not None:
                reuse.last.pop(block, None)
            self._size -= 1

    def reconfigure(self, default_capacity: int, reuse_window_s: float) -> None:
        """Take a new default LRU capacity and reuse window (a reload changed them) and keep
        what the index holds: endpoints at the old default capacity take the new one, losing
        their least recent blocks beyond it; capacities set by autoTune stay."""
        if default_capacity < 1:
            raise ValueError(f"LRU capacity must be >= 1, got {default_capacity}")
        old, self.default_capacity, self.reuse_window_s = self.default_capacity, default_capacity, reuse_window_s
        if default_capacity == old:
            return
        self.version += 1
        for endpoint, capacity in self._capacities.items():
            if capacity == old:
                self._capacities[endpoint] = default_capacity
                self._trim(endpoint, self._lrus[endpoint], self._reuse.get(endpoint))

    def remove(self, endpoints: Iterable[str]) -> None:
        """Forget everything `endpoints` held (they left the pool)."""
        self.version += 1
        for endpoint in endpoints:
            lru = self._lrus.pop(endpoint, None)
            self._capacities.pop(endpoint, None)
            self._reuse.pop(endpoint, None)
            if lru is None:
                continue
            for block in lru:
                self._drop_owner(block, endpoint)
            self._size -= len(lru)

    def retain(self, endpoints: Iterable[str]) -> None:
        """Forget every endpoint not in `endpoints`."""
        keep = set(endpoints)
        self.remove([e for e in self._lrus if e not in keep])

    def _drop_owner(self, block: int, endpoint: str) -> None:
        owners = self._owners.get(block)
        if owners is not None and endpoint in owners:
            rest = self._holder_sets.remove(owners, endpoint)
            if rest:
                self._owners[block] = rest
            else:
                del self._owners[block]
