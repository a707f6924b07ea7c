"""Block pool: every block is free, cached or in use (the order of eviction is the eviction
policy's: tests/kvcache/test_eviction_policies.py)."""

from __future__ import annotations

import pytest

from kvcache.block_pool import BlockPool


def states(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free, pool.num_cached, pool.num_in_use


def one(pool: BlockPool) -> int:
    (block,) = pool.take(1)
    return block


def test_fresh_pool_hands_out_every_block_once() -> None:
    pool = BlockPool(3)
    assert pool.take(0) == []
    taken = pool.take(2) + pool.take(1)
    assert taken == [0, 1, 2] and all(pool.ref(b) == 1 for b in taken)
    with pytest.raises(ValueError):
        pool.take(1)
    pool.check_integrity()


def test_take_is_all_or_nothing() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.take(3)
    assert states(pool) == (2, 0, 0)


def test_private_block_returns_to_free_list_and_tree_block_stays_cached() -> None:
    pool = BlockPool(4)
    private, node = one(pool), one(pool)
    pool.mark_cached(node)
    assert states(pool) == (2, 0, 2)
    assert pool.release(private) and pool.release(node)
    assert states(pool) == (3, 1, 0)
    assert pool.is_cached_node(node) and not pool.is_cached_node(private)
    pool.check_integrity()


def test_release_reports_zero_only_at_last_holder() -> None:
    pool = BlockPool(2)
    block = one(pool)
    pool.mark_cached(block)
    pool.acquire(block)
    assert not pool.release(block)
    assert pool.release(block)
    with pytest.raises(ValueError):
        pool.release(block)


def test_only_tree_blocks_can_be_shared() -> None:
    pool = BlockPool(2)
    block = one(pool)
    with pytest.raises(ValueError):
        pool.acquire(block)  # private: never shared
    pool.mark_cached(block)
    pool.release(block)
    pool.acquire(block)
    assert states(pool) == (1, 0, 1)
    pool.check_integrity()


def test_evict_moves_cached_block_to_free_list() -> None:
    pool = BlockPool(1)
    block = one(pool)
    pool.mark_cached(block)
    with pytest.raises(ValueError):
        pool.evict(block)  # still held
    pool.release(block)
    pool.evict(block)
    assert states(pool) == (1, 0, 0) and not pool.is_cached_node(block)
    pool.check_integrity()


def test_check_integrity_catches_a_wrong_count() -> None:
    pool = BlockPool(2)
    one(pool)
    pool._num_cached += 1  # corrupt the bookkeeping
    with pytest.raises(AssertionError, match="cached count"):
        pool.check_integrity()


def test_check_integrity_catches_a_referenced_block_on_free_list() -> None:
    pool = BlockPool(2)
    block = one(pool)
    pool._free.append(block)
    with pytest.raises(AssertionError, match="free list"):
        pool.check_integrity()
