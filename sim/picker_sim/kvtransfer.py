"""vLLM's KV connector protocol (NixlConnector), as llm-d's `pd-sidecar` drives it.

Prefill/decode disaggregation in two requests carrying `kv_transfer_params`:

1. To the prefill pod: `{"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null}`
   (with `max_tokens: 1`, `stream: false`). The pod prefills, keeps the prompt's full blocks
   pinned for pickup, and answers with `kv_transfer_params` naming them:
   `{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [...],
   "remote_engine_id": ..., "remote_request_id": ..., "remote_host": ..., "remote_port": ...,
   "tp_size": 1}`.
2. To the decode pod: the original request with those `kv_transfer_params`. The pod fetches the
   blocks from the named engine, then decodes.

How the simulator moves the blocks: the decode pod asks the prefill pod over loopback HTTP
(`POST /sim/kv/pull` on the prefill pod's HTTP address, which `remote_host`/`remote_port` name:
the simulator's stand-in for NIXL's side channel) for the pinned blocks' hashes, which also
unpins them, as NIXL's completion notification does; the engine then waits the transfer time
the timing profile gives (tokens x KV bytes per token / transfer bandwidth) before it caches the
received blocks. Both, because each half needs the other: only the prefill pod knows whether the
blocks are still there (expired after the pod's KV transfer timeout, vLLM's
VLLM_NIXL_ABORT_REQUEST_TIMEOUT, or never pinned), which decides between a transfer and vLLM's
fallback to a local prefill; and the time of a real RDMA read at the profile's bandwidth, scaled
like every other simulated duration by `--time-scale`, is what the benchmarks need to see, not
the cost of moving the bytes between two processes on one machine.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
PULL_PATH = "/sim/kv/pull"
_PULL_TIMEOUT = aiohttp.ClientTimeout(total=10)


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode request's prompt was prefilled: the blocks to fetch, and from where."""

    engine_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """A request's `kv_transfer_params`: produce KV for a remote decode, or consume a remote prefill."""

    do_remote_decode: bool
    remote_prefill: RemotePrefill | None


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"kv_transfer_params.{key} must be a boolean")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def block_id_list(value: object) -> tuple[int, ...] | None:
    """`value` as block ids (a list of non-negative integers), or None if it is not one."""
    if not isinstance(value, list) or not all(_is_int(b) and b >= 0 for b in value):
        return None
    return tuple(value)


def parse_kv_transfer_params(value: object) -> KVTransferParams | None:
    """The request's `kv_transfer_params` (None when absent, null or asking for nothing);
    ValueError naming the field that is malformed."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("kv_transfer_params must be an object")
    decode, prefill = _flag(value, "do_remote_decode"), _flag(value, "do_remote_prefill")
    if decode and prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true")
    if not prefill:
        return KVTransferParams(True, None) if decode else None
    engine_id, host, port = value.get("remote_engine_id"), value.get("remote_host"), value.get("remote_port")
    block_ids = block_id_list(value.get("remote_block_ids"))
    if not isinstance(engine_id, str) or not engine_id:
        raise ValueError("kv_transfer_params.remote_engine_id must be a non-empty string")
    if block_ids is None:
        raise ValueError("kv_transfer_params.remote_block_ids must be a list of non-negative integers")
    if not isinstance(host, str) or not host:
        raise ValueError("kv_transfer_params.remote_host must be a non-empty string")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError("kv_transfer_params.remote_port must be a port number")
    return KVTransferParams(False, RemotePrefill(engine_id, block_ids, host, port))


def producer_params(
    engine_id: str, block_ids: tuple[int, ...], request_id: str, host: str, port: int
) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill answer carries: what the decode pod fetches, from where."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(block_ids),
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


class BlockFetcher:
    """The decode side of a transfer: asks the remote pod for its pinned blocks over HTTP."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self, remote: RemotePrefill) -> list[int] | None:
        """The hashes of the remote engine's pinned blocks, now unpinned there; None if the remote
        does not have them (expired, taken, another engine) or cannot be reached."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=_PULL_TIMEOUT)
        url = f"http://{remote.host}:{remote.port}{PULL_PATH}"
        body = {"remote_engine_id": remote.engine_id, "remote_block_ids": list(remote.block_ids)}
        try:
            async with self._session.post(url, data=orjson.dumps(body)) as resp:
                if resp.status != 200:
                    log.warning("KV pull from %s: %s %s", url, resp.status, (await resp.text())[:200])
                    return None
                answer = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            log.warning("KV pull from %s failed: %r", url, exc)
            return None
        hashes = answer.get("block_hashes") if isinstance(answer, dict) else None
        if not isinstance(hashes, list) or not all(_is_int(h) for h in hashes):
            log.warning("KV pull from %s: malformed answer", url)
            return None
        return hashes

    async def close(self) -> None:
        """Close the HTTP client (the pod stops)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
