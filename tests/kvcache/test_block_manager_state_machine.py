"""Random admit / prefill / decode / commit / preempt / free sequences against a reference model.

The model keeps each live request's tokens and computed count, the set of (root, prefix)
pairs ever committed at a block boundary, and what every KV slot holds: the (root, prefix)
whose last token's K/V a request wrote there, or copied there as ``Allocation.copy`` says. After
every step ``check_integrity()`` runs and:
* every slot a live request has computed (or was served from the cache) holds the K/V of
  exactly its own prefix, under its own root: what attention reads is right;
* a cache hit's full blocks are a prefix some request committed earlier, under the same root;
  the slots copied past them a prefix some request computed;
* while nothing has been evicted (and hashes are real) the hit's full blocks are exactly the
  longest committed prefix, capped so one token is computed;
* block tables hold ceil(tokens / B) blocks; a block in two live tables is a tree block at the
  same index of both, and both requests agree on every token up to the end of that block;
* the pool's three states always add up to ``num_blocks``;
* a listener that applies every stored and removed event to a mirror holds exactly the tree's
  blocks (what KV events let a router rebuild), each stored after its parent, removed after
  its children.
Small pools, two namespaces and a tiny alphabet with shared stems make hits, duplicates,
evictions and refusals common. A second machine forces every hash to collide; a third runs with
prefix caching off. Requests come with priorities (-1 .. 2): the priority eviction policy ranks
by them, the others ignore them; tests/kvcache/test_eviction_policies.py runs this machine under
every eviction policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvcache.hashing
from kvcache import BlockManager, Purpose, namespace_root
from kvcache.radix_tree import Node

B = 4
ROOTS = [namespace_root("m"), namespace_root("m", "salt")]
STEMS = [[], [1, 2, 3, 1], [1, 2, 3, 1, 2, 2, 0, 1], [1, 2, 3, 1, 0, 0, 0, 0, 2]]
token = st.integers(0, 3)


class Mirror:
    """What a KV-event subscriber would know: block -> (parent block, tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def blocks_stored(self, nodes: list[Node]) -> None:
        for node in nodes:
            parent = None if node.parent is None else node.parent.block_id
            assert parent is None or parent in self.blocks, "stored before its parent"
            assert node.block_id not in self.blocks, "stored twice"
            self.blocks[node.block_id] = (parent, tuple(node.token_ids))

    def blocks_removed(self, nodes: list[Node]) -> None:
        for node in nodes:
            assert all(p != node.block_id for p, _ in self.blocks.values()), "removed a parent"
            del self.blocks[node.block_id]


@dataclass
class Live:
    tokens: list[int]
    root: int
    computed: int  # tokens whose KV is in the cache (committed or matched)
    reuse: bool = True  # False: matches nothing, publishes only while its blocks are new
    priority: int = 0


class BlockManagerMachine(RuleBasedStateMachine):
    caching = True
    exact_hits = True  # with real hashes and no evictions, hits equal the longest committed prefix
    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(
            num_blocks=10,
            block_size=B,
            enable_prefix_caching=self.caching,
            eviction_policy=self.eviction,
        )
        self.mirror = Mirror()
        self.bm.add_listener(self.mirror)
        self.live: dict[int, Live] = {}
        self.committed: set[tuple[int, tuple[int, ...]]] = set()
        self.next_id = 0
        # block -> per slot, the (root, prefix) whose last token's K/V the slot holds
        self.kv: dict[int, list[tuple[int, tuple[int, ...]] | None]] = {}
        self.first_admissions = 0
        # A request that reuses nothing may leave some of its committed blocks out of the
        # tree (they were cached already, or below one that was): hits can then be shorter
        # than the longest committed prefix, never longer.
        self.all_committed_cached = True
        # Readers (borrow): id -> (tokens, root, blocks held), ids below every request's.
        self.readers: dict[int, tuple[list[int], int, list[int]]] = {}
        self.next_reader = -2

    def _longest_committed(self, tokens: list[int], root: int) -> int:
        """Longest committed prefix of ``tokens`` (in tokens), capped as allocate caps it."""
        longest = 0
        for k in range(1, (len(tokens) - 1) // B + 1):
            if (root, tuple(tokens[: k * B])) in self.committed:
                longest = k * B
        return longest

    def _admit(
        self,
        rid: int,
        tokens: list[int],
        root: int,
        readmission: bool,
        reuse: bool = True,
        priority: int = 0,
    ) -> bool:
        bm = self.bm
        peek = bm.cached_prefix_length(tokens, root) if reuse else 0
        evicted_before = bm.stats.evicted_blocks
        hits_before = bm.stats.hit_tokens + bm.stats.readmit_hit_tokens
        purpose = Purpose.READMISSION if readmission else Purpose.ADMISSION
        if not bm.can_allocate(tokens, root, reads_cache=reuse):
            with pytest.raises(ValueError):
                bm.allocate(rid, tokens, root, purpose, reads_cache=reuse, priority=priority)
            return False
        alloc = bm.allocate(rid, tokens, root, purpose, reads_cache=reuse, priority=priority)
        cached = alloc.num_cached_tokens
        if not reuse:
            assert cached == 0
            assert bm.stats.hit_tokens + bm.stats.readmit_hit_tokens == hits_before
        assert cached == peek
        assert 0 <= cached < len(tokens)
        assert len(alloc.block_table) == -(-len(tokens) // B)
        if not self.caching:
            assert cached == 0
        full = cached - cached % B
        if full:
            assert (root, tuple(tokens[:full])) in self.committed, "hit on an uncommitted prefix"
        if cached % B:
            copy = alloc.copy
            assert copy is not None and copy.num_tokens == cached % B
            assert copy.dst_block == alloc.block_table[full // B]
            source = self.kv.setdefault(copy.src_block, [None] * B)
            self.kv.setdefault(copy.dst_block, [None] * B)[: copy.num_tokens] = source[
                : copy.num_tokens
            ]
        else:
            assert alloc.copy is None
        exact = self.exact_hits and self.all_committed_cached and evicted_before == 0
        if self.caching and reuse and exact:
            assert full == self._longest_committed(tokens, root)
        self.live[rid] = Live(list(tokens), root, cached, reuse, priority)
        return True

    def _compute(self, rid: int, req: Live, upto: int) -> None:
        """Write the K/V of positions computed .. upto - 1 into the request's slots."""
        table = self.bm.block_table(rid)
        for i in range(req.computed, upto):
            self.kv.setdefault(table[i // B], [None] * B)[i % B] = (
                req.root,
                tuple(req.tokens[: i + 1]),
            )
        req.computed = max(req.computed, upto)

    @rule(
        root=st.sampled_from(ROOTS),
        stem=st.sampled_from(STEMS),
        tail=st.lists(token, max_size=9),
        reuse=st.sampled_from([True, True, True, False]),
        priority=st.integers(-1, 2),
    )
    def admit(
        self, root: int, stem: list[int], tail: list[int], reuse: bool, priority: int
    ) -> None:
        tokens = (stem + tail) or [0]
        before = self.bm.stats.readmit_query_tokens
        if self._admit(self.next_id, tokens, root, False, reuse, priority):
            self.first_admissions += len(tokens)
        assert self.bm.stats.readmit_query_tokens == before
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def prefill_chunk(self, data: st.DataObject, chunk: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        self._compute(rid, req, min(len(req.tokens), req.computed + chunk))
        self._commit(rid, req)

    @precondition(lambda self: any(r.computed >= len(r.tokens) - 1 for r in self.live.values()))
    @rule(data=st.data(), new=token)
    def decode(self, data: st.DataObject, new: int) -> None:
        """One step computes the last token and samples a new one (its KV comes next step)."""
        done = sorted(rid for rid, r in self.live.items() if r.computed >= len(r.tokens) - 1)
        rid = data.draw(st.sampled_from(done))
        req = self.live[rid]
        before = list(self.bm.block_table(rid)), self.bm.num_available_blocks()
        if not self.bm.grow(rid, len(req.tokens) + 1):
            # and changes nothing:
            assert (list(self.bm.block_table(rid)), self.bm.num_available_blocks()) == before
            return
        req.tokens.append(new)
        assert len(self.bm.block_table(rid)) == -(-len(req.tokens) // B)
        self._compute(rid, req, len(req.tokens) - 1)
        self._commit(rid, req)

    def _commit(self, rid: int, req: Live) -> None:
        self.bm.commit(rid, req.tokens, req.computed)
        if not req.reuse and req.computed >= B:
            self.all_committed_cached = False
        if self.caching:
            for k in range(1, req.computed // B + 1):
                self.committed.add((req.root, tuple(req.tokens[: k * B])))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), keep_tail=st.booleans())
    def free(self, data: st.DataObject, keep_tail: bool) -> None:
        """Finish a request; with ``keep_tail`` its partial last block may stay as a tail."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        if keep_tail:
            self.bm.free(rid, req.tokens, req.computed)
        else:
            self.bm.free(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt_and_readmit(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        self.bm.free(rid, req.tokens, req.computed)
        before = self.bm.stats
        if self._admit(rid, req.tokens, req.root, True, req.reuse, req.priority):
            after = self.bm.stats
            assert (after.query_tokens, after.hit_tokens) == (
                before.query_tokens,
                before.hit_tokens,
            )
            assert after.readmit_query_tokens == before.readmit_query_tokens + len(req.tokens)

    @rule(root=st.sampled_from(ROOTS), stem=st.sampled_from(STEMS), extra=st.integers(0, 5))
    def borrow(self, root: int, stem: list[int], extra: int) -> None:
        """Hold a cached path's full blocks for reading elsewhere (a segment placed in another
        prompt): every block held, uncapped by the one-token rule, and never more than what
        was committed."""
        tokens = (stem + [1] * extra) or [0]
        blocks = self.bm.borrow(self.next_reader, tokens, root)
        if not self.caching:
            assert blocks == []
        for k in range(1, len(blocks) + 1):
            assert (root, tuple(tokens[: k * B])) in self.committed, "lent an uncommitted block"
        exact = self.exact_hits and self.all_committed_cached and self.bm.stats.evicted_blocks == 0
        if self.caching and exact:
            longest = max(
                (k for k in range(len(tokens) // B + 1)
                 if (root, tuple(tokens[: k * B])) in self.committed or k == 0),
                default=0,
            )  # fmt: skip
            assert len(blocks) == longest
        self.readers[self.next_reader] = (tokens, root, blocks)
        self.next_reader -= 1

    @precondition(lambda self: self.readers)
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        reader = data.draw(st.sampled_from(sorted(self.readers)))
        del self.readers[reader]
        self.bm.free(reader)

    @invariant()
    def lent_blocks_keep_their_kv(self) -> None:
        """A held path is never evicted or written: its slots keep the K/V of its tokens."""
        for tokens, root, blocks in self.readers.values():
            for i in range(len(blocks) * B):
                held = self.kv.get(blocks[i // B], [None] * B)[i % B]
                assert held == (root, tuple(tokens[: i + 1])), f"lent slot {i}: wrong K/V"

    @invariant()
    def integrity(self) -> None:
        bm = self.bm
        bm.check_integrity()
        stats = bm.stats
        assert stats.blocks_in_use + stats.blocks_cached + stats.blocks_free == bm.num_blocks
        assert stats.query_tokens == self.first_admissions
        assert stats.hit_tokens <= stats.query_tokens
        tree = {
            c.block_id: (c.parent, tuple(c.token_ids))
            for c in bm.cached_blocks()
            if len(c.token_ids) == B
        }
        assert self.mirror.blocks == tree, "the listener's view differs from the tree"
        owner: dict[int, tuple[int, int]] = {}  # block -> (request, index)
        for rid, req in self.live.items():
            table = bm.block_table(rid)
            assert len(table) == -(-len(req.tokens) // B)
            for i in range(req.computed):
                held = self.kv.get(table[i // B], [None] * B)[i % B]
                assert held == (req.root, tuple(req.tokens[: i + 1])), f"slot {i}: wrong K/V"
            for i, block in enumerate(table):
                if block in owner:
                    other, j = owner[block]
                    theirs = self.live[other]
                    assert i == j, "a shared block sits at different positions"
                    assert theirs.root == req.root, "a block shared across namespaces"
                    end = (i + 1) * B
                    assert theirs.tokens[:end] == req.tokens[:end], "shared block, other prefix"
                owner[block] = (rid, i)


class CollidingHashMachine(BlockManagerMachine):
    """Every block hash is the same constant: only token/parent compares keep reuse correct."""

    exact_hits = False  # collisions legitimately block inserts

    def __init__(self) -> None:
        self._patch = mock.patch.object(kvcache.hashing, "xxh3_64_intdigest", lambda d, seed=0: 5)
        self._patch.start()
        super().__init__()

    def teardown(self) -> None:
        self._patch.stop()


class NoCachingMachine(BlockManagerMachine):
    caching = False


FAST = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[*HealthCheck]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = FAST
TestCollidingHashMachine = CollidingHashMachine.TestCase
TestCollidingHashMachine.settings = settings(FAST, max_examples=80)
TestNoCachingMachine = NoCachingMachine.TestCase
TestNoCachingMachine.settings = settings(FAST, max_examples=30)
