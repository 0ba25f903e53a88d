"""`picker sim`: vLLM-compatible simulated model servers for tests and benchmarks.

One process (one asyncio loop) serves many simulated pods. Each pod has vLLM's HTTP API and
metrics, a paged KV cache with automatic prefix caching whose hits really shorten time to first
token, and optionally a vLLM-style ZMQ KV-event publisher.

Library use (inside a test's event loop)::

    from picker_sim import Fleet, FleetConfig

    fleet = Fleet(FleetConfig(pods=4, profile="tiny", time_scale=10, kv_events_base_port=0))
    await fleet.start()
    try:
        pod = fleet.pods[0]
        pod.address              # "127.0.0.1:PORT" (base_port=0 picks free ports)
        pod.url                  # "http://127.0.0.1:PORT"
        pod.kv_events_endpoint   # "tcp://127.0.0.1:Q" (None without kv_events_base_port, or connecting)
        pod.faults.error_rate = 0.5               # or POST /sim/fault {"error_rate": 0.5}
        await pod.crash(); await pod.restart()    # cache cleared, AllBlocksCleared published
        sorted(pod.engine.cache.refs)             # the pod's cached block hashes
    finally:
        await fleet.stop()

`Fleet` is also an async context manager. Modules: `kvcache` (block pool, chained block hashes,
KV events), `engine` (scheduler and step loop), `profiles` (timing), `stats` (metrics page),
`events` (ZMQ publisher), `kvtransfer` (prefill/decode: vLLM's KV connector protocol), `faults`,
`pod` (HTTP server), `fleet`, `cli`, `selfbench`. The built-in tokenizer is
`picker.prefix.builtin_tokenizer`, shared with the router, and so are vLLM's block hashes
(`picker.kvevents.vllm_hash`), which the router's precise index computes too.

A distribution of its own (`sim/`, `picker-sim`), outside the product's wheel and image.
May import: prefix (picker's built-in tokenizer), kvevents (vLLM's block hashes); picker never
imports the simulator.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Faults", "Fleet", "FleetConfig", "Pod"]
_HOMES = {
    "Fleet": "picker_sim.fleet",
    "FleetConfig": "picker_sim.fleet",
    "Faults": "picker_sim.faults",
    "Pod": "picker_sim.pod",
}


def __getattr__(name: str) -> Any:
    # Lazy, so importing one module (e.g. `picker_sim.kvcache`) does not import aiohttp and zmq.
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'picker_sim' has no attribute {name!r}")
