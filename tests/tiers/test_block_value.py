"""The block value format: what it encodes decodes back, and every mismatch or damage is a miss
(never an exception, never a value served): tokens, parent, hash, fingerprint, dtype, shape,
flipped or missing bytes, a missing or wrong MAC."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tier_values import ROOT, SPEC, chain, kv_bytes, value_of
from xxhash import xxh3_64_intdigest

from kvcache.hashing import pack_tokens
from kvcache.tiers import BlockValue, Miss, decode, encode, storage_key

TOKENS = list(range(10, 22))  # three blocks of four


def test_a_value_round_trips() -> None:
    key, data = value_of(TOKENS, 1, seed=3)
    _, parent, packed = chain(TOKENS)[1]
    got = decode(data, SPEC, key=key, parent=parent, tokens=packed)
    assert isinstance(got, BlockValue)
    assert (got.key, got.parent, got.tokens, got.top) == (key, parent, packed, False)
    assert bytes(got.kv) == kv_bytes(3)


@pytest.mark.parametrize(
    ("expect", "reason"),
    [
        ({"tokens": pack_tokens([1, 2, 3, 4])}, "other tokens"),
        ({"parent": ROOT}, "another parent"),
        ({"key": 7}, "another block's hash"),
    ],
)
def test_what_the_reader_expects_must_match(expect: dict[str, object], reason: str) -> None:
    _, data = value_of(TOKENS, 1)
    assert decode(data, SPEC, **expect) == Miss(reason)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (SPEC._replace(identity="model-b|weights=float32"), "fingerprint"),
        (SPEC._replace(dtype="float16"), "dtype"),
        (SPEC._replace(num_kv_heads=2, block_nbytes=2 * SPEC.block_nbytes), "shape"),
        (SPEC._replace(block_size=8), "shape"),
    ],
)
def test_another_engine_misses(spec: object, reason: str) -> None:
    _, data = value_of(TOKENS, 0)
    got = decode(data, spec)  # type: ignore[arg-type]
    assert isinstance(got, Miss) and reason in got.reason


@given(st.data())
def test_any_flipped_byte_or_truncation_is_a_miss(data: st.DataObject) -> None:
    _, value = value_of(TOKENS, 2, seed=5)
    damaged = bytearray(value)
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(value) - 1))
        damaged[i] ^= data.draw(st.integers(1, 255))
    else:
        damaged = damaged[: data.draw(st.integers(0, len(value) - 1))]
    assert isinstance(decode(bytes(damaged), SPEC), Miss)


def test_a_relabelled_value_passes_without_a_key_and_never_with_one() -> None:
    """Prompt B's K/V under prompt A's tokens, re-encoded by someone without the key: trusted
    input without a key (the documented boundary), refused with one."""
    key, parent, packed = chain(TOKENS)[0]
    crafted = encode(SPEC, key, parent, packed, kv_bytes(99), top=True)
    assert isinstance(decode(crafted, SPEC, key=key, tokens=packed), BlockValue)
    assert decode(crafted, SPEC, mac_key=b"secret") == Miss("no MAC, and a cache key is set")
    forged = encode(SPEC, key, parent, packed, kv_bytes(99), top=True, mac_key=b"guess")
    assert decode(forged, SPEC, mac_key=b"secret") == Miss("MAC mismatch")
    signed = encode(SPEC, key, parent, packed, kv_bytes(1), top=True, mac_key=b"secret")
    assert isinstance(decode(signed, SPEC, mac_key=b"secret"), BlockValue)
    # A signed value whose K/V bytes were swapped for another's (checksum fixed up): refused.
    body_end = len(signed) - 32 - 8
    body = signed[: body_end - SPEC.block_nbytes] + kv_bytes(99)
    swapped = body + struct.pack("<Q", xxh3_64_intdigest(body)) + signed[-32:]
    assert decode(swapped, SPEC, mac_key=b"secret") == Miss("MAC mismatch")


def test_encode_refuses_parts_that_do_not_fit() -> None:
    key, parent, packed = chain(TOKENS)[0]
    with pytest.raises(ValueError, match="K/V"):
        encode(SPEC, key, parent, packed, b"short", top=True)
    with pytest.raises(ValueError, match="tokens"):
        encode(SPEC, key, parent, packed * 2, kv_bytes(0), top=True)


def test_keys_differ_by_dtype_block_size_and_identity() -> None:
    keys = {
        storage_key(spec, 5)
        for spec in (SPEC, SPEC._replace(dtype="float16"), SPEC._replace(block_size=8),
                     SPEC._replace(identity="other"))
    }  # fmt: skip
    assert len(keys) == 4
    assert storage_key(SPEC, 5) == storage_key(SPEC, 5)  # deterministic: no process state
