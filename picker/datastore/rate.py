"""Events per second over a sliding window: the endpoints' completion rates (the datastore) and
the demand for them (flow control)."""

from __future__ import annotations

from collections import deque

# Rates count the events of the last window; fewer than RATE_MIN_COUNT in it tell no rate.
RATE_WINDOW_SECONDS = 10.0
RATE_MIN_COUNT = 8


class EventRate:
    """Monotonic event times within the last `RATE_WINDOW_SECONDS` (older ones are dropped as
    time moves on, so the times given must not go back)."""

    __slots__ = ("_times",)

    def __init__(self) -> None:
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)
        self._drop_before(now - RATE_WINDOW_SECONDS)

    def per_second(self, now: float) -> float:
        """Events per second over the window ending `now` (0.0, unknown, with too few)."""
        self._drop_before(now - RATE_WINDOW_SECONDS)
        recent = len(self._times)
        return recent / RATE_WINDOW_SECONDS if recent >= RATE_MIN_COUNT else 0.0

    def _drop_before(self, since: float) -> None:
        times = self._times
        while times and times[0] <= since:
            times.popleft()
