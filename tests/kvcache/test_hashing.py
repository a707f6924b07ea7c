"""Chained block hashes: full blocks only, chained through the parent, namespaced by the root."""

from __future__ import annotations

import struct

import pytest
from xxhash import xxh3_64_intdigest

from kvcache import block_hashes, hash_block, namespace_root
from kvcache.hashing import HASH_SEED, pack_tokens

ROOT = namespace_root("model-a")


def test_hash_block_is_seeded_xxh3_over_parent_and_little_endian_int64_tokens() -> None:
    tokens = [1, 2, 70_000, 2**40]
    expected = xxh3_64_intdigest(struct.pack("<Q4q", ROOT, *tokens), seed=HASH_SEED)
    assert hash_block(ROOT, tokens) == expected
    assert hash_block(ROOT, tokens) != xxh3_64_intdigest(struct.pack("<Q4q", ROOT, *tokens))


def test_pack_tokens_is_little_endian_int64() -> None:
    assert pack_tokens([1, -1]) == struct.pack("<2q", 1, -1)


@pytest.mark.parametrize(("num_tokens", "num_hashes"), [(0, 0), (15, 0), (16, 1), (31, 1), (33, 2)])
def test_only_full_blocks_get_hashes(num_tokens: int, num_hashes: int) -> None:
    assert len(block_hashes(list(range(num_tokens)), 16, ROOT)) == num_hashes


def test_block_hashes_chain_through_hash_block() -> None:
    tokens = list(range(48))
    h0 = hash_block(ROOT, tokens[:16])
    h1 = hash_block(h0, tokens[16:32])
    h2 = hash_block(h1, tokens[32:48])
    assert block_hashes(tokens, 16, ROOT) == [h0, h1, h2]


def test_equal_block_after_different_prefix_hashes_differently() -> None:
    same_tail = [7] * 16
    a = block_hashes([1] * 16 + same_tail, 16, ROOT)
    b = block_hashes([2] * 16 + same_tail, 16, ROOT)
    assert a[1] != b[1]


def test_partial_tail_does_not_change_full_block_hashes() -> None:
    tokens = list(range(32))
    assert block_hashes(tokens + [5, 6], 16, ROOT) == block_hashes(tokens, 16, ROOT)


def test_namespace_root_separates_models_and_salts() -> None:
    roots = {
        namespace_root("model-a"),
        namespace_root("model-b"),
        namespace_root("model-a", "user-1"),
        namespace_root("model-a", "user-2"),
        namespace_root("model-a", ""),
    }
    assert len(roots) == 5
    assert namespace_root("model-a", "user-1") == namespace_root("model-a", "user-1")


def test_different_roots_give_different_chains() -> None:
    tokens = list(range(16))
    other = namespace_root("model-a", "salt")
    assert block_hashes(tokens, 16, ROOT) != block_hashes(tokens, 16, other)


def test_hashes_are_64_bit_ints() -> None:
    for h in block_hashes(list(range(64)), 16, ROOT):
        assert 0 <= h < 2**64


def test_bad_block_size_is_rejected() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2, 3], 0, ROOT)
