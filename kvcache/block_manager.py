"""What the scheduler calls: ask (``can_allocate``), then commit (``allocate``); grow, commit, free.

A request's life: ``allocate`` matches the longest cached prefix (capped so at least one prompt
token is computed), locks that path (ref += 1) and takes fresh blocks for the rest;
``append_slots`` grows the table during decode; ``commit`` inserts every newly computed full
block into the radix tree; ``free`` drops the request's refs, leaving tree blocks cached, and
keeps the request's partial last block as a *tail* (kvcache/tail_cache.py): a later prompt that
goes on past the cached full blocks has its next tokens' K/V copied from a tail, from a full
block that starts with them, or from a running request's partial block (kvcache/live_tails.py;
``Allocation.copy``) instead of computing them again.

Invariants kept here (checked by ``check_integrity``):
* block tables are append-only while a request lives;
* a request's *chain* is the tree node standing for each committed full block, in order. Every
  chain node is held by the request: via its block table, or, when another request had cached the
  same block first (the request's own copy then stays private), via a *pin*. So whoever holds a
  node holds its parent, hence ref(parent) >= ref(child), and every ref-0 tree node can be
  reclaimed by evicting leaves: ``num_available_blocks`` is exact and ``allocate`` never fails
  after ``can_allocate`` said yes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from kvcache.block_cache import BlockCache, CachedBlock
from kvcache.block_integrity import check_block_manager
from kvcache.hashing import pack_tokens
from kvcache.radix_tree import Node
from kvcache.stats import CacheStats
from kvcache.tail_cache import Tail


class SlotCopy(NamedTuple):
    """Copy the K/V of the first ``num_tokens`` slots of ``src_block`` into ``dst_block``.

    Hazard: the caller must copy before any forward pass writes K/V. ``src_block`` is cached
    with ref 0, so the very allocation that asked for the copy may have evicted it and handed
    it out again; its K/V stay intact until something writes them."""

    src_block: int
    dst_block: int
    num_tokens: int


class Allocation(NamedTuple):
    block_table: list[int]
    num_cached_tokens: int  # < len(token_ids): full blocks matched plus copied slots
    copy: SlotCopy | None = None  # the copy that makes the slots past the full blocks cached


@dataclass(slots=True)
class _Request:
    root: int  # namespace root of the request's chain
    table: list[int]  # block table, append-only
    chain: list[Node]  # node of each committed full block, in order
    pins: list[int] = field(default_factory=list)  # blocks held only because the chain needs them
    # False: matched nothing at admission (its every block is its own), and it publishes its
    # blocks only while none is cached already: pinning cached copies it does not use would
    # take blocks the scheduler never counted for it.
    reuse: bool = True
    publishing: bool = True


class BlockManager:
    """Prefix-caching block manager. No global state: each instance owns its pool and tree."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._cache = BlockCache(num_blocks, block_size)
        self._pool, self._tree = self._cache.pool, self._cache.tree
        self._requests: dict[int, _Request] = {}
        self._stats = CacheStats()
        self._on_commit: Callable[[list[Node]], None] | None = None

    def watch(
        self,
        on_commit: Callable[[list[Node]], None] | None,
        on_evict: Callable[[Node], None] | None,
    ) -> None:
        """Be told of the nodes each commit adds to the tree (after the forward that wrote
        their K/V) and of each node about to be evicted (its K/V still intact): how the tiers
        below the pool get their blocks. Mutates only these two callbacks."""
        self._on_commit = on_commit
        self._cache.on_evict = on_evict

    # -- read-only questions -------------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        """A snapshot: counters so far plus the pool's block states now. Pure."""
        pool = self._pool
        return replace(
            self._stats,
            evicted_blocks=self._cache.evicted_blocks,
            blocks_in_use=pool.num_in_use,
            blocks_cached=pool.num_cached,
            blocks_tails=len(self._cache.tails),
            blocks_free=pool.num_free,
        )

    @property
    def cache_version(self) -> int:
        """Changes whenever a block enters or leaves the cache; matches hold until then. Pure."""
        return self._cache.version

    def num_available_blocks(self) -> int:
        """Free blocks plus cached ones no request holds (all reclaimable). Pure."""
        return self._cache.num_available()

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match(self, token_ids: Sequence[int], root: int) -> list[Node]:
        """Cached path for the prompt (see BlockCache.match); nothing without caching. Pure."""
        return self._cache.match(token_ids, root) if self.enable_prefix_caching else []

    def cached_blocks(self) -> list[CachedBlock]:
        """Every block in the tree (cached or held), each after its parent, then every tail
        (fewer tokens than a block): with their K/V, what it takes to rebuild this cache
        elsewhere. Pure."""
        return self._cache.listing()

    def cached_prefix_length(self, token_ids: Sequence[int], root: int) -> int:
        """Tokens ``allocate`` would serve from the cache now. Pure: no stats, no LRU touch."""
        nodes = self._match(token_ids, root)
        copy = self._cache.copyable(token_ids, root, nodes) if self.enable_prefix_caching else None
        return len(nodes) * self.block_size + (copy.num_tokens if copy else 0)

    def cached_continuation(self, request_id: int, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens with which a cached path (an earlier request that shared all of
        ``token_ids``) goes on past them, looked up from the end of the request's chain. Pure."""
        request = self._requests[request_id]
        if not self.enable_prefix_caching:
            return []
        return self._cache.continuation(request.root, request.chain, token_ids, k)

    def blocks_needed(self, token_ids: Sequence[int], root: int) -> int:
        """Fresh blocks ``allocate`` would take now. Pure."""
        return self._blocks_for(len(token_ids)) - len(self._match(token_ids, root))

    def _shortfall(self, token_ids: Sequence[int], nodes: list[Node], reuse: bool = True) -> int:
        """Blocks missing for allocate: fresh blocks needed minus those reclaimable once the
        matched path is locked (locking a ref-0 node takes it out of the reclaimable set).
        Not reusing, nothing is matched or locked: every block is fresh."""
        pool = self._pool
        if not reuse:
            return self._blocks_for(len(token_ids)) - self.num_available_blocks()
        locked_now = sum(1 for node in nodes if pool.ref(node.block_id) == 0)
        needed = self._blocks_for(len(token_ids)) - len(nodes)
        return needed - (self.num_available_blocks() - locked_now)

    def can_allocate(self, token_ids: Sequence[int], root: int, *, reuse: bool = True) -> bool:
        """Whether ``allocate`` (with the same ``reuse``) would succeed now. Pure."""
        nodes = self._match(token_ids, root) if reuse else []
        return self._shortfall(token_ids, nodes, reuse) <= 0

    def can_append(self, request_id: int, num_tokens: int) -> bool:
        """Whether the request's table can grow to hold ``num_tokens`` tokens in total. Pure."""
        missing = self._blocks_for(num_tokens) - len(self._requests[request_id].table)
        return missing <= 0 or missing <= self.num_available_blocks()

    def block_table(self, request_id: int) -> Sequence[int]:
        """The request's block table itself, read only: it grows in place as slots are
        appended and never changes otherwise; an allocation (a readmission too) makes a new
        one. Pure."""
        return self._requests[request_id].table

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    # -- mutations -----------------------------------------------------------------------------
    def allocate(
        self,
        request_id: int,
        token_ids: Sequence[int],
        root: int,
        *,
        readmission: bool = False,
        count: bool = True,
        reuse: bool = True,
    ) -> Allocation:
        """Admit a request. Mutates: locks the matched path (ref += 1, out of the LRU, ticks
        touched), takes fresh blocks (evicting LRU leaves when the free list is short), counts
        query/hit tokens (``readmit_*`` when ``readmission``; nothing when not ``count``, for
        a cache being loaded rather than a request). ``copy`` names the slots the caller must
        copy into the first fresh block (see SlotCopy) for them to count as cached. Not
        ``reuse``: nothing is matched or copied, every block is fresh (a request that must
        compute its whole prompt); ``commit`` still adds its blocks to the tree for others, up
        to the first one that is cached already. Raises ValueError when blocks are short, the
        prompt is empty or the id is live; nothing is mutated then."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already allocated")
        if not token_ids:
            raise ValueError("cannot allocate an empty prompt")
        nodes = self._match(token_ids, root) if reuse else []
        short = self._shortfall(token_ids, nodes, reuse)
        if short > 0:
            raise ValueError(f"request {request_id}: {short} blocks short (ask can_allocate)")
        copying = reuse and self.enable_prefix_caching
        source = self._cache.copyable(token_ids, root, nodes) if copying else None
        for node in nodes:  # lock before taking fresh blocks, so eviction cannot take them
            self._cache.hold(node)
        table = [node.block_id for node in nodes]
        table.extend(self._cache.take(self._blocks_for(len(token_ids)) - len(nodes)))
        self._requests[request_id] = _Request(root, table, nodes, reuse=reuse)
        copy = None
        if source is not None:  # the slots past the full blocks, from a cached or running block
            copy = SlotCopy(source.block_id, table[len(nodes)], source.num_tokens)
            self._cache.touch(source.block_id)
        cached = len(nodes) * self.block_size + (copy.num_tokens if copy else 0)
        if count and readmission:
            self._stats.readmit_query_tokens += len(token_ids)
            self._stats.readmit_hit_tokens += cached
        elif count:
            self._stats.query_tokens += len(token_ids)
            self._stats.hit_tokens += cached
            self._stats.copied_tokens += copy.num_tokens if copy else 0
        return Allocation(list(table), cached, copy)

    def append_slots(self, request_id: int, num_tokens: int) -> Sequence[int]:
        """Grow the table to ceil(num_tokens / B) blocks (never shrinks); returns it (read
        only). Mutates the table and the pool (may evict). Raises ValueError when blocks are
        short."""
        if not self.grow(request_id, num_tokens):
            raise ValueError(f"request {request_id}: too few blocks for {num_tokens} tokens")
        return self._requests[request_id].table

    def grow(self, request_id: int, num_tokens: int) -> bool:
        """``can_append`` and ``append_slots`` in one call (a decode step makes one per
        sequence): grows the table, or returns False and changes nothing."""
        table = self._requests[request_id].table
        missing = self._blocks_for(num_tokens) - len(table)
        if missing <= 0:
            return True
        if missing > self.num_available_blocks():
            return False
        table.extend(self._cache.take(missing))
        return True

    def commit(self, request_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Insert into the tree every full block inside ``num_computed_tokens`` not yet committed.

        Mutates the tree and pool: new nodes own the request's blocks; a block already cached
        under the same parent with equal tokens leaves the request's copy private and pins the
        cached node (so the chain can continue below it); a block whose hash collides with a
        cached block of other tokens, and every block after it, stay private for now.
        ``token_ids`` must extend the tokens committed before.
        """
        request = self._requests[request_id]
        if num_computed_tokens > len(token_ids):
            raise ValueError(f"{num_computed_tokens} computed tokens > {len(token_ids)} tokens")
        num_full = num_computed_tokens // self.block_size
        if num_full > len(request.table):
            raise ValueError(f"request {request_id}: computed tokens beyond its block table")
        self._commit_full_blocks(request, token_ids, num_full)
        if self.enable_prefix_caching and request.publishing:  # offer its partial block
            self._cache.offer_partial(
                request_id,
                request.root,
                request.chain,
                request.table,
                token_ids,
                num_computed_tokens,
            )

    def _commit_full_blocks(
        self, request: _Request, token_ids: Sequence[int], num_full: int
    ) -> None:
        start = len(request.chain)
        if not self.enable_prefix_caching or num_full <= start or not request.publishing:
            return
        B = self.block_size
        parent = request.chain[-1] if request.chain else None
        data = pack_tokens(token_ids[start * B : num_full * B])
        blocks = request.table[start:num_full]
        result = self._tree.insert(request.root, parent, data, blocks, only_new=not request.reuse)
        if not request.reuse and result.existing:
            request.publishing = False  # the rest is cached already; its copies stay private
            return
        for node in result.existing:
            self._cache.hold(node)
            request.pins.append(node.block_id)
        for node in result.created:
            self._pool.mark_cached(node.block_id)
            node.tick = self._pool.next_tick()
        if result.created and self._on_commit is not None:
            self._on_commit(result.created)
        request.chain.extend(result.existing)
        request.chain.extend(result.created)
        # On a collision the chain stops before the colliding block; the request's own copy
        # stays private and the next commit retries from there (it succeeds once the colliding
        # node has been evicted, since the chain's end is held by this request).

    def free(
        self, request_id: int, token_ids: Sequence[int] = (), num_computed_tokens: int = 0
    ) -> None:
        """Finish (or preempt) a request. Mutates: ref -= 1 on every block it holds; tree blocks
        reaching ref 0 stay cached (ticks touched, root to leaf, and leaves become evictable);
        private blocks return to the free list, except the partial block after the chain when
        ``token_ids`` (with ``num_computed_tokens`` of them in the K/V) say what it holds:
        that one stays cached as a tail. The request is forgotten."""
        request = self._requests.pop(request_id)
        self._cache.live.withdraw(request_id)
        for node in request.chain:  # root to leaf: a deeper block counts as more recent
            node.tick = self._pool.next_tick()
        tail = self._partial(request, token_ids, num_computed_tokens)
        self._cache.release((*request.table, *request.pins), tail)

    def _partial(self, request: _Request, token_ids: Sequence[int], computed: int) -> Tail | None:
        """The request's partial block as a tail, if it may be copied from. Pure."""
        if not (self.enable_prefix_caching and request.publishing):
            return None
        return self._cache.tail_of(request.root, request.chain, request.table, token_ids, computed)

    # -- checks --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert every invariant (AssertionError names the broken one): see
        kvcache/block_integrity.py for the list."""
        check_block_manager(
            self._cache, self._requests, self.num_blocks, self.enable_prefix_caching
        )
