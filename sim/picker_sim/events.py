"""vLLM-style KV-cache event publisher: a ZMQ PUB socket plus an optional replay ROUTER.

Wire format (vLLM's `ZmqEventPublisher`): each message is three frames
`[topic, 8-byte big-endian sequence, msgpack EventBatch]`. Three encodings of the batch:
- `array` (default): the msgspec structs of vLLM v0.10.2 (which added `medium`) to v0.11.0,
  all `array_like`, the layout llm-d v0.4.0 decodes, field counts included (its decoder fails on
  any other count): the batch `[ts, [event, ...], data_parallel_rank]`,
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`
  (6 fields), `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
- `positional`: the same with `lora_name` after `medium` (7 fields; vLLM PR #27577), as the
  array-encoded vLLM releases after it.
- `map`: vLLM's current structs (vLLM PR #42892, no longer `array_like`): the batch
  `{"ts", "events", "data_parallel_rank"}` and events `{"type": "BlockStored", ...}`; as
  msgspec's `omit_defaults` does, fields without a default are sent even when nil and the
  defaulted ones (`extra_keys`, `group_idx`, ...) only when set, which the sim never does.
The sim has no LoRA ids, so `lora_id` is nil. Replay: a client sends `[identity, "", start_seq]`
to the ROUTER socket and gets every buffered `(seq, payload)` with seq >= start_seq, then
`seq = -1` with an empty payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from picker_sim.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

FORMATS = ("array", "positional", "map")
END_OF_REPLAY = b"\xff" * 8
MEDIUM_GPU = "GPU"
# vLLM's topic is a plain string (`--kv-events-config '{"topic": ...}'`); llm-d's subscriber
# wants `kv@<pod IP>@<model>`. The sim fills in {ip}, {port}, {model} and {name} per pod.
DEFAULT_TOPIC = "kv@{ip}@{model}"


def encode_event(event: KVEvent, fmt: str) -> Any:
    """One event as vLLM serializes it, in the `array`, `positional` or `map` encoding."""
    if isinstance(event, BlockStored):
        if fmt == "map":
            return {
                "type": "BlockStored",
                "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash,
                "token_ids": list(event.token_ids),
                "block_size": event.block_size,
                "lora_id": None,
                "medium": MEDIUM_GPU,
                "lora_name": event.lora_name,
            }
        fields = [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,
            MEDIUM_GPU,
        ]
        return fields if fmt == "array" else [*fields, event.lora_name]
    if isinstance(event, BlockRemoved):
        if fmt == "map":
            return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM_GPU}
        return ["BlockRemoved", list(event.block_hashes), MEDIUM_GPU]
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"} if fmt == "map" else ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: list[KVEvent], fmt: str) -> bytes:
    """One EventBatch payload (the third frame of a message), stamped now."""
    encoded = [encode_event(e, fmt) for e in events]
    batch: Any = {"ts": time.time(), "events": encoded, "data_parallel_rank": 0} if fmt == "map" else None
    packed: bytes = msgpack.packb(batch or [time.time(), encoded, 0])
    return packed


def binds(endpoint: str) -> bool:
    """Whether vLLM's `ZmqEventPublisher` binds `endpoint` (else it connects to it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One pod's publisher; `publish` is synchronous and never blocks the event loop."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        host: str,
        port: int,
        topic: str,
        fmt: str = "array",
        replay_port: int | None = None,
        buffer_steps: int = 10_000,
        connect: str | None = None,
    ) -> None:
        """Bind the PUB socket on `host:port` (0 = a free port), or with `connect` connect it
        there instead (a subscriber that binds, as vLLM does for an endpoint without `*`)."""
        if fmt not in FORMATS:
            raise ValueError(f"kv-events format must be one of {FORMATS}, not {fmt!r}")
        self.topic = topic.encode()
        self.fmt = fmt
        self.drop_rate = 0.0  # fault: fraction of batches not sent (still buffered for replay)
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint: str | None = None  # where the PUB socket listens (None when it connects)
        if connect is None:
            self.endpoint = f"tcp://{host}:{self._bind(self._pub, host, port)}"
        else:
            self._pub.connect(connect)
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if replay_port is not None:
            self._router = ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            rport = self._bind(self._router, host, replay_port)
            self.replay_endpoint = f"tcp://{host}:{rport}"

    @staticmethod
    def _bind(sock: zmq.asyncio.Socket, host: str, port: int) -> int:
        if port == 0:
            return sock.bind_to_random_port(f"tcp://{host}")
        sock.bind(f"tcp://{host}:{port}")
        return port

    def start(self) -> None:
        if self._router is not None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[KVEvent]) -> None:
        """Send one EventBatch with `events`."""
        payload = encode_batch(events, self.fmt)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self.drop_rate and random.random() < self.drop_rate:
            return
        with contextlib.suppress(zmq.Again):  # high-water mark reached: PUB drops, as vLLM's would
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) < 3 or len(frames[2]) != 8:
                log.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([identity, b"", END_OF_REPLAY, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
