"""Interned holder sets: the endpoints holding a block, one shared frozenset per combination.

The prefix indexes map hundreds of thousands of blocks to the endpoints holding them. A mutable
set per block is a container CPython's garbage collector tracks, and with that many of them
every full collection stalled the event loop (about 100 ms at 600k tracked objects, measured
on the precise index under the Mooncake trace). An interned frozenset per distinct combination
of endpoints keeps the tracked objects few; runs of blocks with the same holders then also
compare by identity.
"""

from __future__ import annotations

NOBODY: frozenset[str] = frozenset()


class HolderSets:
    """Interned frozensets of endpoint addresses, and the transitions between them."""

    __slots__ = ("_added", "_interned", "_limit", "_removed")

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._interned: dict[frozenset[str], frozenset[str]] = {}
        self._added: dict[tuple[frozenset[str], str], frozenset[str]] = {}
        self._removed: dict[tuple[frozenset[str], str], frozenset[str]] = {}

    def add(self, holders: frozenset[str], endpoint: str) -> frozenset[str]:
        """`holders` plus `endpoint`, interned."""
        step = (holders, endpoint)
        found = self._added.get(step)
        if found is None:
            found = self._added[step] = self._intern(holders | {endpoint})
        return found

    def remove(self, holders: frozenset[str], endpoint: str) -> frozenset[str]:
        """`holders` without `endpoint`, interned (NOBODY when none is left)."""
        step = (holders, endpoint)
        found = self._removed.get(step)
        if found is None:
            found = self._removed[step] = self._intern(holders - {endpoint})
        return found

    def _intern(self, holders: frozenset[str]) -> frozenset[str]:
        interned = self._interned
        if len(interned) >= self._limit:  # only an optimisation: start over rather than grow
            interned.clear()
            self._added.clear()
            self._removed.clear()
        return interned.setdefault(holders, holders)
