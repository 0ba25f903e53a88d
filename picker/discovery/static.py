"""Endpoints without Kubernetes: a fixed `--endpoints` list or a YAML file that is re-read when it changes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

import yaml

from picker.datastore.endpoint import Endpoint, split_host_port
from picker.datastore.store import Datastore

log = logging.getLogger(__name__)


class EndpointListError(ValueError):
    """An endpoint list that cannot be used; the message names the bad entry."""


def _endpoint(entry: Any, where: str) -> Endpoint:
    if isinstance(entry, str):
        entry = {"address": entry}
    if not isinstance(entry, dict):
        raise EndpointListError(f"{where}: expected 'ip:port' or a mapping, got {type(entry).__name__}")
    unknown = set(entry) - {"address", "name", "namespace", "labels", "kvEventsAddress"}
    if unknown:
        raise EndpointListError(f"{where}: unknown field(s) {sorted(unknown)}")
    address = entry.get("address")
    if not isinstance(address, str):
        raise EndpointListError(f"{where}.address: required 'ip:port' string")
    try:
        ip, port = split_host_port(address.strip())
    except ValueError as e:
        raise EndpointListError(f"{where}.address: {e}") from None
    if not 0 < port < 65536:
        raise EndpointListError(f"{where}.address: port {port} out of range")
    labels = entry.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise EndpointListError(f"{where}.labels: expected a mapping of strings")
    kv = entry.get("kvEventsAddress")
    if kv is not None and not isinstance(kv, str):
        raise EndpointListError(f"{where}.kvEventsAddress: expected a string like tcp://ip:port")
    return Endpoint(
        ip=ip,
        port=port,
        name=str(entry.get("name") or address),
        namespace=str(entry.get("namespace") or ""),
        labels=labels,
        kv_events_address=kv,
    )


def parse_endpoint_flag(value: str) -> list[Endpoint]:
    """`ip:port,ip:port,...` as given to `--endpoints`."""
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if not entries:
        raise EndpointListError("--endpoints: no endpoints given")
    return [_endpoint(e, f"--endpoints[{i}]") for i, e in enumerate(entries)]


def parse_endpoint_file(text: str) -> list[Endpoint]:
    """A YAML list of `ip:port` strings or `{address, name, namespace, labels, kvEventsAddress}`."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise EndpointListError(f"invalid YAML: {e}") from None
    if isinstance(data, dict) and "endpoints" in data:
        data = data["endpoints"]
    if data is None:
        return []
    if not isinstance(data, list):
        raise EndpointListError("expected a list of endpoints")
    endpoints = [_endpoint(e, f"endpoints[{i}]") for i, e in enumerate(data)]
    seen: set[str] = set()
    for i, endpoint in enumerate(endpoints):
        if endpoint.address in seen:
            raise EndpointListError(f"endpoints[{i}]: duplicate address {endpoint.address}")
        seen.add(endpoint.address)
    return endpoints


class EndpointFile:
    """Keeps the datastore equal to an endpoints file; a bad edit is logged and the old list kept,
    and an empty read (the file truncated for a rewrite) changes nothing."""

    def __init__(self, datastore: Datastore, path: str | Path, interval: float = 0.5) -> None:
        self.datastore = datastore
        self.path = Path(path)
        self.interval = interval
        self._digest: bytes | None = None
        self._task: asyncio.Task[None] | None = None

    def load(self) -> None:
        """Read the file now; raises EndpointListError (or OSError) if it is unusable."""
        self._apply(self.path.read_bytes(), initial=True)

    def _apply(self, raw: bytes, initial: bool = False) -> None:
        if not raw.strip() and not initial:
            return  # a write in progress (editors and `>` truncate first); `[]` says no endpoints
        digest = hashlib.sha256(raw).digest()
        if digest == self._digest:
            return
        try:
            endpoints = parse_endpoint_file(raw.decode("utf-8"))
        except (EndpointListError, UnicodeDecodeError) as e:
            if initial:
                raise EndpointListError(f"{self.path}: {e}") from None
            log.error(
                "ignoring invalid endpoints file %s (keeping %d endpoints): %s",
                self.path,
                len(self.datastore.endpoints()),
                e,
            )
            self._digest = digest
            return
        self._digest = digest
        self.datastore.set_endpoints(endpoints)
        log.info("endpoints file %s: %d endpoints", self.path, len(endpoints))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                raw = await asyncio.to_thread(self.path.read_bytes)
            except OSError as e:
                log.warning("cannot read endpoints file %s: %s", self.path, e)
                continue
            self._apply(raw)

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="endpoints-file")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
