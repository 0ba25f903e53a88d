"""vLLM's prefix-cache block hashes, reproduced from their documented definition.

vLLM (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`) hashes the full blocks of a
prompt as a chain: `h_i = H((h_{i-1}, tuple(block_i token ids), extra_keys_i))`, the first
block's parent being `NONE_HASH = H(seed)`, where the seed is the string in `PYTHONHASHSEED`
(or, since vLLM replaced the random default for cryptographic algorithms, `"vllm-none-hash"`).
`H` is one of:
- `sha256_cbor` (the default): SHA-256 of the input as canonical CBOR (`cbor2.dumps(x,
  canonical=True)`); the few types a block's input holds (ints, bytes, str, None, tuples) are
  encoded here, so no CBOR library is needed.
- `sha256`: SHA-256 of `pickle.dumps(x, protocol=5)` (Python's own pickle, as vLLM uses it).
A block's `extra_keys` is the LoRA name (every block; vLLM hashed the adapter's int id before
PR #27211) then `cache_salt` (first block only), or None when there are neither. Parents chain
as the full 32-byte digests; a KV event carries each digest as the integer of its last 8 bytes,
big-endian (`maybe_convert_block_hash`).
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
from collections.abc import Callable, Sequence
from functools import lru_cache
from operator import itemgetter
from typing import Any

SHA256_CBOR = "sha256_cbor"
SHA256 = "sha256"
ALGORITHMS = (SHA256_CBOR, SHA256)
DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for sha256* when PYTHONHASHSEED is unset
_U64 = (1 << 64) - 1


def canonical_cbor(value: Any) -> bytes:
    """`value` as canonical CBOR (RFC 8949 §4.2.1 shortest forms), for ints below 2**64, bytes,
    str, None, bools and tuples/lists of those: what `cbor2.dumps(value, canonical=True)` gives."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
    elif n < 0x100:
        out += bytes((major << 5 | 24, n))
    elif n < 0x10000:
        out.append(major << 5 | 25)
        out += n.to_bytes(2, "big")
    elif n < 0x100000000:
        out.append(major << 5 | 26)
        out += n.to_bytes(4, "big")
    elif n <= _U64:
        out.append(major << 5 | 27)
        out += n.to_bytes(8, "big")
    else:
        raise ValueError(f"integer {n} needs a CBOR bignum, which block inputs never hold")


def _encode(value: Any, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True or value is False:
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        if value >= 0:
            _head(0, value, out)
        else:
            _head(1, -1 - value, out)
    elif isinstance(value, (bytes, bytearray)):
        _head(2, len(value), out)
        out += value
    elif isinstance(value, str):
        data = value.encode("utf-8")
        _head(3, len(data), out)
        out += data
    elif isinstance(value, (tuple, list)):
        _head(4, len(value), out)
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as a block hash input")


def sha256_cbor(value: Any) -> bytes:
    """vLLM's `sha256_cbor`."""
    return hashlib.sha256(canonical_cbor(value)).digest()


@lru_cache(maxsize=262_144)
def _token_cbor(token: int) -> bytes:
    return canonical_cbor(token)


def _sha256_cbor_block(parent: bytes, tokens: Sequence[int], extra: tuple[str, ...] | None) -> bytes:
    """`sha256_cbor((parent, tuple(tokens), extra))` without a pass over Python objects per
    token: a block's input is always a 32-byte parent, unsigned token ids and short strings."""
    out = bytearray(b"\x83\x58\x20")
    out += parent
    _head(4, len(tokens), out)
    out += b"".join(map(_token_cbor, tokens))
    _encode(extra, out)
    return hashlib.sha256(out).digest()


def _sha256_pickle_block(parent: bytes, tokens: Sequence[int], extra: tuple[str, ...] | None) -> bytes:
    return sha256_pickle((parent, tuple(tokens), extra))


def sha256_pickle(value: Any) -> bytes:
    """vLLM's `sha256` (pickle protocol 5, `pickle.HIGHEST_PROTOCOL` on the Pythons vLLM supports)."""
    return hashlib.sha256(pickle.dumps(value, protocol=5)).digest()


_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {SHA256_CBOR: sha256_cbor, SHA256: sha256_pickle}
_BlockHash = Callable[[bytes, Sequence[int], "tuple[str, ...] | None"], bytes]
_BLOCK_FUNCTIONS: dict[str, _BlockHash] = {SHA256_CBOR: _sha256_cbor_block, SHA256: _sha256_pickle_block}


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """The hash function vLLM names `algorithm` (`--prefix-caching-hash-algo`)."""
    try:
        return _FUNCTIONS[algorithm]
    except KeyError:
        raise ValueError(f"hash algorithm must be one of {ALGORITHMS}, not {algorithm!r}") from None


def none_hash(algorithm: str, seed: str = DEFAULT_SEED) -> bytes:
    """vLLM's `NONE_HASH`: the parent of every chain's first block."""
    return hash_function(algorithm)(seed)


def extra_keys(block: int, lora_name: str | None, cache_salt: str | None) -> tuple[str, ...] | None:
    """vLLM's `extra_keys` of text block `block`: LoRA name, then cache_salt on the first block."""
    keys = ((lora_name,) if lora_name else ()) + ((cache_salt,) if block == 0 and cache_salt else ())
    return keys or None


def external(digest: bytes) -> int:
    """A block hash as a KV event carries it: the last 8 bytes of the digest, big-endian."""
    return int.from_bytes(digest[-8:], "big")


class VllmBlockHasher:
    """Block hashes as one vLLM engine computes them, with a bounded cache of digests so that a
    prefix many requests share is hashed once.

    Digests are cached under caller-supplied chain keys (`picker.prefix.hashing` or any other
    chain over the same blocks): a key names a prefix, scope included, so equal keys mean an
    equal digest. When full, the oldest quarter of the cache goes.
    """

    def __init__(self, algorithm: str = SHA256_CBOR, seed: str = DEFAULT_SEED, capacity: int = 131_072) -> None:
        self.algorithm = algorithm
        self.seed = seed
        self.root = hash_function(algorithm)(seed)
        self._block = _BLOCK_FUNCTIONS[algorithm]
        self.capacity = capacity
        self._cache: dict[int, tuple[int, bytes]] = {}  # chain key -> (event hash, digest)

    def digests(
        self,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        parent: bytes | None = None,
        first_block: int = 0,
    ) -> list[bytes]:
        """Uncached digests of the full blocks of `token_ids` (block `first_block` onwards,
        chained from `parent`, or from `NONE_HASH` for a chain's start)."""
        block_hash = self._block
        digest = parent or self.root
        out: list[bytes] = []
        for i, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
            digest = block_hash(
                digest, token_ids[start : start + block_size], extra_keys(first_block + i, lora_name, cache_salt)
            )
            out.append(digest)
        return out

    def cached(self, keys: Sequence[int]) -> tuple[list[int], bytes | None]:
        """The event hashes of the leading `keys` whose digests are cached, and the last one's
        digest (the parent to continue from)."""
        found = list(map(self._cache.get, keys))
        if None in found:
            del found[found.index(None) :]
        known: list[tuple[int, bytes]] = found  # type: ignore[assignment]  # the Nones are cut off
        return list(map(_EVENT_HASH, known)), known[-1][1] if known else None

    def store(self, keys: Sequence[int], digests: Sequence[bytes]) -> list[int]:
        """Cache `digests` under `keys` (oldest quarter out when full); their event hashes."""
        cache = self._cache
        entries = [(external(d), d) for d in digests]
        cache.update(zip(keys, entries))
        if len(cache) > self.capacity:
            for key in list(itertools.islice(cache, max(len(cache) - self.capacity, self.capacity // 4))):
                del cache[key]
        return list(map(_EVENT_HASH, entries))

    def block_hashes(
        self,
        keys: Sequence[int],
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """The event hashes of the first `len(keys)` full blocks of `token_ids`, `keys[i]` naming
        the prefix up to block i; the digests of known keys are not computed again."""
        known, parent = self.cached(keys)
        miss = len(known)
        if miss == len(keys):
            return known
        tokens = token_ids[miss * block_size : len(keys) * block_size]
        return known + self.store(keys[miss:], self.digests(tokens, block_size, lora_name, cache_salt, parent, miss))


_EVENT_HASH = itemgetter(0)
