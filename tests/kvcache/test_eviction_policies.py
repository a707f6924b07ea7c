"""Eviction policies (kvcache/eviction/): each one's victim order on one scripted scenario, a
policy added as one file and one entry in POLICIES, and the block manager's state machine run
under every policy with its integrity check."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import settings

import kvcache.eviction.policy as policy_module
from kvcache import BlockManager, namespace_root
from kvcache.eviction import POLICIES, EvictionPolicy, make_eviction_policy
from kvcache.eviction.lfu import LFU
from kvcache.eviction.lru import LRU
from kvcache.eviction.priority import PriorityEviction
from kvcache.eviction.ranked import RankedEviction
from kvcache.hashing import pack_tokens
from kvcache.partial_blocks import MAX_TAILS_PER_PARENT, PartialBlocks, Tail
from kvcache.radix_tree import Node
from tests.kvcache.test_block_manager_state_machine import FAST, BlockManagerMachine

B = 4
ROOT = namespace_root("model")
PROMPTS = {"a": [1, 1, 1, 1], "b": [2, 2, 2, 2], "c": [3, 3, 3, 3]}


class MRU(RankedEviction):
    """A policy written the way a new one is: this class in its own file under
    kvcache/eviction/, and ``"mru": MRU`` in POLICIES. The most recently used goes first."""

    def rank(self, block: int) -> tuple[int, ...]:
        return (-self.last.get(block, 0),)


@pytest.fixture
def with_mru(monkeypatch: pytest.MonkeyPatch) -> None:
    """POLICIES with the one entry a new policy adds."""
    monkeypatch.setattr(policy_module, "POLICIES", MappingProxyType({**POLICIES, "mru": MRU}))


class Removed:
    """The tree blocks evicted, in order (a block listener)."""

    def __init__(self) -> None:
        self.blocks: list[int] = []

    def blocks_stored(self, nodes: list[Node]) -> None:
        pass

    def blocks_removed(self, nodes: list[Node]) -> None:
        self.blocks += [node.block_id for node in nodes]


def use(bm: BlockManager, rid: int, name: str, priority: int = 0) -> None:
    """A request for one cached block of ``name`` and one token more: admitted, computed,
    committed and finished without a tail."""
    tokens = PROMPTS[name] + [0]
    bm.allocate(rid, tokens, ROOT, priority=priority)
    bm.commit(rid, tokens, len(tokens))
    bm.free(rid)


def victim_order(policy: str) -> list[str]:
    """The scenario: a, b, c cached in that order at priorities 5, 1, 3; then a used twice
    more and b once (at priority 0), so the last uses run c, a, b and the use counts c < b < a.
    Then fresh blocks are taken one at a time until all three are evicted."""
    bm = BlockManager(6, B, eviction_policy=policy)
    removed = Removed()
    bm.add_listener(removed)
    for rid, (name, priority) in enumerate((("a", 5), ("b", 1), ("c", 3))):
        use(bm, rid, name, priority)
    use(bm, 3, "a")
    use(bm, 4, "a")
    use(bm, 5, "b")
    names = {block.block_id: name for block in bm.cached_blocks() for name in PROMPTS
             if block.token_ids == PROMPTS[name]}  # fmt: skip
    assert len(names) == 3 and bm.stats.blocks_free == 3
    for rid in range(10, 16):  # one block each: 3 free ones, then an eviction each
        bm.allocate(rid, [100 + rid], ROOT)
        bm.check_integrity()
    return [names[block] for block in removed.blocks]


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        ("lru", ["c", "a", "b"]),  # the oldest last use first
        ("lfu", ["c", "b", "a"]),  # the fewest uses first
        ("priority", ["b", "c", "a"]),  # the lowest priority of its users first
    ],
)
def test_each_policy_evicts_in_its_order(policy: str, order: list[str]) -> None:
    assert victim_order(policy) == order


def test_a_new_policy_is_one_class_and_one_entry(with_mru: None) -> None:
    assert victim_order("mru") == ["b", "a", "c"]  # the newest last use first


@pytest.mark.parametrize("policy", ["lfu", "priority"])
def test_ties_are_broken_by_recency(policy: str) -> None:
    """Equal uses (lfu) and equal priorities (priority): the least recently used goes."""
    bm = BlockManager(6, B, eviction_policy=policy)
    removed = Removed()
    bm.add_listener(removed)
    for rid, name in enumerate("bca"):
        use(bm, rid, name)
    blocks = {tuple(b.token_ids): b.block_id for b in bm.cached_blocks()}
    for rid in range(10, 16):
        bm.allocate(rid, [100 + rid], ROOT)
    assert removed.blocks == [blocks[tuple(PROMPTS[name])] for name in "bca"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_policy_object_alone(name: str) -> None:
    """The protocol on its own: held blocks are never victims, a used block comes back at its
    new place, a removed one is forgotten, an empty set refuses."""
    policy: EvictionPolicy = make_eviction_policy(name, 8)
    for block in (0, 1, 2, 3):
        policy.used(block)
    for block in (0, 1, 2, 3):
        policy.evictable(block)
    policy.held(1)
    policy.removed(2)
    policy.held(0)  # a copy source used, as the block cache does it: out, used, back
    policy.used(0)  # now the most recent, and (lfu) the most used
    policy.evictable(0)
    assert set(policy.evictable_blocks()) == {0, 3}
    policy.check_integrity()
    assert [policy.victim(), policy.victim()] == [3, 0]
    with pytest.raises(ValueError, match="no evictable block"):
        policy.victim()
    policy.evictable(1)
    with pytest.raises(ValueError, match="evictable already"):
        policy.evictable(1)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_path_used_at_once_ranks_as_its_blocks_used_one_by_one(name: str) -> None:
    one_by_one, at_once = make_eviction_policy(name, 8), make_eviction_policy(name, 8)
    for blocks, priority in (([3, 1, 4], 2), ([1, 5], 0), ([2, 6, 1], 7)):
        for block in blocks:
            one_by_one.used(block, priority)
        at_once.used_all(blocks, priority)
    assert [one_by_one.rank(b) for b in range(8)] == [at_once.rank(b) for b in range(8)]


def test_priority_keeps_the_highest_priority_of_a_blocks_users() -> None:
    policy = PriorityEviction(4)
    policy.used(0, 5)
    policy.used(0, -3)  # a later, lower user does not lower it
    policy.used(1, 2)
    assert policy.rank(0)[0] == 5 and policy.rank(1)[0] == 2
    policy.removed(0)  # forgotten: a block cached again starts afresh
    policy.used(0, -3)
    assert policy.rank(0)[0] == -3


def test_lfu_counts_uses_since_the_block_was_cached() -> None:
    policy = LFU(2)
    for _ in range(3):
        policy.used(0)
    policy.evictable(0)
    assert policy.rank(0)[0] == 3
    assert policy.victim() == 0
    policy.used(0)
    assert policy.rank(0)[0] == 1


def test_lru_orders_by_last_use_not_by_when_evictable() -> None:
    policy = LRU(3)
    for block in (2, 0, 1):
        policy.used(block)
    for block in (0, 1, 2):
        policy.evictable(block)
    assert [policy.victim() for _ in range(3)] == [2, 0, 1]


def test_the_tails_cap_drops_the_tail_the_policy_ranks_lowest() -> None:
    """Beyond MAX_TAILS_PER_PARENT tails under one parent, the priority policy keeps a high
    priority tail however old it is (kvcache/partial_blocks.py asks the policy)."""
    from kvcache.block_pool import BlockPool

    n = MAX_TAILS_PER_PARENT + 2
    pool, policy = BlockPool(n), PriorityEviction(n)
    partials = PartialBlocks(B, pool, policy)
    blocks = pool.take(n)
    for i, block in enumerate(blocks):
        partials.keep(Tail(block, pack_tokens([1000 + i]), None, ROOT), 9 if i == 0 else 0)
    kept = {t.block_id for t in partials.tails()}
    assert blocks[0] in kept and blocks[1] not in kept and blocks[2] not in kept
    assert len(kept) == MAX_TAILS_PER_PARENT and pool.num_free == 2
    assert set(policy.evictable_blocks()) == kept
    policy.check_integrity()


def test_a_bad_name_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'fifo'.*lfu, lru, priority"):
        BlockManager(8, B, eviction_policy="fifo")


class LFUMachine(BlockManagerMachine):
    eviction = "lfu"


class PriorityMachine(BlockManagerMachine):
    eviction = "priority"


class MRUMachine(BlockManagerMachine):
    eviction = "mru"


EACH = settings(FAST, max_examples=60)
TestLFUMachine = LFUMachine.TestCase
TestLFUMachine.settings = EACH
TestPriorityMachine = PriorityMachine.TestCase
TestPriorityMachine.settings = EACH

TestMRUMachine = pytest.mark.usefixtures("with_mru")(MRUMachine.TestCase)
TestMRUMachine.settings = EACH


@pytest.mark.parametrize(("policy", "kept"), [("lfu", "shared"), ("lru", "chunked")])
def test_a_chunked_prompt_is_not_counted_as_hitting_its_own_blocks(policy: str, kept: str) -> None:
    """SGLang's LFU skips the hits a chunked request would score on the blocks its own earlier
    chunks cached; so does ours. A prompt prefilled in four chunks, once, is used less than
    an older one two requests shared: LFU evicts the chunked one's blocks first (a count
    inflated by its chunks would rank its first block above the shared one's), LRU the
    older one's."""
    bm = BlockManager(10, B, eviction_policy=policy)
    prompts = {"shared": [5] * (4 * B) + [0], "chunked": [6] * (4 * B) + [0]}
    for rid in (0, 1):  # computed, then hit whole by a second request
        tokens = prompts["shared"]
        bm.allocate(rid, tokens, ROOT)
        bm.commit(rid, tokens, len(tokens))
        bm.free(rid)
    tokens = prompts["chunked"]
    bm.allocate(2, tokens, ROOT)
    for end in range(B, len(tokens) + 1, B):
        bm.commit(2, tokens, end)
    bm.free(2)
    fresh = [7] * (5 * B + 1)  # six blocks: two free, four evicted
    bm.allocate(3, fresh, ROOT)
    bm.check_integrity()
    left = {name: bm.cached_prefix_length(p, ROOT) for name, p in prompts.items()}
    assert left == {name: 4 * B if name == kept else 0 for name in prompts}
