"""What the pool holds beyond running requests: full blocks in the radix tree, tails beside them
(kvcache/tail_cache.py), and the eviction that reclaims both; plus the running requests'
partial blocks on offer as copy sources (kvcache/live_tails.py).

The block manager decides who holds what; this class keeps the pool, the tree and the tails in
step: a block is cached content (ref 0, reclaimable) exactly when it is a tree node or a tail,
and the LRU holds the ref-0 tree leaves and every tail. An offered block stays its request's
own (ref 1) and is never cached content.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from kvcache.block_pool import BlockPool
from kvcache.hashing import pack_tokens, unpack_tokens
from kvcache.live_tails import LiveTails
from kvcache.radix_tree import Node, RadixTree
from kvcache.tail_cache import Tail, TailCache, TailMatch


class CachedBlock(NamedTuple):
    """One cached block, as ``listing`` lists them: a tree node (a whole block of tokens) or a
    tail (fewer)."""

    root: int  # namespace root of its chain
    parent: int | None  # the parent block's id; None at the top of the namespace
    token_ids: list[int]
    block_id: int


class BlockCache:
    """The pool, the tree of full blocks and the tails of one block manager."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tree = RadixTree(block_size)
        self.tails = TailCache(block_size)
        self.live = LiveTails()  # running requests' partial blocks
        self.evicted_blocks = 0  # cached blocks reclaimed by eviction so far
        # Told of each tree node about to be evicted, while its block still holds its K/V
        # (the tiers below the pool keep a copy: runner/kv_tiers.py).
        self.on_evict: Callable[[Node], None] | None = None

    @property
    def version(self) -> int:
        """Changes whenever a block enters or leaves the cache. Pure."""
        return self.tree.version + self.tails.version

    def num_available(self) -> int:
        """Free blocks plus cached ones no request holds (all reclaimable). Pure."""
        return self.pool.num_free + self.pool.num_cached

    def match(self, token_ids: Sequence[int], root: int) -> list[Node]:
        """Cached path for the prompt, capped at (len - 1) // B blocks so that at least one
        token is computed (its logits pick the first output token). Pure."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        if max_blocks <= 0:
            return []
        data = pack_tokens(token_ids[: max_blocks * self.block_size])
        return self.tree.match(root, data, max_blocks)

    def continuation(
        self, root: int, chain: list[Node], token_ids: Sequence[int], k: int
    ) -> list[int]:
        """Up to ``k`` tokens with which a cached path goes on past ``token_ids``, looked up
        below the end of their ``chain`` (RadixTree.continuation). Pure."""
        after = chain[-1] if chain else None
        return self.tree.continuation(root, after, token_ids[len(chain) * self.block_size :], k)

    def copyable(self, token_ids: Sequence[int], root: int, nodes: list[Node]) -> TailMatch | None:
        """The block holding the longest run of the tokens after the matched ``nodes`` (a tail,
        a full block below the last node, or a running request's partial block), capped so
        that one prompt token is still computed and never a whole block. Pure."""
        start = len(nodes) * self.block_size
        end = min(len(token_ids) - 1, start + self.block_size - 1)
        if end <= start:
            return None
        parent = nodes[-1] if nodes else None
        children = self.tree.children(root, parent)
        running = self.live.sources((root, None if parent is None else parent.block_id))
        wanted = pack_tokens(token_ids[start:end])
        return self.tails.longest(root, parent, wanted, children, running)

    def listing(self) -> list[CachedBlock]:
        """Every block in the tree (cached or held), each after its parent, then every tail
        (its tokens fewer than a block). Pure."""
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
            for t in self.tails.tails()
        ]
        return full + tails

    def tail_of(
        self,
        root: int,
        chain: list[Node],
        table: list[int],
        token_ids: Sequence[int],
        num_computed_tokens: int,
    ) -> Tail | None:
        """A request's partial last block as a tail, when it can be kept (see
        ``_partial_index``). Pure."""
        computed = min(num_computed_tokens, len(token_ids))
        full = self._partial_index(chain, table, computed)
        if full is None:
            return None
        parent = chain[-1] if chain else None
        tokens = pack_tokens(token_ids[full * self.block_size : computed])
        return Tail(table[full], tokens, parent, root)

    def _partial_index(self, chain: list[Node], table: list[int], computed: int) -> int | None:
        """Where in ``table`` a request's partial block is, when it may be copied from: it
        holds at least one computed token, and every full block before it is on the request's
        ``chain``. None otherwise. Pure."""
        full, partial = divmod(computed, self.block_size)
        return full if partial and len(chain) == full < len(table) else None

    # -- mutations -----------------------------------------------------------------------------
    def offer_partial(
        self,
        request_id: int,
        root: int,
        chain: list[Node],
        table: list[int],
        token_ids: Sequence[int],
        computed: int,
    ) -> None:
        """Offer a running request's partial block as a copy source (kvcache/live_tails.py),
        or withdraw its offer when its computed slots do not follow its chain. Runs for every
        request at every step: a few comparisons while the block stays the same."""
        live = self.live
        full = self._partial_index(chain, table, computed)
        if full is None:
            live.withdraw(request_id)
        elif not live.refresh(request_id, table[full], token_ids, computed):
            key = (root, chain[-1].block_id if chain else None)
            live.offer(request_id, key, table[full], full * self.block_size, token_ids, computed)

    def hold(self, node: Node) -> None:
        """ref += 1 on a tree node, taking it out of the LRU; touches its tick."""
        self.pool.lru_discard(node.block_id)
        self.pool.acquire(node.block_id)
        node.tick = self.pool.next_tick()

    def touch(self, block: int) -> None:
        """Mark a copy source as just used: an evictable one moves to the LRU's young end.
        (The allocation that copies it may have evicted it already: then nothing is done.)"""
        pool, node = self.pool, self.tree.node_of(block)
        if node is not None:
            node.tick = pool.next_tick()
        if pool.lru_discard(block):
            pool.lru_add(block, pool.next_tick() if node is None else node.tick)

    def take(self, n: int) -> list[int]:
        """``n`` fresh blocks with ref 1, evicting LRU leaves and tails while the free list is
        short. The caller has checked availability."""
        while self.pool.num_free < n:
            self._evict_one()
        return self.pool.take(n)

    def release(self, blocks: Iterable[int], tail: Tail | None) -> None:
        """ref -= 1 on each of ``blocks``: tree blocks reaching ref 0 stay cached (childless
        ones become evictable, at their node's tick), private blocks go back to the free list,
        except ``tail``'s block (one of ``blocks``), which is kept as a tail."""
        pool = self.pool
        if tail is not None:
            pool.mark_cached(tail.block_id)  # before its release, which then caches it
        for block in blocks:
            if not (pool.release(block) and pool.is_cached_node(block)):
                continue
            cached = self.tree.node_of(block)
            if cached is None:
                assert tail is not None and block == tail.block_id, f"block {block}: no node"
            elif not cached.children:
                pool.lru_add(block, cached.tick)
        if tail is None:
            return
        for block in self.tails.add(tail):  # tails it makes redundant, or itself
            pool.lru_discard(block)
            pool.evict(block)
        if tail.block_id in self.tails:
            pool.lru_add(tail.block_id, pool.next_tick())

    def _evict_one(self) -> None:
        """Evict the least recently used ref-0 leaf or tail: a parent left childless (and
        unheld) becomes an evictable leaf itself, so it may go next, never before. A node's
        tails go with it (nothing can reach them without it)."""
        pool, tree = self.pool, self.tree
        block = pool.lru_pop()
        evicted = [block]
        if block in self.tails:
            self.tails.remove(block)
        else:
            node = tree.node_of(block)
            assert node is not None, f"LRU block {block} has no tree node"
            for tail in self.tails.under(node.namespace, node):
                self.tails.remove(tail.block_id)
                pool.lru_discard(tail.block_id)
                evicted.append(tail.block_id)
            if self.on_evict is not None:
                self.on_evict(node)
            tree.remove_leaf(node)
            parent = node.parent
            if parent is not None and not parent.children and pool.ref(parent.block_id) == 0:
                pool.lru_add(parent.block_id, parent.tick)
        for gone in evicted:
            pool.evict(gone)
        self.evicted_blocks += len(evicted)
