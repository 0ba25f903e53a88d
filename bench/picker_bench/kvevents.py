"""Microbenchmark of the precise prefix index: `python -m picker_bench.kvevents [--blocks N] [--endpoints E]`.

Measures, in this process on one core:
- scoring one request of N own blocks over E endpoints (endpoint i holds a prefix of
  N * (i + 1) / E blocks, so every endpoint drops out at a different block);
- decoding and applying a 1,000-block BlockStored message (the subscriber's per-message work);
- the speculative insert after a pick.

A real event stream: `--record FILE --endpoints-file E` subscribes to every publisher an
endpoints file names (`picker bench` writes one per picker system under `OUT/logs/`) and writes
every message to FILE until the publishers fall silent; `--replay FILE` then decodes and applies
that stream to a fresh index, in order, and reports the CPU time per message and per block.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgpack
import yaml
import zmq

from picker.kvevents.decode import BlockRemoved, BlockStored, decode_message
from picker.kvevents.precise import PreciseIndex
from picker.prefix.hashing import chain_seed, token_block_hashes
from picker_sim import kvcache
from picker_sim.events import encode_batch

MODEL = "bench-model"


def _per_call(fn: Callable[[], object], min_seconds: float = 0.5) -> float:
    """Mean seconds per call of `fn`, over at least `min_seconds`."""
    calls, started = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            return elapsed / calls


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker_bench.kvevents", description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1000, help="blocks in the scored request (default 1000)")
    parser.add_argument("--endpoints", type=int, default=8, help="endpoints scored (default 8)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--record", type=Path, metavar="FILE", help="record the publishers of --endpoints-file")
    parser.add_argument("--endpoints-file", type=Path, help="endpoints with kvEventsAddress (picker serve's format)")
    parser.add_argument("--idle", type=float, default=20.0, help="--record stops after this many silent seconds")
    parser.add_argument("--replay", type=Path, metavar="FILE", help="decode and apply a recorded stream")
    args = parser.parse_args(argv)
    if args.record:
        if args.endpoints_file is None:
            print("--record needs --endpoints-file", file=sys.stderr)
            return 2
        messages = record(args.endpoints_file, args.record, args.idle)
        print(f"recorded {messages} messages to {args.record}")
        return 0
    if args.replay:
        print(replay(args.replay, args.block_size).text())
        return 0
    if args.blocks < 1 or args.endpoints < 1 or args.block_size < 1:
        print("--blocks, --endpoints and --block-size must be positive", file=sys.stderr)
        return 2
    n, size = args.blocks, args.block_size
    tokens = list(range(1000, 1000 + n * size))
    keys = token_block_hashes(tokens, size, chain_seed(MODEL))
    endpoints = [f"10.0.0.{i + 1}:8000" for i in range(args.endpoints)]
    index = PreciseIndex(size)
    for i, endpoint in enumerate(endpoints):
        index.track(endpoint, MODEL)
        held = n * (i + 1) // len(endpoints)
        engine = token_block_hashes(tokens[: held * size], size, i)
        index.apply(endpoint, BlockStored(tuple(engine), None, tuple(tokens[: held * size]), size))
    scores = index.score(keys, endpoints)
    score_s = _per_call(lambda: index.score(keys, endpoints))

    stored = kvcache.BlockStored(tuple(token_block_hashes(tokens, size, 99)), None, tuple(tokens), size, None)
    frames = [f"kv@bench@{MODEL}".encode(), (0).to_bytes(8, "big"), encode_batch([stored], "positional")]
    fresh = PreciseIndex(size)
    fresh.track("bench", MODEL)

    def apply_message() -> None:
        for event in decode_message(frames).batch.events:
            fresh.apply("bench", event)

    apply_s = _per_call(apply_message)
    insert_s = _per_call(lambda: index.insert_speculative(endpoints[0], keys))

    print(
        f"score {n} blocks over {len(endpoints)} endpoints: {score_s * 1e6:.0f} us/request "
        f"(scores {[round(s, 3) for s in scores]})"
    )
    print(f"decode + apply a {n}-block BlockStored message: {apply_s * 1e3:.2f} ms ({n / apply_s:,.0f} blocks/s)")
    print(f"speculative insert of {n} blocks after a pick: {insert_s * 1e6:.0f} us")
    return 0


def record(endpoints_file: Path, out: Path, idle_s: float) -> int:
    """Write every message the endpoints' publishers send to `out` (one msgpack
    `[endpoint, seconds since start, frames]` each) until none came for `idle_s` (counted from
    the start too); the count."""
    entries = yaml.safe_load(endpoints_file.read_text()) or []
    publishers = {e["kvEventsAddress"]: e["address"] for e in entries if e.get("kvEventsAddress")}
    if not publishers:
        raise SystemExit(f"{endpoints_file} names no kvEventsAddress")
    context = zmq.Context()
    poller = zmq.Poller()
    sockets: dict[zmq.Socket[bytes], str] = {}
    for address, endpoint in publishers.items():
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)  # keep everything: a recording with holes would mislead
        socket.setsockopt(zmq.SUBSCRIBE, b"kv@")  # the subscriber's default topic filter
        socket.connect(address)
        poller.register(socket, zmq.POLLIN)
        sockets[socket] = endpoint
    count, started = 0, time.monotonic()
    last = started
    try:
        with out.open("wb") as file:
            while time.monotonic() - last < idle_s:
                for socket, _ in poller.poll(500):
                    frames = socket.recv_multipart()
                    file.write(msgpack.packb([sockets[socket], time.monotonic() - started, frames]))
                    count += 1
                    last = time.monotonic()
    finally:
        for socket in sockets:
            socket.close(0)
        context.term()
    return count


@dataclass(frozen=True, slots=True)
class ReplayCost:
    """CPU seconds spent decoding and applying a recorded stream, and what it held."""

    messages: int
    stored_blocks: int
    removed_blocks: int
    seconds: float  # the stream's own duration, first message to last
    decode_s: float
    apply_s: float

    def text(self) -> str:
        blocks = self.stored_blocks + self.removed_blocks
        total = self.decode_s + self.apply_s
        return (
            f"{self.messages:,} messages over {self.seconds:.0f} s ({self.messages / self.seconds:,.0f}/s), "
            f"{self.stored_blocks:,} blocks stored and {self.removed_blocks:,} removed "
            f"({blocks / self.seconds:,.0f} blocks/s)\n"
            f"CPU: decode {self.decode_s:.2f} s + apply {self.apply_s:.2f} s = {total:.2f} s "
            f"({total / self.seconds * 100:.1f}% of one core while the stream ran), "
            f"{total / self.messages * 1e6:.0f} us per message, {total / blocks * 1e6:.2f} us per block"
        )


def replay(path: Path, block_size: int) -> ReplayCost:
    """Decode and apply the recorded stream at `path` to a fresh index, timing each step."""
    with path.open("rb") as file:
        messages: list[tuple[str, float, list[bytes]]] = [tuple(m) for m in msgpack.Unpacker(file, raw=False)]
    if not messages:
        raise SystemExit(f"{path} holds no messages")
    index = PreciseIndex(block_size)
    stored = removed = 0
    decode_s = apply_s = 0.0
    clock = time.process_time
    for endpoint, _, frames in messages:
        if endpoint not in index.endpoints():
            index.track(endpoint, decode_message(frames).topic.partition("@")[2].partition("@")[2])
        started = clock()
        events = decode_message(frames).batch.events
        decoded = clock()
        for event in events:
            index.apply(endpoint, event)
        apply_s += clock() - decoded
        decode_s += decoded - started
        for event in events:
            if isinstance(event, BlockStored):
                stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                removed += len(event.block_hashes)
    seconds = max(messages[-1][1] - messages[0][1], 1e-9)
    return ReplayCost(len(messages), stored, removed, seconds, decode_s, apply_s)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
