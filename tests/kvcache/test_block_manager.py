"""BlockManager: one test per rule of the prefix cache (what the scheduler relies on)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import pytest

import kvcache.hashing
from kvcache import BlockManager, Purpose, namespace_root
from kvcache.hashing import pack_tokens
from kvcache.radix_tree import CONTINUATION_SCAN

B = 16
ROOT = namespace_root("model")


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def prefill(bm: BlockManager, rid: int, tokens: Sequence[int], root: int = ROOT) -> int:
    """Admit, compute and commit the whole prompt; return the cached token count."""
    cached = bm.allocate(rid, tokens, root).num_cached_tokens
    bm.commit(rid, tokens, len(tokens))
    bm.check_integrity()
    return cached


def run_once(
    bm: BlockManager, rid: int, tokens: Sequence[int], root: int = ROOT, keep_tail: bool = False
) -> int:
    """Prefill and finish a request. With ``keep_tail`` it is freed with its tokens, as the
    scheduler does, so its partial last block stays cached as a tail."""
    cached = prefill(bm, rid, tokens, root)
    if keep_tail:
        bm.free(rid, tokens, len(tokens))
    else:
        bm.free(rid)
    bm.check_integrity()
    return cached


@pytest.mark.parametrize("k", [1, 2, 3, 6])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_same_prompt_twice_computes_only_its_last_token(k: int, delta: int) -> None:
    n = k * B + delta
    bm = BlockManager(64, B)
    tokens = seq(1000, n)
    assert run_once(bm, 1, tokens, keep_tail=True) == 0
    # Full blocks, then the slots of the last block but one token, copied from the cached full
    # block or the first request's tail.
    assert bm.cached_prefix_length(tokens, ROOT) == n - 1
    assert run_once(bm, 2, tokens) == n - 1


@pytest.mark.parametrize("delta", [-1, 1])
def test_without_its_tail_a_prompt_reuses_full_blocks_only(delta: int) -> None:
    n = 3 * B + delta
    bm = BlockManager(64, B)
    tokens = seq(1000, n)
    run_once(bm, 1, tokens)
    assert run_once(bm, 2, tokens) == ((n - 1) // B) * B


def test_hundred_tokens_then_extended_prompt_hits_100() -> None:
    bm = BlockManager(64, B)
    first = seq(1, 100)
    run_once(bm, 1, first, keep_tail=True)
    assert run_once(bm, 2, first + seq(500, 20)) == 100  # 6 full blocks and the 4-token tail


def test_exact_32_tokens_twice_hits_31() -> None:
    bm = BlockManager(64, B)
    run_once(bm, 1, seq(1, 32))
    assert run_once(bm, 2, seq(1, 32)) == 31  # block 0, and 15 slots copied from block 1


def test_peek_is_pure_and_matches_allocate() -> None:
    bm = BlockManager(64, B)
    run_once(bm, 1, seq(1, 64))
    before = bm.stats
    assert bm.cached_prefix_length(seq(1, 70), ROOT) == 64
    assert bm.blocks_needed(seq(1, 70), ROOT) == 1
    assert bm.can_allocate(seq(1, 70), ROOT)
    assert bm.stats == before
    alloc = bm.allocate(2, seq(1, 70), ROOT)
    assert alloc.num_cached_tokens == 64 and len(alloc.block_table) == 5


def test_block_table_grows_and_is_returned_as_a_copy() -> None:
    bm = BlockManager(8, B)
    table = bm.allocate(1, seq(1, 20), ROOT).block_table
    assert len(table) == 2
    table.append(99)
    assert bm.block_table(1) == table[:2]
    assert bm.grow(1, 33) and len(bm.block_table(1)) == 3
    assert bm.grow(1, 30) and len(bm.block_table(1)) == 3  # never shrinks
    bm.check_integrity()


def test_allocate_fails_cleanly_when_short() -> None:
    bm = BlockManager(4, B)
    bm.allocate(1, seq(1, 40), ROOT)  # 3 blocks
    assert not bm.can_allocate(seq(100, 40), ROOT)
    before = bm.stats
    with pytest.raises(ValueError):
        bm.allocate(2, seq(100, 40), ROOT)
    assert bm.stats == before and 2 not in bm
    available = bm.num_available_blocks()
    assert not bm.grow(1, 5 * B)  # and changes nothing:
    assert len(bm.block_table(1)) == 3 and bm.num_available_blocks() == available
    assert bm.grow(1, 4 * B) and len(bm.block_table(1)) == 4
    bm.check_integrity()


def test_bad_requests_are_rejected() -> None:
    bm = BlockManager(8, B)
    with pytest.raises(ValueError):
        bm.allocate(1, [], ROOT)
    bm.allocate(1, seq(1, 20), ROOT)
    with pytest.raises(ValueError):
        bm.allocate(1, seq(1, 20), ROOT)
    with pytest.raises(ValueError):
        bm.commit(1, seq(1, 20), 21)
    with pytest.raises(ValueError):
        bm.commit(1, seq(1, 48), 48)  # beyond the 2-block table


def test_different_namespaces_never_share() -> None:
    bm = BlockManager(64, B)
    tokens = seq(1, 64)
    run_once(bm, 1, tokens, namespace_root("model"))
    assert run_once(bm, 2, tokens, namespace_root("model", "salt")) == 0
    assert run_once(bm, 3, tokens, namespace_root("other-model")) == 0
    assert run_once(bm, 4, tokens, namespace_root("model", "salt")) == 63


def test_forced_collision_misses_and_identical_content_still_hits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvcache.hashing, "xxh3_64_intdigest", lambda data, seed=0: 7)
    bm = BlockManager(64, B)
    a, b = seq(1, 48), seq(500, 48)
    table_a = bm.allocate(1, a, ROOT).block_table
    bm.commit(1, a, len(a))
    bm.free(1)
    assert bm.cached_prefix_length(b, ROOT) == 0  # every hash equal, tokens differ
    assert prefill(bm, 2, b) == 0
    assert set(bm.block_table(2)).isdisjoint(table_a)  # nothing of a's reused
    bm.free(2)
    bm.check_integrity()
    assert run_once(bm, 3, a) == 47  # identical content: a legitimate hit
    assert run_once(bm, 4, a[:16] + b[16:]) == 16  # first block equal, second collides


def test_commit_after_collision_keeps_later_blocks_private(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvcache.hashing, "xxh3_64_intdigest", lambda data, seed=0: 7)
    bm = BlockManager(64, B)
    run_once(bm, 1, seq(1, 17))
    prefill(bm, 2, seq(500, 33))  # block 0 collides with the cached one: stays private
    bm.free(2)
    assert bm.stats.blocks_cached == 1  # only request 1's block
    bm.check_integrity()


def test_eviction_takes_lru_leaves_first_from_a_tiny_pool() -> None:
    bm = BlockManager(6, 4)
    a, b = seq(1, 8), seq(100, 8)
    for rid, tokens in ((1, a), (2, b)):
        run_once(bm, rid, tokens + [0])  # 2 cached blocks each, the partial one is freed
    assert bm.stats.blocks_cached == 4 and bm.stats.blocks_free == 2

    def cached() -> tuple[int, int]:
        return bm.cached_prefix_length(a + [0], ROOT), bm.cached_prefix_length(b + [0], ROOT)

    bm.allocate(10, seq(1000, 12), ROOT)  # 2 free blocks, then evicts a's leaf (oldest leaf)
    assert bm.stats.evicted_blocks == 1 and cached() == (4, 8)
    bm.allocate(11, seq(2000, 4), ROOT)  # a's first block is now the oldest leaf
    assert cached() == (0, 8)
    bm.allocate(12, seq(3000, 4), ROOT)  # b's leaf before b's (older) parent
    assert cached() == (0, 4)
    bm.check_integrity()


def test_reuse_refreshes_lru_order() -> None:
    bm = BlockManager(4, 4)
    a, b = seq(1, 4), seq(100, 4)
    run_once(bm, 1, a + [0])
    run_once(bm, 2, b + [0])
    assert run_once(bm, 3, a + [0]) == 4  # touches a: b is now least recently used
    bm.allocate(10, seq(1000, 12), ROOT)  # 2 free + 1 eviction
    assert bm.cached_prefix_length(a + [0], ROOT) == 4
    assert bm.cached_prefix_length(b + [0], ROOT) == 0


def test_finishing_a_request_counts_as_its_last_use() -> None:
    bm = BlockManager(4, 4)
    a, b = seq(1, 4), seq(100, 4)
    prefill(bm, 1, a + [0])  # a's block is touched now ...
    run_once(bm, 2, b + [0])
    bm.free(1)  # ... and again when request 1 finishes, after b's
    bm.allocate(10, seq(1000, 12), ROOT)  # 2 free + 1 eviction: b is least recently used
    assert bm.cached_prefix_length(a + [0], ROOT) == 4
    assert bm.cached_prefix_length(b + [0], ROOT) == 0


def test_matched_path_is_locked_before_evicting_for_fresh_blocks() -> None:
    bm = BlockManager(4, 4)
    a, b = seq(1, 8), seq(100, 8)
    run_once(bm, 1, a)  # a's two blocks are the least recently used leaves
    run_once(bm, 2, b)
    assert bm.stats.blocks_cached == 4 and bm.stats.blocks_free == 0
    alloc = bm.allocate(3, a + [0], ROOT)  # matches a, needs one fresh block: evicts b's leaf
    assert alloc.num_cached_tokens == 8
    assert bm.cached_prefix_length(b + [0], ROOT) == 4
    bm.check_integrity()


def test_locking_cached_blocks_counts_against_availability() -> None:
    bm = BlockManager(4, 4)
    a = seq(1, 8)
    run_once(bm, 1, a)
    run_once(bm, 2, seq(100, 8))
    longer = a + seq(500, 9)  # 5 blocks: 2 matched (taken out of the reclaimable 4) + 3 fresh
    assert bm.num_available_blocks() == 4 and bm.blocks_needed(longer, ROOT) == 3
    assert not bm.can_allocate(longer, ROOT)
    with pytest.raises(ValueError):
        bm.allocate(3, longer, ROOT)
    bm.check_integrity()


def test_collided_block_is_inserted_once_the_colliding_node_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvcache.hashing, "xxh3_64_intdigest", lambda data, seed=0: 7)
    bm = BlockManager(3, 4)
    run_once(bm, 1, seq(1, 4))  # cached: one block, hash 7
    prefill(bm, 2, seq(100, 5))  # collides, stays private; takes the 2 free blocks
    assert bm.grow(2, 9)  # needs a third block: evicts request 1's
    bm.commit(2, seq(100, 9), 8)
    bm.free(2)
    assert bm.cached_prefix_length(seq(100, 9), ROOT) == 8
    assert bm.cached_prefix_length(seq(1, 5), ROOT) == 0
    bm.check_integrity()


def test_referenced_blocks_are_never_evicted() -> None:
    bm = BlockManager(6, 4)
    shared = seq(1, 8)
    run_once(bm, 1, shared + [0])
    held = bm.allocate(2, shared + [50], ROOT)  # holds the two cached blocks
    assert held.num_cached_tokens == 8
    assert bm.num_available_blocks() == 3
    big = bm.allocate(3, seq(1000, 12), ROOT).block_table
    assert set(big).isdisjoint(held.block_table)
    assert not bm.can_allocate(seq(2000, 4), ROOT)
    with pytest.raises(ValueError):
        bm.allocate(4, seq(2000, 4), ROOT)
    assert bm.block_table(2) == held.block_table
    bm.free(2)
    assert bm.cached_prefix_length(shared + [0], ROOT) == 8
    bm.check_integrity()


def test_duplicate_block_stays_private_and_returns_to_free_list() -> None:
    bm = BlockManager(16, B)
    tokens = seq(1, 33)
    t1 = bm.allocate(1, tokens, ROOT).block_table
    t2 = bm.allocate(2, tokens, ROOT).block_table  # both miss: computed twice
    bm.commit(1, tokens, 33)
    bm.commit(2, tokens, 33)
    assert bm.stats.blocks_in_use == 6  # 2x3 table blocks; request 2 pins request 1's nodes
    bm.free(1)
    bm.check_integrity()
    bm.free(2)
    bm.check_integrity()
    assert bm.stats.blocks_cached == 2  # request 1's copies only
    assert bm.stats.blocks_free == 14
    assert bm.allocate(3, tokens, ROOT).block_table[:2] == t1[:2] != t2[:2]


def test_chain_continues_below_a_duplicate_even_if_its_owner_left() -> None:
    bm = BlockManager(8, 4)
    prompt = seq(1, 5)
    bm.allocate(1, prompt, ROOT)
    bm.allocate(2, prompt, ROOT)
    bm.commit(1, prompt, 5)
    bm.commit(2, prompt, 5)  # block 0 duplicates request 1's: stays private, node is pinned
    bm.free(1)
    answer = prompt + seq(50, 4)
    assert bm.grow(2, len(answer))
    bm.commit(2, answer, 8)  # block 1 inserted below request 1's node
    bm.check_integrity()
    filler = seq(1000, 4 * bm.num_available_blocks())
    bm.allocate(3, filler, ROOT)  # evicts every cached block it can
    assert bm.cached_prefix_length(answer + [0], ROOT) == 8  # the pinned chain survived
    bm.free(2)
    bm.check_integrity()
    assert bm.cached_prefix_length(answer + [0], ROOT) == 8


def test_multi_turn_reuses_answer_blocks_committed_during_decode() -> None:
    bm = BlockManager(32, B)
    prompt = seq(1, 40)
    tokens = list(prompt)
    bm.allocate(1, tokens, ROOT)
    bm.commit(1, tokens, len(tokens))
    for step in range(30):  # decode: the sampled token's KV is written on the next step
        tokens.append(5000 + step)
        assert bm.grow(1, len(tokens))
        bm.commit(1, tokens, len(tokens) - 1)
        bm.check_integrity()
    bm.free(1)
    turn2 = tokens + seq(9000, 10)
    # 69 computed tokens => 4 full blocks (64 tokens), 2 of them from the answer.
    assert run_once(bm, 2, turn2) == 64


def test_readmission_is_counted_apart() -> None:
    bm = BlockManager(32, B)
    run_once(bm, 1, seq(1, 40))
    prompt = seq(1, 40) + seq(100, 10)
    prefill(bm, 2, prompt)
    assert (bm.stats.query_tokens, bm.stats.hit_tokens) == (90, 32)
    bm.free(2)  # preempted
    bm.allocate(2, prompt + [7, 8], ROOT, Purpose.READMISSION)
    stats = bm.stats
    assert (stats.query_tokens, stats.hit_tokens) == (90, 32)
    assert (stats.readmit_query_tokens, stats.readmit_hit_tokens) == (52, 48)
    assert stats.hit_rate == pytest.approx(32 / 90)


def test_stats_reflect_the_pool_now() -> None:
    bm = BlockManager(10, B)
    assert bm.stats.hit_rate == 0.0
    bm.allocate(1, seq(1, 40), ROOT)
    bm.commit(1, seq(1, 40), 40)
    s = bm.stats
    assert (s.blocks_in_use, s.blocks_cached, s.blocks_free) == (3, 0, 7)
    bm.free(1)
    s = bm.stats
    assert (s.blocks_in_use, s.blocks_cached, s.blocks_free) == (0, 2, 8)
    assert s.as_dict()["blocks_cached"] == 2 and "hit_rate" in s.as_dict()
    assert bm.num_available_blocks() == 10


def test_prefix_caching_disabled_never_matches_or_inserts() -> None:
    bm = BlockManager(16, B, enable_prefix_caching=False)
    tokens = seq(1, 64)
    assert run_once(bm, 1, tokens) == 0
    assert run_once(bm, 2, tokens) == 0
    assert bm.cached_prefix_length(tokens, ROOT) == 0
    assert bm.stats.blocks_cached == 0 and bm.stats.blocks_free == 16
    assert bm.stats.query_tokens == 128 and bm.stats.hit_tokens == 0


def test_check_integrity_catches_a_wrong_ref_count() -> None:
    bm = BlockManager(8, B)
    prefill(bm, 1, seq(1, 20))
    bm._cache.pool._ref[bm.block_table(1)[1]] += 1
    with pytest.raises(AssertionError, match="holders"):
        bm.check_integrity()


def test_check_integrity_catches_an_evictable_block_that_is_held() -> None:
    bm = BlockManager(8, B)
    prefill(bm, 1, seq(1, 20))
    block = bm.block_table(1)[0]
    bm._cache.eviction.evictable(block)  # what a release would do, were it the last holder
    with pytest.raises(AssertionError, match="evictable set"):
        bm.check_integrity()


def test_check_integrity_catches_a_block_cached_without_prefix_caching() -> None:
    """The no-caching policy's own promise (kvcache/cache_policy.py): nothing is cached."""
    bm = BlockManager(8, B, enable_prefix_caching=False)
    run_once(bm, 1, seq(1, 20))
    cache = bm._cache
    [block] = cache.take(1)  # what a commit would insert, were it caching
    [node] = cache.insert(ROOT, None, pack_tokens(seq(1, B)), [block], only_new=False).created
    cache.pool.release(block)
    cache.eviction.evictable(node.block_id)
    with pytest.raises(AssertionError, match="while disabled"):
        bm.check_integrity()


def test_core_imports_without_torch_or_the_store() -> None:
    code = (
        "import sys, kvcache, bench.microbench; "
        "assert 'torch' not in sys.modules and 'runner.kv_pool.store' not in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith(('torch', 'kvcache', 'runner')))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cache_version_changes_exactly_when_matches_can() -> None:
    """A match may be kept while cache_version holds: it moves on every insert and eviction,
    and on nothing that leaves the cached blocks as they are."""
    bm = BlockManager(6, 4)
    a, b = seq(1, 8), seq(100, 8)
    v0 = bm.cache_version
    bm.allocate(1, a + [0], ROOT)
    assert bm.cache_version == v0  # allocating fresh blocks caches nothing
    bm.commit(1, a + [0], 9)
    v1 = bm.cache_version
    assert v1 != v0  # two blocks cached
    bm.commit(1, a + [0], 9)  # nothing new
    bm.free(1)
    run_once(bm, 2, a + [0])  # all hits, nothing inserted
    assert bm.cache_version == v1 and bm.cached_prefix_length(a + [0], ROOT) == 8
    run_once(bm, 3, b + [0])
    v2 = bm.cache_version
    assert v2 != v1
    bm.can_allocate(seq(1000, 12), ROOT)  # a question: no eviction
    assert bm.cache_version == v2
    bm.allocate(10, seq(1000, 12), ROOT)  # evicts a's leaf
    assert bm.stats.evicted_blocks == 1 and bm.cache_version != v2
    assert bm.cached_prefix_length(a + [0], ROOT) == 4


def test_cached_blocks_list_the_tree_parents_first() -> None:
    """What a saved cache is made of: every tree block once, each after its parent, with its
    own tokens and namespace; the held ones too (a live request's committed blocks)."""
    bm = BlockManager(num_blocks=32, block_size=B)
    other = namespace_root("model", "salt")
    run_once(bm, 0, seq(0, 3 * B + 2))
    run_once(bm, 1, seq(0, 2 * B) + seq(500, B + 1))  # branches after two blocks
    prefill(bm, 2, seq(0, 2 * B + 1), other)  # still live, in another namespace
    blocks = bm.cached_blocks()
    assert len(blocks) == 3 + 1 + 2
    position = {b.block_id: i for i, b in enumerate(blocks)}
    for b in blocks:
        assert b.parent is None or position[b.parent] < position[b.block_id]
    tops = sorted((b.root == other, b.token_ids) for b in blocks if b.parent is None)
    assert tops == [(False, seq(0, B)), (True, seq(0, B))]
    assert sorted(b.token_ids[0] for b in blocks if b.root == ROOT) == [0, 16, 32, 500]


def test_an_uncounted_allocation_leaves_the_hit_counters_alone() -> None:
    bm = BlockManager(num_blocks=8, block_size=B)
    run_once(bm, 0, seq(0, 2 * B + 1))
    before = bm.stats
    alloc = bm.allocate(1, seq(0, 2 * B + 1), ROOT, Purpose.LOADING)
    assert alloc.num_cached_tokens == 2 * B
    after = bm.stats
    assert (after.query_tokens, after.hit_tokens) == (before.query_tokens, before.hit_tokens)
    bm.free(1)
    bm.check_integrity()


def test_a_request_that_reuses_nothing_still_fills_the_cache() -> None:
    """reads_cache=False (a prompt whose every position must be computed): no block is matched, all
    are fresh; committing them adds nothing (the blocks are cached already) and pins nothing
    (it holds no more than it was given); a later request still hits the cached ones."""
    bm = BlockManager(num_blocks=16, block_size=B)
    prompt = seq(0, 3 * B + 1)
    run_once(bm, 0, prompt)
    cached_before = bm.stats.blocks_cached
    assert bm.can_allocate(prompt, ROOT, reads_cache=False)
    alloc = bm.allocate(1, prompt, ROOT, reads_cache=False)
    assert alloc.num_cached_tokens == 0 and len(alloc.block_table) == 4
    bm.commit(1, prompt, len(prompt))
    bm.check_integrity()
    assert bm.stats.blocks_in_use == 4  # its own four, no pinned copy
    bm.free(1)
    bm.check_integrity()
    assert bm.stats.blocks_cached == cached_before
    assert bm.stats.hit_tokens == 0 and bm.stats.query_tokens == 2 * len(prompt)
    assert run_once(bm, 2, prompt) == 3 * B


def test_reading_nothing_needs_room_for_every_block() -> None:
    bm = BlockManager(num_blocks=5, block_size=B)
    prompt = seq(0, 3 * B + 1)
    run_once(bm, 0, prompt)  # 3 cached blocks, 2 free
    prefill(bm, 1, seq(0, B) + [999])  # holds the first cached block and one free one
    assert bm.can_allocate(prompt, ROOT)  # 3 matched + 1 fresh: the last free block
    assert not bm.can_allocate(prompt, ROOT, reads_cache=False)  # 4 fresh: 1 free + 2 reclaimable


def test_a_request_that_reuses_nothing_publishes_new_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=B)
    prompt = seq(0, 3 * B + 1)
    bm.allocate(0, prompt, ROOT, reads_cache=False)
    bm.commit(0, prompt, 2 * B)  # in chunks, as a chunked prefill commits
    bm.commit(0, prompt, len(prompt))
    bm.free(0)
    bm.check_integrity()
    assert bm.stats.blocks_cached == 3 and run_once(bm, 1, prompt) == 3 * B


def test_cached_continuation_is_what_an_earlier_request_went_on_with() -> None:
    """A request whose tokens an earlier one shared is shown how that one went on: from the
    end of its own committed chain, through a partial tail and further blocks, most recent
    path first, never across namespaces, and nothing once the tail leaves every cached path."""
    bm = BlockManager(64, B)
    earlier = seq(1000, 4 * B)
    run_once(bm, 1, earlier)
    later = earlier[: B + 5]  # one full block committed, five tokens of the next
    prefill(bm, 2, later[:B] + [7])  # its own chain: the first block only
    assert bm.cached_continuation(2, later, 20) == earlier[B + 5 : B + 25]
    assert bm.cached_continuation(2, later, 3) == earlier[B + 5 : B + 8]
    assert bm.cached_continuation(2, later[:B] + [99], 4) == []  # left every cached path
    assert bm.cached_continuation(2, earlier, 4) == []  # nothing cached went further
    # Two paths below the same prefix: the most recently used one is shown.
    other = earlier[: B + 5] + seq(5000, 3 * B)
    run_once(bm, 3, other)
    assert bm.cached_continuation(2, later, 4) == other[B + 5 : B + 9]
    # A whole block of tail not committed yet is followed down by its hash first.
    bm.allocate(5, earlier[: B + 1], ROOT)
    bm.commit(5, earlier[: B + 1], B)
    assert bm.cached_continuation(5, earlier[: 2 * B + 3], 4) == earlier[2 * B + 3 : 2 * B + 7]
    elsewhere = namespace_root("model", "tenant")
    prefill(bm, 4, earlier[:3], elsewhere)
    assert bm.cached_continuation(4, earlier[:3], 4) == []
    bm.check_integrity()
    off = BlockManager(64, B, enable_prefix_caching=False)
    run_once(off, 1, earlier)
    prefill(off, 2, later)
    assert off.cached_continuation(2, later, 4) == []


def test_cached_continuation_scans_a_bounded_number_of_children() -> None:
    """A partial block has no hash, so it is compared with the children one by one: under a
    node with more than CONTINUATION_SCAN of them (many prompts diverging after a shared
    block) there is no guess, rather than a scan of thousands every step."""
    shared = seq(1000, B)
    for count, expected in ((CONTINUATION_SCAN, True), (CONTINUATION_SCAN + 1, False)):
        bm = BlockManager(2 * count + 8, B)
        for i in range(count):
            run_once(bm, i, shared + seq(10_000 + 100 * i, B))
        prefill(bm, count, shared + [10_000])  # one block committed, a token of the next
        guess = bm.cached_continuation(count, shared + [10_000], 3)
        assert (guess == [10_001, 10_002, 10_003]) is expected


def test_one_allocation_reports_its_evicted_nodes_together() -> None:
    """The tiers copy evicted blocks off the pool in one batch: one call per allocation, with
    every tree node it evicted (leaf before the parent it left childless), before the blocks
    are handed out."""
    bm = BlockManager(6, 4)
    calls: list[list[tuple[int, list[int]]]] = []
    bm.watch(None, lambda nodes: calls.append([(n.block_id, n.token_ids) for n in nodes]))
    a, b = seq(1, 8), seq(100, 8)
    run_once(bm, 1, a)
    run_once(bm, 2, b)
    assert calls == []  # two blocks still free
    alloc = bm.allocate(3, seq(1000, 20), ROOT)  # 5 blocks: 2 free, then 3 evictions
    assert len(calls) == 1
    evicted = calls[0]
    assert [tokens for _, tokens in evicted] == [a[4:], a[:4], b[4:]]
    assert {block for block, _ in evicted} <= set(alloc.block_table)
    assert bm.cached_prefix_length(b + [0], ROOT) == 4
    bm.check_integrity()
