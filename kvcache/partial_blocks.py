"""Partial blocks, the one module that says what a tail is and when one is offered, copied, kept
and evicted: the slots of a prompt's next tokens past its cached full blocks.

The radix tree caches full blocks only, so a prompt that goes on past its cached blocks would
compute its partial block from scratch: up to ``block_size - 1`` tokens, at every beam search
step and for every repeated prompt. Their K/V are copied instead (``SlotCopy``) from the block
that holds the longest run of them, one of:

* a *tail*: a finished request's partial last block, whose first ``r`` slots hold computed
  K/V, kept (``keep``) under the tree node it follows when its request published its blocks.
  Copied and never held, a tail has ref 0 always; it is evictable at any time (the eviction
  policy holds every tail, ranked from when it was kept), goes when its parent node does
  (``evict_under``), when a longer tail under the same parent starts with its tokens, and when
  its parent has too many (the one the policy ranks lowest goes);
* a full block below the last matched node that starts with the same tokens;
* an *offer*: a running request's partial block, offered after each of its commits while it
  publishes its blocks. A request writes each slot once, in order, so its computed slots never
  change while it lives; the copy is made at allocation, so the source cannot be freed or
  written in between.

Which slots are copied is decided here (``copyable``, then ``TailMatch.into`` once the
destination block is known); the caller runs the ``SlotCopy`` on the K/V (runner/kv_pool/store.py).
``BlockCache`` calls in at its fixed points (release, eviction); the tails' pool state (cached
content, ref 0, evictable) is kept here, the tree nodes' there.

Invariants (checked by ``check_integrity``):
* a tail holds 1 .. block_size - 1 tokens and hangs under a live node of its namespace, or
  under the namespace's top when its request had no full block;
* under one parent, no tail's tokens start with another's: ``add`` keeps only the longer one;
* an offer is its running request's own block right after its chain, in its namespace.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from typing import NamedTuple

from kvcache.block_pool import BlockPool
from kvcache.eviction import EvictionPolicy
from kvcache.hashing import TOKEN_BYTES, pack_tokens
from kvcache.radix_tree import Node, RadixTree
from kvcache.request_blocks import RequestBlocks

# The most tails kept under one parent (the eviction policy's highest ranked), and the most
# full blocks and running
# requests below it that `copyable` compares too (the newest): a node below which thousands of
# answers ended (a shared system prompt) must not cost thousands of comparisons an admission.
MAX_TAILS_PER_PARENT = 16
MAX_FULL_CANDIDATES = 16
MAX_LIVE_PER_PARENT = 16

Key = tuple[int, int | None]  # (namespace, the block the partial one follows; None at the top)


class SlotCopy(NamedTuple):
    """Copy the K/V of the first ``num_tokens`` slots of ``src_block`` into ``dst_block``.

    Hazard: the caller must copy before any forward pass writes K/V. ``src_block`` is cached
    with ref 0, so the very allocation that asked for the copy may have evicted it and handed
    it out again; its K/V stay intact until something writes them."""

    src_block: int
    dst_block: int
    num_tokens: int


class Tail(NamedTuple):
    block_id: int
    tokens: bytes  # packed int64 tokens whose K/V are in the block's first slots
    parent: Node | None  # the full block it follows; None => the namespace's top
    namespace: int


class TailMatch(NamedTuple):
    block_id: int  # the block to copy from
    num_tokens: int  # leading slots to copy

    def into(self, dst_block: int) -> SlotCopy:
        """The copy of these slots into ``dst_block`` (the request's first fresh block)."""
        return SlotCopy(self.block_id, dst_block, self.num_tokens)


class Offer:
    """One running request's partial block and what its computed slots hold: the token list
    its last commit gave (a list that only grows) and how many of them were computed."""

    __slots__ = ("key", "block_id", "start", "tokens", "computed")

    def __init__(
        self, key: Key, block_id: int, start: int, tokens: Sequence[int], computed: int
    ) -> None:
        self.key = key
        self.block_id = block_id
        self.start = start  # the block's first token position
        self.tokens = tokens
        self.computed = computed  # start < computed < start + block_size


def common_tokens(a: bytes, b: bytes) -> int:
    """How many leading tokens two packed token strings share. Pure.

    A binary search over slice equality: a handful of C-level comparisons instead of a Python
    loop over tokens."""
    n = min(len(a), len(b)) // TOKEN_BYTES
    if a[: n * TOKEN_BYTES] == b[: n * TOKEN_BYTES]:
        return n
    lo, hi = 0, n  # a and b agree on lo tokens and differ within hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * TOKEN_BYTES] == b[: mid * TOKEN_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo


def _key(namespace: int, parent: Node | None) -> Key:
    return namespace, None if parent is None else parent.block_id


class PartialBlocks:
    """The tails and the offers of one block manager, by the (namespace, parent block) they
    follow, and the tails' state in the pool and the eviction policy: cached content, ref 0,
    evictable."""

    def __init__(self, block_size: int, pool: BlockPool, eviction: EvictionPolicy) -> None:
        self.block_size = block_size
        self._pool = pool
        self._eviction = eviction
        self._under: dict[Key, list[Tail]] = {}  # tails, oldest first
        self._by_block: dict[int, Tail] = {}
        self._offers: dict[int, Offer] = {}  # by request id
        self._offered: dict[Key, dict[int, None]] = {}  # insertion-ordered sets of request ids
        self.version = 0  # bumped whenever a tail is added or removed

    # -- questions (pure) ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_block)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._by_block

    def tails(self) -> Iterable[Tail]:
        """Every tail, in no particular order."""
        return self._by_block.values()

    def under(self, namespace: int, parent: Node | None) -> list[Tail]:
        """The tails that follow ``parent`` (a copy)."""
        return list(self._under.get(_key(namespace, parent), ()))

    def _partial_index(self, request: RequestBlocks, computed: int) -> int | None:
        """Where in its table a request's partial block is, when it may be copied from: it
        holds at least one computed token, and every full block before it is on the chain."""
        full, partial = divmod(computed, self.block_size)
        return full if partial and len(request.chain) == full < len(request.table) else None

    def tail_of(
        self, request: RequestBlocks, token_ids: Sequence[int], num_computed_tokens: int
    ) -> Tail | None:
        """A request's partial last block as a tail, when it can be kept: the request publishes
        its blocks, and ``token_ids`` (``num_computed_tokens`` of them in the K/V; none: not
        told) say what the block holds."""
        if not request.publishing:
            return None
        computed = min(num_computed_tokens, len(token_ids))
        full = self._partial_index(request, computed)
        if full is None:
            return None
        parent = request.chain[-1] if request.chain else None
        tokens = pack_tokens(token_ids[full * self.block_size : computed])
        return Tail(request.table[full], tokens, parent, request.root)

    def copyable(
        self,
        token_ids: Sequence[int],
        root: int,
        nodes: list[Node],
        children: dict[int, Node],
    ) -> TailMatch | None:
        """The block holding the longest run of the tokens after the matched ``nodes``: a tail,
        one of the newest ``children`` (the full blocks below the last node) or an offer,
        capped so that one prompt token is still computed and never a whole block."""
        B = self.block_size
        start = len(nodes) * B
        end = min(len(token_ids) - 1, start + B - 1)
        if end <= start:
            return None
        key = _key(root, nodes[-1] if nodes else None)
        wanted = pack_tokens(token_ids[start:end])
        sources = [(t.block_id, t.tokens) for t in self._under.get(key, ())]
        newest = islice(reversed(children.values()), MAX_FULL_CANDIDATES)
        sources += [(node.block_id, node.tokens) for node in newest]
        for rid in list(self._offered.get(key, ()))[-MAX_LIVE_PER_PARENT:]:
            o = self._offers[rid]  # its tokens are packed only now, when an admission asks
            sources.append((o.block_id, pack_tokens(o.tokens[o.start : o.computed])))
        best: TailMatch | None = None
        for block_id, tokens in sources:
            n = common_tokens(tokens, wanted)
            if n and (best is None or n > best.num_tokens):
                best = TailMatch(block_id, n)
        return best

    # -- mutations -----------------------------------------------------------------------------
    def keep(self, tail: Tail, priority: int = 0) -> None:
        """Keep a released request's partial block as a tail (``tail_of``; its request's other
        blocks are released already). Mutates the pool and the eviction policy: the block
        becomes cached content with ref 0, used now by a request of ``priority`` and evictable,
        and the tails it makes redundant (or itself, when one under the same parent already
        starts with its tokens) go back to the free list."""
        pool, eviction, block = self._pool, self._eviction, tail.block_id
        pool.mark_cached(block)
        pool.release(block)
        eviction.used(block, priority)
        for gone in self.add(tail):
            eviction.removed(gone)
            pool.evict(gone)
        if block in self._by_block:
            eviction.evictable(block)

    def evict(self, block_id: int) -> None:
        """Evict the tail in ``block_id``, the eviction policy's victim. Mutates the tails and
        the pool (the block goes back to the free list)."""
        self.remove(block_id)
        self._pool.evict(block_id)

    def evict_under(self, node: Node) -> int:
        """Evict the tails that follow ``node`` (it is being evicted: nothing can reach them
        without it). Mutates the tails, the eviction policy and the free list; returns how many
        went."""
        gone = self.under(node.namespace, node)
        for tail in gone:
            self.remove(tail.block_id)
            self._eviction.removed(tail.block_id)
            self._pool.evict(tail.block_id)
        return len(gone)

    def add(self, tail: Tail) -> list[int]:
        """Keep ``tail`` unless a tail under the same parent already starts with its tokens.
        Mutates: tails that ``tail`` extends are removed, and beyond MAX_TAILS_PER_PARENT the one
        the eviction policy ranks lowest (``tail`` itself, it may be). Returns the blocks no
        longer kept (``tail``'s own when it was not added); the caller returns them to the
        pool."""
        siblings = self._under.setdefault(_key(tail.namespace, tail.parent), [])
        if any(t.tokens.startswith(tail.tokens) for t in siblings):
            return [tail.block_id]
        gone = [t for t in siblings if tail.tokens.startswith(t.tokens)]
        siblings[:] = [t for t in siblings if not tail.tokens.startswith(t.tokens)]
        siblings.append(tail)
        self._by_block[tail.block_id] = tail
        if len(siblings) > MAX_TAILS_PER_PARENT:
            # min keeps the first of equal ranks: the oldest kept
            lowest = min(siblings, key=lambda t: self._eviction.rank(t.block_id))
            siblings.remove(lowest)
            gone.append(lowest)
        for t in gone:
            del self._by_block[t.block_id]
        self.version += 1
        return [t.block_id for t in gone]

    def remove(self, block_id: int) -> Tail:
        """Forget the tail in ``block_id`` (eviction). Mutates."""
        tail = self._by_block.pop(block_id)
        key = _key(tail.namespace, tail.parent)
        siblings = self._under[key]
        siblings.remove(tail)
        if not siblings:
            del self._under[key]
        self.version += 1
        return tail

    def offer(
        self, request_id: int, request: RequestBlocks, token_ids: Sequence[int], computed: int
    ) -> None:
        """Offer a running request's partial block after a commit, or withdraw its offer when
        its computed slots do not follow its chain. Mutates. Runs for every request at every
        step: while the block stays the same, the offer is only updated in place. A request that
        stopped publishing offers nothing new (an offer it made before stays: its slots do not
        change)."""
        if not request.publishing:
            return
        full = self._partial_index(request, computed)
        if full is None:
            self.withdraw(request_id)
            return
        block, old = request.table[full], self._offers.get(request_id)
        if old is not None and old.block_id == block:
            old.tokens, old.computed = token_ids, computed
            return
        self.withdraw(request_id)
        key = (request.root, request.chain[-1].block_id if request.chain else None)
        self._offers[request_id] = Offer(key, block, full * self.block_size, token_ids, computed)
        self._offered.setdefault(key, {})[request_id] = None

    def withdraw(self, request_id: int) -> None:
        """Forget a request's offer (finished, preempted, or nothing to offer). Mutates."""
        old = self._offers.pop(request_id, None)
        if old is None:
            return
        ids = self._offered[old.key]
        del ids[request_id]
        if not ids:
            del self._offered[old.key]

    # -- checks --------------------------------------------------------------------------------
    def check_integrity(self, tree: RadixTree, requests: Mapping[int, RequestBlocks]) -> None:
        """Assert the invariants in the module docstring against ``tree``, whose nodes the
        tails follow, and the running ``requests``, and that every tail is evictable cached
        content with ref 0. AssertionError names the broken one."""
        evictable = self._eviction.evictable_blocks()
        for block in self._by_block:
            assert self._pool.ref(block) == 0, f"tail {block} is held"
            assert self._pool.is_cached_node(block), f"tail {block} is not cached content"
            assert block in evictable, f"tail {block} is not evictable"
        width = self.block_size * TOKEN_BYTES
        listed = 0
        for (namespace, parent_block), siblings in self._under.items():
            assert siblings, f"parent {parent_block}: an empty tail list is kept"
            for tail in siblings:
                listed += 1
                name = f"tail {tail.block_id}"
                assert self._by_block.get(tail.block_id) is tail, f"{name}: unlisted"
                assert 0 < len(tail.tokens) < width, f"{name}: not a partial block"
                assert tail.namespace == namespace, f"{name}: namespace differs"
                if tail.parent is None:
                    assert parent_block is None, f"{name}: listed under a node"
                else:
                    assert parent_block is not None, f"{name}: listed at the top"
                    assert tree.node_of(parent_block) is tail.parent, f"{name}: parent evicted"
                    assert tail.parent.namespace == namespace, f"{name}: parent's namespace"
                assert tree.node_of(tail.block_id) is None, f"{name} is also a tree node"
                for other in siblings:
                    assert other is tail or not other.tokens.startswith(tail.tokens), (
                        f"{name} is a prefix of tail {other.block_id}"
                    )
            assert len(siblings) <= MAX_TAILS_PER_PARENT, f"parent {parent_block}: too many tails"
        assert listed == len(self._by_block), "a tail is listed twice or not at all"
        for rid, offer in self._offers.items():
            assert rid in requests, f"request {rid} is gone but still offers block {offer}"
            live = requests[rid]
            full = len(live.chain)
            assert live.table[full] == offer.block_id, f"request {rid} offers another block"
            parent = live.chain[-1].block_id if full else None
            assert offer.key == (live.root, parent), f"request {rid} offers under another block"
            assert offer.start == full * self.block_size, f"request {rid}: offer's start"
            assert tree.node_of(offer.block_id) is None, f"request {rid} offers a tree block"
            assert rid in self._offered.get(offer.key, {}), f"request {rid}: offer unlisted"
