"""What the pool holds beyond running requests: full blocks in the radix tree, tails beside them,
the eviction that reclaims both, and the running requests' partial blocks on offer as copy
sources.

The block manager decides who holds what (through its caching policy, kvcache/cache_policy.py);
this class and the partial blocks it owns (kvcache/partial_blocks.py: what a tail is, when one
is kept, copied and evicted, and the tails' pool state) are the only code that changes the pool,
the tree, the partial blocks and the eviction policy, and keep them in step: a block is cached
content (ref 0, reclaimable) exactly when it is a tree node or a tail, and the policy's
evictable set holds the ref-0 tree leaves and every tail. An offered block stays its request's
own (ref 1) and is never cached content.

What may be evicted is decided here, the order by the eviction policy (kvcache/eviction/): it
hears of every use of a cached block (a node matched and held, inserted, released root to leaf;
a copy source used; a tail kept, after its request's chain), with the using request's priority,
and of every block entering and leaving the evictable set; eviction takes its victim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

from kvcache.block_pool import BlockPool
from kvcache.eviction import EvictionPolicy
from kvcache.hashing import pack_tokens, unpack_tokens
from kvcache.partial_blocks import PartialBlocks, TailMatch
from kvcache.radix_tree import InsertResult, Node, RadixTree
from kvcache.request_blocks import RequestBlocks


class CachedBlock(NamedTuple):
    """One cached block, as ``listing`` lists them: a tree node (a whole block of tokens) or a
    tail (fewer)."""

    root: int  # namespace root of its chain
    parent: int | None  # the parent block's id; None at the top of the namespace
    token_ids: list[int]
    block_id: int


class BlockListener(Protocol):
    """Told of every change to the tree's content, in the order it happens (the KV events a
    router or control plane rebuilds the cache from: runner/kv_events). Called on the thread
    that changes the cache, with the manager's state already updated; must not call back into
    the manager, and should return quickly (hand the work to another thread)."""

    def blocks_stored(self, nodes: list[Node]) -> None:
        """``nodes`` entered the tree, parents before children (their K/V is written)."""

    def blocks_removed(self, nodes: list[Node]) -> None:
        """``nodes`` left the tree (evicted: leaves first, so a child before its parent)."""


class BlockCache:
    """The pool, the tree of full blocks and the partial blocks of one block manager."""

    def __init__(self, num_blocks: int, block_size: int, eviction: EvictionPolicy) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.eviction = eviction  # the order cached blocks are evicted in
        self.tree = RadixTree(block_size)
        # tails and running requests' offers
        self.partials = PartialBlocks(block_size, self.pool, eviction)
        self.evicted_blocks = 0  # cached blocks reclaimed by eviction so far
        # Told of the nodes each insert adds (after the forward that wrote their K/V), and of
        # the tree nodes one ``take`` evicts, together, while their blocks still hold their K/V
        # (the tiers below the pool keep a copy: kvcache/tiers/loader.py; one batched copy
        # off the pool costs about what a copy of one block does).
        self.on_commit: Callable[[list[Node]], None] | None = None
        self.on_evict: Callable[[list[Node]], None] | None = None
        # Every listener hears of every node stored and removed (runner/kv_events).
        self.listeners: list[BlockListener] = []

    # -- questions (pure) ----------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Changes whenever a block enters or leaves the cache."""
        return self.tree.version + self.partials.version

    def num_available(self) -> int:
        """Free blocks plus cached ones no request holds (all reclaimable)."""
        return self.pool.num_free + self.pool.num_cached

    def num_unheld(self, nodes: Iterable[Node]) -> int:
        """How many of ``nodes`` no request holds (locking them takes them out of the
        reclaimable set)."""
        return sum(1 for node in nodes if self.pool.ref(node.block_id) == 0)

    def match(self, token_ids: Sequence[int], root: int) -> list[Node]:
        """Cached path for the prompt, capped at (len - 1) // B blocks so that at least one
        token is computed (its logits pick the first output token)."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        if max_blocks <= 0:
            return []
        data = pack_tokens(token_ids[: max_blocks * self.block_size])
        return self.tree.match(root, data, max_blocks)

    def match_whole(self, token_ids: Sequence[int], root: int) -> list[Node]:
        """Cached path for every full block of the tokens, uncapped: blocks read elsewhere (a
        segment placed in another prompt), never the start of a computation."""
        num_blocks = len(token_ids) // self.block_size
        if num_blocks <= 0:
            return []
        data = pack_tokens(token_ids[: num_blocks * self.block_size])
        return self.tree.match(root, data, num_blocks)

    def continuation(self, request: RequestBlocks, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens with which a cached path goes on past ``token_ids``, looked up
        below the end of the request's chain (RadixTree.continuation), along the path the
        eviction policy ranks highest (with LRU: the most recently used)."""
        chain = request.chain
        after = chain[-1] if chain else None
        rest = token_ids[len(chain) * self.block_size :]
        return self.tree.continuation(request.root, after, rest, k, self.eviction.rank)

    def copyable(self, token_ids: Sequence[int], root: int, nodes: list[Node]) -> TailMatch | None:
        """The block holding the longest run of the tokens after the matched ``nodes``
        (PartialBlocks.copyable, with the full blocks below the last node)."""
        children = self.tree.children(root, nodes[-1] if nodes else None)
        return self.partials.copyable(token_ids, root, nodes, children)

    def listing(self) -> list[CachedBlock]:
        """Every block in the tree (cached or held), each after its parent, then every tail
        (its tokens fewer than a block)."""
        full = [
            CachedBlock(
                node.namespace,
                None if node.parent is None else node.parent.block_id,
                node.token_ids,
                node.block_id,
            )
            for node in self.tree.walk()
        ]
        tails = [
            CachedBlock(
                t.namespace,
                None if t.parent is None else t.parent.block_id,
                unpack_tokens(t.tokens),
                t.block_id,
            )
            for t in self.partials.tails()
        ]
        return full + tails

    # -- uses ----------------------------------------------------------------------------------
    def touch(self, block: int, priority: int = 0) -> None:
        """A copy source was just used by a request of ``priority``: the eviction policy hears
        of it, an evictable one leaving the set and coming back at its new rank. (The
        allocation that copies it may have evicted it already, or it is a running request's
        own block: then nothing is done.)"""
        if not self.pool.is_cached_node(block):
            return
        eviction = self.eviction
        evictable = block in eviction.evictable_blocks()
        if evictable:
            eviction.held(block)
        eviction.used(block, priority)
        if evictable:
            eviction.evictable(block)

    # -- mutations -----------------------------------------------------------------------------
    def hold(self, node: Node, priority: int = 0) -> None:
        """ref += 1 on a tree node, taking it out of the evictable set; a use by a request of
        ``priority``."""
        block = node.block_id
        self.eviction.held(block)
        self.pool.acquire(block)
        self.eviction.used(block, priority)

    def take(self, n: int) -> list[int]:
        """``n`` fresh blocks with ref 1, evicting the policy's victims while the free list is
        short; the evicted tree nodes go to ``on_evict`` in one call before the blocks are
        handed out (their K/V is intact until a forward writes the new owners' K/V). The caller
        has checked availability."""
        evicted: list[Node] = []
        while self.pool.num_free < n:
            node = self._evict_one()
            if node is not None:
                evicted.append(node)
        if evicted:
            if self.on_evict is not None:
                self.on_evict(evicted)
            for listener in self.listeners:
                listener.blocks_removed(evicted)
        return self.pool.take(n)

    def insert(
        self,
        root: int,
        parent: Node | None,
        data: bytes,
        blocks: list[int],
        *,
        only_new: bool,
        priority: int = 0,
    ) -> InsertResult:
        """Insert a request's full blocks (packed ``data``) below ``parent`` (RadixTree.insert).
        Mutates: the blocks already cached are held (ref += 1: the caller pins them), the new
        nodes' blocks become cached content, used by a request of ``priority``, and reported
        to ``on_commit``. With ``only_new`` and a block cached already, nothing changes."""
        result = self.tree.insert(root, parent, data, blocks, only_new=only_new)
        if only_new and result.existing:
            return result
        for node in result.existing:
            self.hold(node, priority)
        created = [node.block_id for node in result.created]
        mark_cached = self.pool.mark_cached
        for block in created:
            mark_cached(block)
        self.eviction.used_all(created, priority)
        if result.created:
            if self.on_commit is not None:
                self.on_commit(result.created)
            for listener in self.listeners:
                listener.blocks_stored(result.created)
        return result

    def offer(
        self, request_id: int, request: RequestBlocks, token_ids: Sequence[int], computed: int
    ) -> None:
        """Offer a running request's partial block as a copy source (PartialBlocks.offer)."""
        self.partials.offer(request_id, request, token_ids, computed)

    def release(
        self, request_id: int, request: RequestBlocks, token_ids: Sequence[int], computed: int
    ) -> None:
        """A request is done: its offer is withdrawn, its chain used root to leaf (a deeper
        block counts as more recent) at the request's priority, and ref -= 1 on each block it
        holds: tree blocks reaching ref 0 stay cached (childless ones become evictable), private
        blocks go back to the free list, except its partial block when ``token_ids`` (with
        ``computed`` of them in the K/V) say what it holds: that one is kept as a tail."""
        pool, eviction, priority = self.pool, self.eviction, request.priority
        tail = self.partials.tail_of(request, token_ids, computed)
        self.partials.withdraw(request_id)
        eviction.used_all([node.block_id for node in request.chain], priority)
        for block in (*request.table, *request.pins):
            if tail is not None and block == tail.block_id:
                continue  # released as it is kept, below
            if not (pool.release(block) and pool.is_cached_node(block)):
                continue
            cached = self.tree.node_of(block)
            assert cached is not None, f"block {block}: no node"
            if not cached.children:
                eviction.evictable(block)
        if tail is not None:
            self.partials.keep(tail, priority)

    def drop_unheld(self) -> int:
        """Evict every cached block no request holds (a prefix-cache reset): leaves and tails,
        then the parents they leave childless, until only held blocks stay. The listeners hear
        of the tree nodes removed; ``on_evict`` does not (nothing is under pressure: the tiers
        below are not written). Returns the blocks freed."""
        evicted: list[Node] = []
        freed = self.pool.num_cached
        while self.pool.num_cached:
            node = self._evict_one()
            if node is not None:
                evicted.append(node)
        if evicted:
            for listener in self.listeners:
                listener.blocks_removed(evicted)
        return freed

    def _evict_one(self) -> Node | None:
        """Evict the policy's victim, a ref-0 leaf or a tail: a parent left childless (and
        unheld) becomes an evictable leaf itself, so it may go next, never before. A node's
        tails go with it (nothing can reach them without it). Returns the tree node evicted
        (None for a tail); its block is free, its K/V not yet overwritten."""
        pool, tree, partials = self.pool, self.tree, self.partials
        block = self.eviction.victim()
        if block in partials:
            partials.evict(block)
            self.evicted_blocks += 1
            return None
        node = tree.node_of(block)
        assert node is not None, f"victim block {block} has no tree node"
        tree.remove_leaf(node)
        parent = node.parent
        if parent is not None and not parent.children and pool.ref(parent.block_id) == 0:
            self.eviction.evictable(parent.block_id)
        pool.evict(block)
        self.evicted_blocks += 1 + partials.evict_under(node)
        return node
