"""Shared helpers for the simulator's tests: a KV-event subscriber and process helpers."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

END_OF_REPLAY = b"\xff" * 8


def _event_fields(event: Any) -> tuple[str, dict[str, Any]]:
    """(tag, fields) from a positional-array or tagged-map event."""
    if isinstance(event, dict):
        return event["type"], event
    tag = event[0]
    if tag == "BlockStored":
        return tag, {
            "block_hashes": event[1],
            "parent_block_hash": event[2],
            "token_ids": event[3],
            "block_size": event[4],
        }
    if tag == "BlockRemoved":
        return tag, {"block_hashes": event[1]}
    return tag, {}


class BlockSetSubscriber:
    """What a router's precise index would hold for one pod: the set of its cached block hashes.

    Applies events in sequence order; on a gap (or a first message past seq 0) it asks the
    pod's replay socket for the missing batches, as a real subscriber would.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay_endpoint: str | None) -> None:
        self.blocks: set[int] = set()
        self.tokens: dict[int, list[int]] = {}
        self.next_seq = 0
        self.replays = 0
        self.clears = 0
        self.removed = 0
        self._ctx = ctx
        self._replay_endpoint = replay_endpoint
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self._sub.connect(endpoint)
        self.topics: set[bytes] = set()
        # The layouts seen: a batch's field count (array) or keys (map); per event tag the same.
        self.batch_layouts: set[int | tuple[str, ...]] = set()
        self.event_layouts: set[tuple[str, int | tuple[str, ...]]] = set()

    def close(self) -> None:
        self._sub.close(0)

    def _apply(self, payload: bytes) -> None:
        batch = msgpack.unpackb(payload)
        self.batch_layouts.add(tuple(batch) if isinstance(batch, dict) else len(batch))
        ts, events = (batch["ts"], batch["events"]) if isinstance(batch, dict) else batch[:2]
        assert isinstance(ts, float)
        for event in events:
            tag, fields = _event_fields(event)
            self.event_layouts.add((tag, tuple(event) if isinstance(event, dict) else len(event)))
            if tag == "BlockStored":
                hashes = fields["block_hashes"]
                bs = fields["block_size"]
                assert len(fields["token_ids"]) == bs * len(hashes)
                for i, h in enumerate(hashes):
                    assert isinstance(h, int) and 0 <= h < 2**64
                    self.blocks.add(h)
                    self.tokens[h] = fields["token_ids"][i * bs : (i + 1) * bs]
            elif tag == "BlockRemoved":
                for h in fields["block_hashes"]:
                    self.blocks.discard(h)
                    self.removed += 1
            elif tag == "AllBlocksCleared":
                self.blocks.clear()
                self.clears += 1
            else:
                raise AssertionError(f"unknown event {tag!r}")

    async def _replay(self) -> None:
        assert self._replay_endpoint, "sequence gap but no replay endpoint"
        self.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        try:
            await dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
            while True:
                _empty, seq_bytes, payload = await asyncio.wait_for(dealer.recv_multipart(), 5)
                if seq_bytes == END_OF_REPLAY:
                    assert payload == b""
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq >= self.next_seq:
                    self._apply(payload)
                    self.next_seq = seq + 1
        finally:
            dealer.close(0)

    async def pump(self, timeout: float) -> bool:
        """Handle one message if one arrives within `timeout`; False if none did."""
        if not await self._sub.poll(timeout * 1000):
            return False
        topic, seq_bytes, payload = await self._sub.recv_multipart()
        self.topics.add(topic)
        seq = int.from_bytes(seq_bytes, "big")
        if seq > self.next_seq:
            await self._replay()
        if seq >= self.next_seq:
            self._apply(payload)
            self.next_seq = seq + 1
        return True

    async def sync_until(self, condition: Callable[[], bool], deadline_s: float = 10.0) -> None:
        """Apply events until `condition()` holds; AssertionError at the deadline.

        When the live socket is quiet it asks for a replay: batches published before the
        subscription took effect (ZMQ's slow joiner) never arrive live.
        """
        end = time.monotonic() + deadline_s
        while not condition():
            if time.monotonic() > end:
                raise AssertionError("subscriber did not converge before the deadline")
            if not await self.pump(0.05):
                await self._replay()


async def eventually(
    check: Callable[[], Awaitable[bool] | bool], deadline_s: float = 10.0, interval: float = 0.02
) -> None:
    """Poll a condition (plain or async) until it holds or the deadline passes (AssertionError)."""
    end = time.monotonic() + deadline_s
    while not await _holds(check()):
        if time.monotonic() > end:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(interval)  # poll interval, not a fixed wait


async def _holds(result: Awaitable[bool] | bool) -> bool:
    return await result if inspect.isawaitable(result) else result


def start_sim(args: list[str], deadline_s: float = 20.0) -> tuple[subprocess.Popen[str], list[str]]:
    """Start `picker sim ARGS` and return (process, its pod lines) once it printed `ready`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "picker.cli", "sim", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    end = time.monotonic() + deadline_s
    try:
        assert proc.stdout is not None
        while time.monotonic() < end:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(
                    f"picker sim exited early: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}"
                )
            line = line.strip()
            if line == "ready":
                return proc, lines
            lines.append(line)
        raise AssertionError("picker sim did not print ready in time")
    except BaseException:
        stop_process(proc)
        raise


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> int:
    """SIGTERM a process we started (by PID), SIGKILL if it lingers; returns its exit code."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
    return proc.returncode


async def pod_metrics(http: aiohttp.ClientSession, address: str) -> dict[str, float]:
    """A sim pod's /metrics samples by name, a `source` label appended as `{source}`
    (`vllm:prompt_tokens_by_source_total{external_kv_transfer}`)."""
    async with http.get(f"http://{address}/metrics") as resp:
        text = await resp.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            source = s.labels.get("source")
            samples[s.name + (f"{{{source}}}" if source else "")] = s.value
    return samples


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    """How much the sample `name` grew from `before` to `after` (absent counts as 0)."""
    return after.get(name, 0.0) - before.get(name, 0.0)
