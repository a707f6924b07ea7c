"""Tails: a finished request's partial last block, kept so later prompts copy its slots."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvcache import BlockManager, namespace_root
from kvcache.block_pool import BlockPool
from kvcache.eviction.lru import LRU
from kvcache.hashing import pack_tokens
from kvcache.partial_blocks import (
    MAX_TAILS_PER_PARENT,
    PartialBlocks,
    SlotCopy,
    Tail,
    common_tokens,
)
from kvcache.radix_tree import RadixTree

B = 16
ROOT = namespace_root("model")


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def finish(bm: BlockManager, rid: int, tokens: list[int], computed: int | None = None) -> int:
    """Admit, compute ``computed`` tokens (all by default), commit, free with the tokens;
    returns the cached token count at admission."""
    cached = bm.allocate(rid, tokens, ROOT).num_cached_tokens
    done = len(tokens) if computed is None else computed
    bm.commit(rid, tokens, done)
    bm.free(rid, tokens, done)
    bm.check_integrity()
    return cached


@given(
    st.lists(st.integers(0, 3), max_size=20),
    st.lists(st.integers(0, 3), max_size=20),
)
def test_common_tokens_counts_the_shared_leading_tokens(a: list[int], b: list[int]) -> None:
    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert common_tokens(pack_tokens(a), pack_tokens(b)) == expected


def test_a_beam_step_copies_its_parents_tail() -> None:
    """A prompt extended by one token (a beam's child) computes only that token: the full
    blocks are shared and the parent's partial block is copied into a block of the child's."""
    bm = BlockManager(64, B)
    parent = seq(1, 37)  # 2 full blocks and a 5-token tail
    parent_table = bm.allocate(1, parent, ROOT).block_table
    bm.commit(1, parent, len(parent))
    bm.free(1, parent, len(parent))
    alloc = bm.allocate(2, parent + [999], ROOT)
    assert alloc.num_cached_tokens == 37
    assert alloc.block_table[:2] == parent_table[:2]  # full blocks shared
    assert alloc.copy == SlotCopy(parent_table[2], alloc.block_table[2], 5)
    assert parent_table[2] not in alloc.block_table  # the tail is copied, never shared
    assert bm.stats.copied_tokens == 5
    bm.check_integrity()


def test_a_copy_comes_from_a_full_block_that_starts_with_the_tokens() -> None:
    bm = BlockManager(64, B)
    finish(bm, 1, seq(1, 48))  # three full blocks
    # Shares block 0 and the first 6 tokens of block 1, then goes its own way.
    alloc = bm.allocate(2, seq(1, 22) + seq(500, 20), ROOT)
    assert alloc.num_cached_tokens == 22
    assert alloc.copy is not None and alloc.copy.num_tokens == 6
    assert bm.stats.blocks_tails == 0


def test_a_prefix_of_a_tail_is_copied_and_one_token_is_always_computed() -> None:
    bm = BlockManager(64, B)
    finish(bm, 1, seq(1, 30))  # a 14-token tail
    assert bm.cached_prefix_length(seq(1, 20), ROOT) == 19  # capped: its last token computed
    assert bm.cached_prefix_length(seq(1, 16) + [7], ROOT) == 16  # nothing of the tail shared


def test_only_computed_tokens_make_a_tail() -> None:
    """A request preempted 5 tokens into its second block keeps those 5 slots, not more."""
    bm = BlockManager(64, B)
    tokens = seq(1, 30)
    finish(bm, 1, tokens, computed=21)
    assert bm.cached_prefix_length(tokens, ROOT) == 21


def test_a_longer_tail_replaces_the_one_it_extends() -> None:
    bm = BlockManager(64, B)
    finish(bm, 1, seq(1, 20))
    finish(bm, 2, seq(1, 25))  # its tail extends request 1's: one tail is left
    assert bm.stats.blocks_tails == 1
    finish(bm, 3, seq(1, 23))  # a prefix of the kept tail: not kept
    assert bm.stats.blocks_tails == 1
    finish(bm, 4, seq(1, 18) + [7, 7])  # diverges: kept beside it
    assert bm.stats.blocks_tails == 2
    assert bm.cached_prefix_length(seq(1, 26), ROOT) == 25


def test_tails_under_one_parent_are_capped_newest_kept() -> None:
    cache = PartialBlocks(B, BlockPool(64), LRU(64))
    tails = [Tail(i, pack_tokens([i + 1000]), None, ROOT) for i in range(MAX_TAILS_PER_PARENT + 3)]
    dropped = [block for tail in tails for block in cache.add(tail)]
    assert dropped == [0, 1, 2]
    assert len(cache) == MAX_TAILS_PER_PARENT


def test_partial_blocks_keep_a_tails_pool_state_until_it_is_evicted() -> None:
    """A kept tail is cached content with ref 0, evictable; a longer one under the same parent
    frees it; its parent's eviction frees the rest (kvcache/partial_blocks.py owns all three)."""
    pool, tree, lru = BlockPool(8), RadixTree(B), LRU(8)
    partials = PartialBlocks(B, pool, lru)
    parent_block, a, b = pool.take(3)
    [node] = tree.insert(ROOT, None, pack_tokens(seq(1, B)), [parent_block], only_new=False).created
    partials.keep(Tail(a, pack_tokens(seq(100, 3)), node, ROOT))
    assert pool.ref(a) == 0 and pool.is_cached_node(a) and a in lru.evictable_blocks()
    partials.keep(Tail(b, pack_tokens(seq(100, 5)), node, ROOT))  # starts with a's tokens
    assert a not in partials and not pool.is_cached_node(a) and a not in lru.evictable_blocks()
    partials.check_integrity(tree, {})
    assert partials.evict_under(node) == 1
    assert len(partials) == 0 and not pool.is_cached_node(b) and pool.num_free == 7
    pool.check_integrity()
    lru.check_integrity()
    assert not lru.evictable_blocks()


def test_a_tail_is_evicted_with_its_parent_and_by_lru() -> None:
    bm = BlockManager(4, 4)
    finish(bm, 1, seq(1, 6))  # block [1..4] cached, tail [5, 6]
    assert (bm.stats.blocks_cached, bm.stats.blocks_tails) == (2, 1)
    # Needs all 4 blocks: the older node goes first, and its tail with it.
    bm.allocate(2, seq(100, 16), ROOT)
    bm.check_integrity()
    assert (bm.stats.blocks_cached, bm.stats.blocks_tails) == (0, 0)
    assert bm.stats.evicted_blocks == 2
    bm.free(2)
    finish(bm, 3, seq(1, 6))
    bm.allocate(4, seq(200, 12), ROOT)  # 3 blocks: 2 free, then the LRU's oldest: the node,
    bm.check_integrity()
    assert bm.stats.evicted_blocks == 4  # which takes its tail with it


def test_no_tails_without_prefix_caching_or_for_requests_that_reuse_nothing() -> None:
    off = BlockManager(64, B, enable_prefix_caching=False)
    finish(off, 1, seq(1, 20))
    assert off.stats.blocks_tails == 0 and off.cached_prefix_length(seq(1, 20), ROOT) == 0
    bm = BlockManager(64, B)
    finish(bm, 1, seq(1, 20))
    alloc = bm.allocate(2, seq(1, 21), ROOT, reads_cache=False)
    assert alloc.num_cached_tokens == 0 and alloc.copy is None


def test_a_running_requests_partial_block_is_copied_too() -> None:
    """The same prompt admitted beside a running request copies the computed slots of its
    partial block (never more than it has computed)."""
    bm = BlockManager(64, B)
    prompt = seq(1, 40)
    first = bm.allocate(1, prompt, ROOT).block_table
    bm.commit(1, prompt, 36)  # a chunk: 2 full blocks and 4 slots of the third computed
    alloc = bm.allocate(2, prompt, ROOT)
    assert alloc.copy == SlotCopy(first[2], alloc.block_table[2], 4)
    bm.commit(1, prompt, 40)
    alloc = bm.allocate(3, prompt, ROOT)
    assert alloc.copy == SlotCopy(first[2], alloc.block_table[2], 7)  # its last token computed
    bm.check_integrity()
    bm.free(1, prompt, 40)  # now a tail: still there to copy from
    assert bm.cached_prefix_length(prompt, ROOT) == 39
    bm.check_integrity()
