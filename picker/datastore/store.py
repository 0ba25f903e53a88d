"""The datastore: the pool's endpoints, their latest metrics and the picker's own in-flight load.

Discovery replaces the endpoint set, the data layer replaces metrics, the director counts
in-flight requests, state sync adds the other picker processes' (`set_remote_in_flight`).
Everything runs on one event loop, so plain dicts suffice; the request path only reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from itertools import repeat

from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.datastore.rate import EventRate

EndpointListener = Callable[[dict[str, Endpoint], dict[str, Endpoint]], None]

_NO_METRICS = EndpointMetrics()


class Datastore:
    """Endpoints keyed by `ip:port`, with metrics and in-flight counters."""

    def __init__(self) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        self._metrics: dict[str, EndpointMetrics] = {}
        # When a scrape last confirmed each endpoint's metrics, changed or not. Kept apart from
        # the metrics (whose `update_time` is when they last changed) so that the scrapes which
        # find a page unchanged, nearly all of them, only write a float: no new metrics, no new
        # state. `EndpointState.metrics_age` reads it live.
        self._scraped: dict[str, float] = {}
        self._in_flight_requests: dict[str, int] = {}
        self._in_flight_tokens: dict[str, int] = {}
        self._completions: dict[str, EventRate] = {}  # address → this process's releases
        # The other picker processes' in-flight load (--state-store), summed; snapshots add it.
        self._remote_requests: dict[str, int] = {}
        self._remote_tokens: dict[str, int] = {}
        # Called on every acquire and release (state sync publishes the counts); must not block.
        self._in_flight_listeners: list[Callable[[], None]] = []
        self._listeners: list[EndpointListener] = []
        self._load_listeners: list[Callable[[], None]] = []
        self.synced = False  # True once discovery has delivered a full endpoint list
        # Every endpoint's state in pool order, each replaced when its metrics or load change:
        # a request's snapshot is then a copy of this, not a state built per endpoint.
        self._states: dict[str, EndpointState] = {}
        # Endpoints whose metrics changed since the last snapshot: their states are rebuilt when
        # a request next reads them, so scrapes of an idle pool build none.
        self._stale: set[str] = set()
        self._oldest_update: float | None = None  # oldest_update_time(), until metrics change

    # -- endpoints (written by discovery) --------------------------------------------------

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Replace the endpoint set; endpoints that left lose their metrics and load."""
        new = {e.address: e for e in endpoints}
        old = self._endpoints
        self._endpoints = new
        for address in old.keys() - new.keys():
            self._metrics.pop(address, None)
            self._scraped.pop(address, None)
            self._in_flight_requests.pop(address, None)
            self._in_flight_tokens.pop(address, None)
            self._completions.pop(address, None)
        self._rebuild_states()
        self.synced = True
        self._load_changed()
        if new != old or any(new[a].labels != old[a].labels for a in new.keys() & old.keys()):
            for listener in list(self._listeners):
                listener(old, new)

    def add_listener(self, listener: EndpointListener) -> None:
        """Call `listener(old, new)` whenever the endpoint set changes."""
        self._listeners.append(listener)

    def on_departure(self, forget: Callable[[set[str]], None]) -> EndpointListener:
        """Call `forget(addresses)` whenever endpoints leave the pool; returns the listener, for
        `remove_listener` when whatever forgets is released."""

        def departed(old: dict[str, Endpoint], new: dict[str, Endpoint]) -> None:
            gone = old.keys() - new.keys()
            if gone:
                forget(gone)

        self.add_listener(departed)
        return departed

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever capacity may have changed: new metrics, a request
        released, the endpoint set replaced (flow control dispatches on it; keep it cheap)."""
        self._load_listeners.append(listener)

    def add_in_flight_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` on every acquire and release (keep it cheap: the request path)."""
        self._in_flight_listeners.append(listener)

    def remove_in_flight_listener(self, listener: Callable[[], None]) -> None:
        """Stop calling `listener` (added with `add_in_flight_listener`); unknown ones are ignored."""
        if listener in self._in_flight_listeners:
            self._in_flight_listeners.remove(listener)

    def _load_changed(self) -> None:
        for listener in self._load_listeners:
            listener()

    def remove_listener(self, listener: EndpointListener) -> None:
        """Stop calling `listener` (added with `add_listener`); unknown listeners are ignored."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def listener_count(self) -> int:
        """How many listeners are registered (a reload must not grow it)."""
        return len(self._listeners)

    def endpoints(self) -> dict[str, Endpoint]:
        return self._endpoints

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)

    # -- metrics (written by the data layer) -----------------------------------------------

    def set_metrics(self, address: str, metrics: EndpointMetrics) -> None:
        if address in self._endpoints:
            self._metrics[address] = metrics
            self._scraped[address] = metrics.update_time
            self._stale.add(address)
            self._oldest_update = None
            self._load_changed()

    def refresh_update_times(self, stamps: Iterable[tuple[str, float]]) -> None:
        """Record `(address, update_time)` of scrapes that found metrics unchanged: they are as
        fresh as that scrape. Endpoints not in the pool or never scraped are skipped."""
        metrics, scraped = self._metrics, self._scraped
        refreshed = False
        for address, update_time in stamps:
            if address in metrics:  # only endpoints of the pool have metrics
                scraped[address] = update_time
                refreshed = True
        if refreshed:
            self._oldest_update = None
            self._load_changed()

    def oldest_update_time(self) -> float:
        """The oldest last-scrape time in the pool, 0 when an endpoint was never scraped or the
        pool is empty; kept until metrics or the pool change."""
        oldest = self._oldest_update
        if oldest is None:
            oldest = self._oldest_update = min(map(self._scraped.get, self._endpoints, repeat(0.0)), default=0.0)
        return oldest

    def scraped_at(self, address: str) -> float:
        """`time.monotonic()` of the last scrape that confirmed `address`'s metrics; 0 = never."""
        return self._scraped.get(address, 0.0)

    def metrics(self, address: str) -> EndpointMetrics:
        """`address`'s metrics, with `update_time` the last scrape that confirmed them."""
        metrics = self._metrics.get(address, _NO_METRICS)
        scraped = self._scraped.get(address, 0.0)
        return metrics if scraped == metrics.update_time else metrics.stamped(scraped)

    # -- in-flight load (written by the director) ------------------------------------------

    def acquire(self, address: str, tokens: int) -> None:
        self._in_flight_requests[address] = self._in_flight_requests.get(address, 0) + 1
        self._in_flight_tokens[address] = self._in_flight_tokens.get(address, 0) + tokens
        self._update_state(address)
        for listener in self._in_flight_listeners:
            listener()

    def release(self, address: str, tokens: int) -> None:
        if address not in self._in_flight_requests:
            return  # the endpoint left the pool while the request ran
        self._in_flight_requests[address] = max(0, self._in_flight_requests[address] - 1)
        self._in_flight_tokens[address] = max(0, self._in_flight_tokens.get(address, 0) - tokens)
        self._update_state(address)
        completions = self._completions.get(address)
        if completions is None:
            completions = self._completions[address] = EventRate()
        completions.record(time.monotonic())
        for listener in self._in_flight_listeners:
            listener()
        self._load_changed()

    def completion_rate(self, address: str, now: float | None = None) -> float:
        """Requests this process saw end at `address` per second (`EventRate`: 0.0, unknown,
        with too few lately); `now` must not go back between calls."""
        completions = self._completions.get(address)
        if completions is None:
            return 0.0
        return completions.per_second(time.monotonic() if now is None else now)

    def in_flight(self, address: str) -> int:
        """Requests this process has in flight at `address` (the others' not included)."""
        return self._in_flight_requests.get(address, 0)

    def local_in_flight(self) -> list[tuple[str, int, int]]:
        """(address, requests, tokens) of every endpoint this process has requests in flight at."""
        tokens = self._in_flight_tokens
        return [(a, n, tokens.get(a, 0)) for a, n in self._in_flight_requests.items() if n > 0]

    def set_remote_in_flight(self, requests: dict[str, int], tokens: dict[str, int]) -> None:
        """Replace the other processes' in-flight load (summed over them) that snapshots add."""
        dropped = any(n > requests.get(a, 0) for a, n in self._remote_requests.items())
        self._remote_requests = requests
        self._remote_tokens = tokens
        self._rebuild_states()
        if dropped:
            self._load_changed()  # capacity freed elsewhere: flow control may dispatch

    # -- snapshots (read by the request path) ----------------------------------------------

    def snapshot(self, addresses: Iterable[str] | None = None) -> list[EndpointState]:
        """The state of every endpoint, or of those of `addresses` that are in the pool (a new
        list each time: callers may change it)."""
        if self._stale:
            for address in self._stale:
                self._update_state(address)
            self._stale.clear()
        if addresses is None:
            return list(self._states.values())
        states = self._states
        return [states[a] for a in addresses if a in states]

    def _state(self, endpoint: Endpoint) -> EndpointState:
        address = endpoint.address
        return EndpointState(
            endpoint,
            self._metrics.get(address, _NO_METRICS),
            self._in_flight_requests.get(address, 0) + self._remote_requests.get(address, 0),
            self._in_flight_tokens.get(address, 0) + self._remote_tokens.get(address, 0),
            self._scraped,
        )

    def _update_state(self, address: str) -> None:
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            self._states[address] = self._state(endpoint)

    def _rebuild_states(self) -> None:
        self._stale.clear()
        self._oldest_update = None
        self._states = {address: self._state(endpoint) for address, endpoint in self._endpoints.items()}
