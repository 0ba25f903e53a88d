"""`python -m picker_bench.responses [--chunks N] [--responses R]`: what a streamed response
costs the picker, per chunk and at its end, with and without `indexResponses`.

A director routes a chat request (the built-in tokenizer, a 2,000-token history) and is then
handed its answer as an SSE stream of N events, one word each, as vLLM streams it; the
director's response path runs chunk by chunk (`response_body` per chunk, usage scanning
included), as the ext_proc server reports a response when the config reads each chunk.
Prints the CPU time (thread time) per passed-through chunk and for the last chunk, which runs
the response-complete hooks (with `indexResponses`: the answer parsed, tokenized, hashed and
recorded in the index).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from time import thread_time

import orjson

from picker.config.runtime import RuntimeHolder
from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.requestcontrol.director import Director
from picker_bench.backend import sse_answer

CONFIG = (
    "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
    "plugins:\n- type: approx-prefix-cache-producer\n"
    "  parameters: {{tokenizers: {{'*': builtin}}, indexResponses: {index}}}\n"
    "- type: prefix-cache-scorer\n"
)
CHAT = {":path": "/v1/chat/completions"}


async def measure(index_responses: bool, chunks: int, responses: int) -> tuple[float, float]:
    """(CPU seconds per passed-through chunk, CPU seconds of the last chunk), averaged."""
    datastore = Datastore()
    datastore.set_endpoints([Endpoint(f"10.0.0.{i}", 8000) for i in range(1, 9)])
    holder = RuntimeHolder(datastore)
    holder.load_text(CONFIG.format(index=str(index_responses).lower()))
    director = Director(datastore, holder)
    stream = sse_answer(chunks)
    per_chunk = last = 0.0
    for r in range(responses):
        history = [{"role": "system", "content": "be brief " * 600}, {"role": "user", "content": f"question {r}"}]
        routed = await director.route(orjson.dumps({"model": "m", "messages": history, "stream": True}), CHAT, None)
        routed.response_headers(200, None, "text/event-stream", False)
        started = thread_time()
        for chunk in stream[:-1]:
            routed.response_body(chunk, False)
        middle = thread_time()
        routed.response_body(stream[-1], True)
        ended = thread_time()
        per_chunk += (middle - started) / (len(stream) - 1)
        last += ended - middle
    return per_chunk / responses, last / responses


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker_bench.responses", description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=256, help="SSE events per response (default 256)")
    parser.add_argument("--responses", type=int, default=200, help="responses measured per variant (default 200)")
    args = parser.parse_args(argv)
    if args.chunks < 1 or args.responses < 1:
        print("--chunks and --responses must be positive", file=sys.stderr)
        return 2
    for index_responses in (False, True):
        chunk, last = asyncio.run(measure(index_responses, args.chunks, args.responses))
        print(
            f"indexResponses {str(index_responses).lower():5s}: {chunk * 1e6:.1f} us CPU per passed-through chunk, "
            f"{last * 1e3:.2f} ms for the last chunk (response complete), {args.chunks}-event answers"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
