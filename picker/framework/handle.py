"""What a plugin factory gets besides its parameters: the datastore, the other plugins of its
config, and objects that outlive a config reload."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from picker.framework.plugin import Plugin

if TYPE_CHECKING:
    from picker.datastore.store import Datastore
    from picker.state.sync import StateSync

T = TypeVar("T")
Release = Callable[[Any], Awaitable[None] | None]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    value: Any
    release: Release | None


class PersistentObjects:
    """Objects kept across config builds by key (`Handle.persistent`), each with its release.

    A config build records the keys it used; once a config is installed, `retain` releases
    every object that config does not use (an object a failed build created included), so a
    reload that changes a plugin's parameters does not leave the old index, listener or
    subscriber behind.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, create: Callable[[], T], release: Callable[[T], Awaitable[None] | None] | None) -> T:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(create(), release)
        value: T = entry.value
        return value

    async def retain(self, keys: frozenset[str]) -> None:
        """Release every object whose key is not in `keys`, awaiting async releases."""
        for key in [k for k in self._entries if k not in keys]:
            entry = self._entries.pop(key)
            if entry.release is None:
                continue
            try:
                pending = entry.release(entry.value)
                if pending is not None:
                    await pending
            except Exception:
                log.exception("releasing %s failed", key)

    async def release_all(self) -> None:
        await self.retain(frozenset())


class Handle:
    """What a plugin factory gets besides its parameters.

    - `datastore`: the pool's endpoints, metrics and in-flight counters (None in offline tools
      such as `picker config validate`).
    - `plugin(name)`: another plugin of the same config by name. Plugins are built in config
      order, so look up plugins defined later lazily (on first use), not in the factory.
    - `persistent(key, create, release)`: an object that survives config reloads (e.g. a prefix
      index), created on first request; later configs get the same object for the same key.
      When an installed config no longer asks for `key`, `release(object)` runs (it may be a
      coroutine function): remove listeners, stop tasks, close sockets there.
    - `state_sync`: the store shared with the other picker processes (`--state-store`), or None.
    """

    def __init__(
        self,
        datastore: Datastore | None = None,
        objects: PersistentObjects | None = None,
        state_sync: StateSync | None = None,
    ) -> None:
        self.datastore = datastore
        self.state_sync = state_sync
        self.objects = objects if objects is not None else PersistentObjects()
        self.used: set[str] = set()  # persistent keys this build asked for
        self._plugins: dict[str, Plugin] = {}

    def plugin(self, name: str) -> Plugin:
        """The plugin instance called `name`; KeyError if there is none."""
        return self._plugins[name]

    def plugins(self) -> Mapping[str, Plugin]:
        """All plugins built so far, by name."""
        return self._plugins

    def add_plugin(self, plugin: Plugin) -> None:
        self._plugins[plugin.name] = plugin

    def persistent(
        self, key: str, create: Callable[[], T], release: Callable[[T], Awaitable[None] | None] | None = None
    ) -> T:
        """The object stored under `key`, created by `create()` the first time."""
        self.used.add(key)
        return self.objects.get(key, create, release)
