"""vLLM's block hashes (`picker.kvevents.vllm_hash`) against vectors from vLLM's own definition.

cbor2 is not in the project's environment, so the vectors are hard-coded. They were computed
with cbor2 6.3.0 (PyPI) in a throwaway venv by vLLM's definitions as written in
`vllm/utils/hashing.py` and `vllm/v1/core/kv_cache_utils.py`:
`sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True))`,
`sha256(x) = sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))`,
`NONE_HASH = H(seed)`, `h_i = H((h_{i-1}, tuple(block tokens), extra_keys))` and the event's
hash `int.from_bytes(h_i, "big") & (2**64 - 1)`, over the tokens of `TOKENS` in blocks of 4.
"""

from __future__ import annotations

import hashlib

import pytest

from picker.kvevents.vllm_hash import (
    SHA256,
    SHA256_CBOR,
    VllmBlockHasher,
    canonical_cbor,
    extra_keys,
    none_hash,
)
from picker.prefix.hashing import chain_seed, token_block_hashes

TOKENS = [0, 23, 24, 255, 256, 65535, 65536, 4294967295]  # every CBOR integer width

NONE_HASHES = {
    (SHA256_CBOR, "42"): "9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780",
    (SHA256_CBOR, "vllm-none-hash"): "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
    (SHA256, "42"): "c0bc02c9fc92a4944335649961b9e55cc41b194bece4801e8c6ef0f0f3f5884a",
    (SHA256, "vllm-none-hash"): "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
}

# (algorithm, seed, lora_name, cache_salt) -> the two blocks' event hashes.
CHAINS = {
    (SHA256_CBOR, "42", None, None): [0x745E4A01D0896F98, 0x3E1FF36986143AB9],
    (SHA256_CBOR, "42", "ad", None): [0x7C1E985D722111EC, 0x74A3C0501EAAE897],
    (SHA256_CBOR, "42", "ad", "s1"): [0x6BCAA6CFB4CBB94C, 0x0DB60FE3DD066F0E],
    (SHA256_CBOR, "42", None, "s1"): [0xD71E5D8EE59F8B56, 0x66A88BFC83F3CE0E],
    (SHA256_CBOR, "vllm-none-hash", None, None): [0xAE74C52DB0F7A8E2, 0x2E01C476A1E11E0A],
    (SHA256_CBOR, "vllm-none-hash", "ad", "s1"): [0xBDCB130D7A6C410E, 0x223493F1DBD8851B],
    (SHA256, "42", None, None): [0x18777D48E9067734, 0x1921B5BBB91350B3],
    (SHA256, "42", "ad", None): [0xB4C110E9C2975AAE, 0x846C709A5723CDB2],
    (SHA256, "42", "ad", "s1"): [0x04402963EDD733D2, 0x7D3A48D941BEED88],
    (SHA256, "vllm-none-hash", None, "s1"): [0x2BD8D5C4553B0AF1, 0xA1194495AE79FB66],
}


def test_canonical_cbor_matches_cbor2() -> None:
    value = (b"\x01" * 32, tuple(range(30)), ("ad", "s1"), -1, -300, True)
    expected = (
        "86"  # array(6)
        "5820"
        + "01" * 32  # bytes(32)
        + "981e"
        + "".join(f"{i:02x}" for i in range(24))
        + "".join(f"18{i:02x}" for i in range(24, 30))
        + "82"
        + "626164"
        + "627331"  # ["ad", "s1"]
        + "20"
        + "39012b"
        + "f5"  # -1, -300, true
    )
    assert canonical_cbor(value).hex() == expected
    assert canonical_cbor(None) == b"\xf6"
    assert canonical_cbor("42") == bytes.fromhex("623432")


@pytest.mark.parametrize("value", [1 << 64, 1.5, {"a": 1}])
def test_canonical_cbor_refuses_what_block_inputs_never_hold(value: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        canonical_cbor(value)


@pytest.mark.parametrize(("algorithm", "seed"), list(NONE_HASHES))
def test_none_hash(algorithm: str, seed: str) -> None:
    assert none_hash(algorithm, seed).hex() == NONE_HASHES[(algorithm, seed)]


def test_first_block_by_hand() -> None:
    """The first block's CBOR input written out byte by byte, hashed with hashlib alone."""
    root = bytes.fromhex(NONE_HASHES[(SHA256_CBOR, "42")])
    block = "84" + "00" + "17" + "1818" + "18ff"  # array(4): 0, 23, 24, 255
    data = bytes.fromhex("83" + "5820" + root.hex() + block + "f6")  # (parent, block, None)
    digest = hashlib.sha256(data).digest()
    assert int.from_bytes(digest[-8:], "big") == CHAINS[(SHA256_CBOR, "42", None, None)][0]


@pytest.mark.parametrize(("algorithm", "seed", "lora", "salt"), list(CHAINS))
def test_chains(algorithm: str, seed: str, lora: str | None, salt: str | None) -> None:
    hasher = VllmBlockHasher(algorithm, seed)
    keys = token_block_hashes(TOKENS, 4, chain_seed(lora or "m", salt))
    assert hasher.block_hashes(keys, TOKENS, 4, lora, salt) == CHAINS[(algorithm, seed, lora, salt)]
    # The same prefix again comes from the digest cache, the same values.
    assert hasher.block_hashes(keys, TOKENS, 4, lora, salt) == CHAINS[(algorithm, seed, lora, salt)]


def test_continuing_a_chain_from_its_parent_digest() -> None:
    hasher = VllmBlockHasher(SHA256_CBOR, "42")
    first = hasher.digests(TOKENS[:4], 4, "ad", "s1")
    second = hasher.digests(TOKENS[4:], 4, "ad", "s1", parent=first[-1], first_block=1)
    assert [int.from_bytes(d[-8:], "big") for d in first + second] == CHAINS[(SHA256_CBOR, "42", "ad", "s1")]


def test_cache_is_bounded_and_a_miss_recomputes_from_its_parent() -> None:
    hasher = VllmBlockHasher(SHA256_CBOR, "42", capacity=2)
    tokens = TOKENS + TOKENS
    keys = token_block_hashes(tokens, 4, 7)
    full = hasher.block_hashes(keys, tokens, 4)
    assert len(full) == 4 and full[:2] == CHAINS[(SHA256_CBOR, "42", None, None)]
    assert len(hasher._cache) <= 2
    assert hasher.block_hashes(keys, tokens, 4) == full
    assert hasher.block_hashes(keys[:2], tokens, 4) == full[:2]


def test_extra_keys() -> None:
    assert extra_keys(0, None, None) is None
    assert extra_keys(0, "ad", "s") == ("ad", "s")
    assert extra_keys(1, "ad", "s") == ("ad",)
    assert extra_keys(1, None, "s") is None


def test_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="sha256_cbor"):
        VllmBlockHasher("md5")
