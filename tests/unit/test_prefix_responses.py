"""`indexResponses`: the answer that streams back is recorded as the next turn's cached prefix."""

from __future__ import annotations

import orjson

from picker.config.runtime import RuntimeHolder
from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.prefix.builtin_tokenizer import encode, render_chat
from picker.prefix.plugins import PREFIX_MATCH_KEY, ApproxPrefixCacheProducer
from picker.request.completion import completion_text
from picker.requestcontrol.director import Director

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
CHAT = {":path": "/v1/chat/completions"}
BLOCK = 16


def config(index_responses: bool) -> str:
    return HEADER + (
        "plugins:\n- type: approx-prefix-cache-producer\n"
        f"  parameters: {{tokenizers: {{'*': builtin}}, blockSizeTokens: {BLOCK}, autoTune: false,"
        f" indexResponses: {str(index_responses).lower()}}}\n"
        "- type: prefix-cache-scorer\n"
    )


def sse(answer: str) -> list[bytes]:
    """The answer as a chat completion stream, one word per event, as vLLM streams it."""
    words = answer.split(" ")
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": (" " if i else "") + w}}]} for i, w in enumerate(words)]
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


async def next_turn_match(index_responses: bool) -> tuple[int, int, int]:
    """Route turn 1, stream its answer back, then match turn 2: (matched blocks at turn 1's
    endpoint, full blocks of turn 1's prompt, full blocks of turn 1's prompt + answer)."""
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)])
    holder = RuntimeHolder(datastore)
    holder.load_text(config(index_responses))
    director = Director(datastore, holder)
    history = [{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "tell me " * 20}]
    first = await director.route(orjson.dumps({"model": "m", "messages": history, "stream": True}), CHAT, None)
    answer = " ".join(["word"] * 45 + ["end"] * 4)
    first.response_headers(200, None, "text/event-stream", False)
    for i, chunk in enumerate(chunks := sse(answer)):
        first.response_body(chunk, i == len(chunks) - 1)
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and more"}]
    second = await director.route(orjson.dumps({"model": "m", "messages": history}), CHAT, None)
    assert second.result is not None
    match = second.result.cycle_state[PREFIX_MATCH_KEY]
    prompt_ids = encode(render_chat(history[:2]))
    answered = len(prompt_ids) + len(encode(answer))
    second.finish()
    return match.matched.get(first.targets[0], 0), len(prompt_ids) // BLOCK, answered // BLOCK


async def test_the_answer_extends_the_endpoints_prefix_for_the_next_turn() -> None:
    matched, prompt_blocks, with_answer = await next_turn_match(index_responses=True)
    assert with_answer > prompt_blocks + 2
    assert matched == with_answer


async def test_without_the_parameter_only_the_prompt_is_recorded() -> None:
    matched, prompt_blocks, _ = await next_turn_match(index_responses=False)
    assert matched == prompt_blocks


def test_only_a_configured_producer_is_given_the_chunks() -> None:
    on = RuntimeHolder().load_text(config(True))
    off = RuntimeHolder().load_text(config(False))
    assert [type(s.plugin) for s in on.response_streaming] == [ApproxPrefixCacheProducer]
    assert off.response_streaming == ()


def test_completion_text_reads_json_bodies_and_event_streams() -> None:
    assert completion_text(b"".join(sse("a b c"))) == "a b c"
    assert completion_text(orjson.dumps({"choices": [{"message": {"content": "hi there"}}]})) == "hi there"
    assert completion_text(orjson.dumps({"choices": [{"text": "done"}]})) == "done"
    completions = b'data: {"choices":[{"text":"one"}]}\n\ndata: {"choices":[{"text":" two"}]}\n\n'
    assert completion_text(completions) == "one two"
    for garbage in (b"", b"{not json", b"data: {oops\n\n", b'{"choices": []}', b'{"choices": [{"message": 3}]}'):
        assert completion_text(garbage) is None
