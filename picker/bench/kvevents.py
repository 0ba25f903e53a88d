"""Microbenchmark of the precise prefix index: `python -m picker.bench.kvevents [--blocks N] [--endpoints E]`.

Measures, in this process on one core:
- scoring one request of N own blocks over E endpoints (endpoint i holds a prefix of
  N * (i + 1) / E blocks, so every endpoint drops out at a different block);
- decoding and applying a 1,000-block BlockStored message (the subscriber's per-message work);
- the speculative insert after a pick.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from picker.kvevents.decode import BlockStored, decode_message
from picker.kvevents.precise import PreciseIndex
from picker.prefix.hashing import chain_seed, token_block_hashes
from picker.sim import kvcache
from picker.sim.events import encode_batch

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
    parser = argparse.ArgumentParser(prog="python -m picker.bench.kvevents", description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1000, help="blocks in the scored request (default 1000)")
    parser.add_argument("--endpoints", type=int, default=8, help="endpoints scored (default 8)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
