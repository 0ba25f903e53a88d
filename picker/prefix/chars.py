"""Character blocks: the reference's approximate prefix hashing, for models with no tokenizer.

The prompt's UTF-8 bytes are cut into blocks of `blockSizeTokens × 4` bytes (4 characters a
token), truncated to `maxBlocks` blocks, and chained with xxhash64:
`h_i = xxh64(block_i ‖ little-endian uint64(h_{i-1}))`, `h_{-1} = xxh64(model ‖ cache_salt)`.
A trailing partial block is hashed too; a prompt shorter than one block gives no hashes.
"""

from __future__ import annotations

from struct import Struct

import orjson
import xxhash

from picker.framework.request import Api, InferenceRequest

CHARS_PER_TOKEN = 4
_UINT64_LE = Struct("<Q")


def char_chain_seed(model: str, cache_salt: str | None = None, tenant: str | None = None) -> int:
    """xxh64(model ‖ cache_salt) as in the reference; a tenant, when set, is appended behind a
    separator so tenants never share a key while tenant-less requests keep the reference seed."""
    data = (model + (cache_salt or "")).encode("utf-8", "surrogatepass")
    if tenant:
        data += b"\x00tenant\x00" + tenant.encode("utf-8", "surrogatepass")
    return xxhash.xxh64_intdigest(data)


def prompt_bytes(request: InferenceRequest) -> bytes | None:
    """The bytes the approximate index hashes: the prompt text, or for chat a deterministic
    JSON array of `{role, content}`; None for a prompt given as token ids (not hashed)."""
    if request.api is Api.CHAT_COMPLETIONS and request.messages is not None:
        return orjson.dumps([{"role": m.role, "content": m.content} for m in request.messages])
    if request.prompt_text is not None:
        return request.prompt_text.encode("utf-8", "surrogatepass")
    return None


def char_block_hashes(data: bytes, block_chars: int, seed: int, max_blocks: int) -> list[int]:
    """Chained xxhash64 of each `block_chars`-byte block of `data` (the tail block included)."""
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    if len(data) < block_chars:
        return []
    if max_blocks > 0:
        data = data[: max_blocks * block_chars]
    digest = xxhash.xxh64_intdigest
    pack = _UINT64_LE.pack
    hashes: list[int] = []
    h = seed
    for start in range(0, len(data), block_chars):
        h = digest(data[start : start + block_chars] + pack(h))
        hashes.append(h)
    return hashes
