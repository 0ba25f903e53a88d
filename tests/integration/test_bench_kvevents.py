"""`python -m picker_bench.kvevents --record/--replay` against a real ZMQ publisher."""

from __future__ import annotations

import asyncio
from pathlib import Path

import yaml
import zmq.asyncio

from picker.kvevents.decode import BlockRemoved
from picker_bench.kvevents import record, replay
from tests.integration.test_kvevents_subscriber import PROMPT, Publisher, engine_keys, stored


async def test_a_recorded_stream_replays_every_message_in_order(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    publisher = Publisher(ctx)
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text(yaml.safe_dump([{"address": "127.0.0.1:9000", "kvEventsAddress": publisher.address}]))
    recording = tmp_path / "events.bin"
    try:
        recorder = asyncio.create_task(asyncio.to_thread(record, endpoints, recording, 0.5))
        await publisher.subscribed()
        publisher.publish(stored(PROMPT[:24]))
        publisher.publish(stored(PROMPT, first=6))
        publisher.publish(BlockRemoved(tuple(engine_keys(PROMPT)[7:]), "GPU"))
        assert await asyncio.wait_for(recorder, 30) == 3
    finally:
        await publisher.close()
        ctx.term()
    cost = replay(recording, block_size=4)
    assert (cost.messages, cost.stored_blocks, cost.removed_blocks) == (3, 10, 3)
    assert cost.decode_s >= 0 and cost.apply_s >= 0
    assert "3 messages" in cost.text()
