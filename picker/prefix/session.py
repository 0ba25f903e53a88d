"""`session-affinity-scorer`: a conversation's next turn goes back to where its history is cached.

Clients already name their conversations: OpenAI's `prompt_cache_key` (sent for exactly this
purpose), `user`, or a header the operator configures. The scorer remembers, per tenant, model
and session, the endpoint its last turn was routed to, and scores that endpoint 1 (every other
0). The prompt's own blocks say the same when the index still holds them; the session says it
when they cannot: the approximate index evicted them, the prompt was reformatted, or a tenant
has no tokenizer configured.

It is a soft affinity, never a pin: its weight bounds how far it can outweigh the load scorers,
and an endpoint whose load would pass `maxLoadFactor` × (mean load + 1) loses it altogether
(`picker.prefix.hotspot`), so a busy holder sheds the conversation to the next best endpoint,
where the next turns then follow it. Where the prefix producer's index says the session's
endpoint holds none of the prompt any more (it evicted the history), there is nothing to go back
for, and the affinity yields too.

Parameters: `fields` (["prompt_cache_key", "user"]: body fields naming the session, first
present wins), `header` (none: a request header naming it, checked before the fields),
`maxLoadFactor` (2.0; 0 turns the bound off), `idleTimeout` ("10m": a session unseen that long
is forgotten), `capacity` (100000 sessions, least recently used forgotten first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters, PluginConfigError
from picker.framework.plugin import BackgroundWork, PreRequest, SchedulingResult, Scorer, ScorerCategory
from picker.framework.request import InferenceRequest
from picker.prefix.hotspot import over_bound
from picker.prefix.plugins import PREFIX_MATCH_KEY

SessionKey = tuple[str | None, str, str]  # tenant, model, session
_TABLE_KEY = "prefix/sessions"  # + ":" + the scorer's name (`Handle.persistent`)


class SessionTable:
    """The endpoint each session was last routed to: bounded in size and in idle time."""

    def __init__(self, capacity: int, idle_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._entries: OrderedDict[SessionKey, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def endpoint(self, key: SessionKey) -> str | None:
        """Where `key`'s last turn went, unless it has been idle too long."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        address, seen = entry
        if self._clock() - seen > self.idle_timeout_s:
            del self._entries[key]
            return None
        return address

    def record(self, key: SessionKey, address: str) -> None:
        """`key`'s latest turn went to `address`."""
        entries = self._entries
        entries[key] = (address, self._clock())
        entries.move_to_end(key)
        self._trim()

    def reconfigure(self, capacity: int, idle_timeout_s: float) -> None:
        """Take a new capacity and idle timeout (a reload changed them), keeping the sessions:
        the least recently used beyond `capacity` are forgotten."""
        self.capacity, self.idle_timeout_s = capacity, idle_timeout_s
        self._trim()

    def _trim(self) -> None:
        entries = self._entries
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def forget(self, addresses: set[str]) -> None:
        """Drop the sessions of endpoints that left the pool."""
        for key in [k for k, (address, _) in self._entries.items() if address in addresses]:
            del self._entries[key]


def session_name(request: InferenceRequest, fields: Sequence[str], header: str | None) -> str | None:
    """The request's session as its client names it: the `header` (lower-case) when set and
    present, else the first of the body `fields` present; None without one. Unscoped: callers
    key what they keep by tenant and model too."""
    value: object = request.headers.get(header) if header is not None else None
    body = request.body
    for name in fields:
        if value:
            break
        value = body.get(name)
    return value if isinstance(value, str) and value else None


class SessionAffinityScorer(Scorer, PreRequest, BackgroundWork):
    """`session-affinity-scorer`: see the module docstring.

    Its session table is its own and outlives reloads by its name: a reload that changes
    `capacity` or `idleTimeout` keeps the sessions (the table takes them once the config is
    installed), and two scorers by different names keep separate tables.
    """

    plugin_type = "session-affinity-scorer"
    category = ScorerCategory.AFFINITY

    def __init__(
        self,
        name: str,
        table: SessionTable,
        fields: Sequence[str],
        header: str | None,
        max_load_factor: float,
        capacity: int,
        idle_timeout_s: float,
    ) -> None:
        super().__init__(name)
        self.table = table
        self.fields = tuple(fields)
        self.header = header
        self.max_load_factor = max_load_factor
        self.capacity = capacity
        self.idle_timeout_s = idle_timeout_s

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> SessionAffinityScorer:
        p = Parameters(parameters)
        fields = p.strings("fields", ("prompt_cache_key", "user"))
        header = p.string("header", "")
        factor = p.number("maxLoadFactor", 2.0, at_least=0)
        idle = p.duration("idleTimeout", 600.0)
        capacity = p.integer("capacity", 100_000, at_least=1)
        effective = p.finish()
        if idle <= 0:
            raise PluginConfigError(f"idleTimeout: must be positive, got {parameters.get('idleTimeout')!r}")
        key = f"{_TABLE_KEY}:{name}"
        table = handle.persistent(key, lambda: SessionTable(capacity, idle))
        datastore = handle.datastore
        if datastore is not None:
            handle.persistent(
                f"{key}/listener",
                lambda: datastore.on_departure(table.forget),
                datastore.remove_listener,
            )
        scorer = cls(name, table, fields, header.lower() or None, factor, capacity, idle)
        scorer.parameters = effective
        return scorer

    def start(self) -> None:
        """The table takes this config's capacity and idle timeout once the config is installed
        (a config that fails validation after this scorer was built leaves it alone)."""
        self.table.reconfigure(self.capacity, self.idle_timeout_s)

    async def stop(self) -> None:
        """Nothing runs: the table outlives the config."""

    def session(self, request: InferenceRequest) -> SessionKey | None:
        """The request's session key, scoped by tenant and model; None without one."""
        name = session_name(request, self.fields, self.header)
        return None if name is None else (request.tenant, request.target_model, name)

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[float]:
        key = self.session(request)
        address = None if key is None else self.table.endpoint(key)
        match = cycle_state.read(PREFIX_MATCH_KEY)
        if address is None or (match is not None and match.total_blocks and not match.matched.get(address)):
            return [0.0] * len(candidates)
        bounded = over_bound(candidates, self.max_load_factor)
        return [1.0 if c.address == address and not past else 0.0 for c, past in zip(candidates, bounded)]

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        key = self.session(request)
        if key is not None and result.targets:
            self.table.record(key, result.targets[0].address)
