"""What the scheduler calls: ask, then commit (``can_allocate`` / ``allocate``); ``grow``,
``commit``, ``free``.

A request's life: ``allocate`` matches the longest cached prefix (capped so at least one prompt
token is computed), locks that path (ref += 1) and takes fresh blocks for the rest; ``grow``
extends the table during decode; ``commit`` inserts every newly computed full block into the
radix tree; ``free`` drops the request's refs, leaving tree blocks cached, and keeps the
request's partial last block as a *tail*: a later prompt that goes on past the cached full
blocks has its next tokens' K/V copied (``Allocation.copy``) from a tail, from a full block
that starts with them, or from a running request's partial block, instead of computing them
again (kvcache/partial_blocks.py). The manager keeps each request's blocks; every change to
the pool, the tree and the partial blocks goes through kvcache/block_cache.py. What is shared
between requests (all of the above, or nothing) is the caching policy chosen at construction
(kvcache/cache_policy.py); the manager never asks which one it has. Which cached block is
evicted first is the eviction policy chosen at construction too (kvcache/eviction/: "lru", the
default, "lfu" or "priority"); a request's ``priority`` at allocation is what the last ranks by.

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
from dataclasses import replace
from enum import Enum
from typing import NamedTuple

from kvcache.block_cache import BlockCache, BlockListener, CachedBlock
from kvcache.block_integrity import check_block_manager
from kvcache.cache_policy import CachePolicy, NoCaching, PrefixCaching
from kvcache.eviction import make_eviction_policy
from kvcache.partial_blocks import SlotCopy
from kvcache.radix_tree import Node
from kvcache.request_blocks import RequestBlocks
from kvcache.stats import CacheStats

__all__ = ["Allocation", "BlockListener", "BlockManager", "CachedBlock", "Purpose", "SlotCopy"]


class Purpose(Enum):
    """Who asks ``allocate`` for blocks, which says what the allocation is counted as: a hit
    rate counts each prompt once, and never a cache being loaded."""

    ADMISSION = "admission"  # a request's first admission: query, hit and copied tokens
    READMISSION = "readmission"  # a preempted request's next one: the readmit_* pair
    LOADING = "loading"  # no request: blocks being loaded into the cache; counted nowhere


class Allocation(NamedTuple):
    block_table: list[int]
    num_cached_tokens: int  # < len(token_ids): full blocks matched plus copied slots
    copy: SlotCopy | None = None  # the copy that makes the slots past the full blocks cached


class BlockManager:
    """The blocks of every live request, and the cache they share as its caching policy says
    (prefix caching, or none), evicted in the order its eviction policy says (by name: a key
    of kvcache.eviction.POLICIES; ValueError naming the choices otherwise). No global state:
    each instance owns its pool, tree and policies."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching  # read by callers; decides nothing here
        self.eviction_policy = eviction_policy
        eviction = make_eviction_policy(eviction_policy, num_blocks)
        self._cache = BlockCache(num_blocks, block_size, eviction)
        policy = PrefixCaching if enable_prefix_caching else NoCaching
        self._policy: CachePolicy = policy(self._cache)
        self._requests: dict[int, RequestBlocks] = {}
        self._stats = CacheStats()

    def watch(
        self,
        on_commit: Callable[[list[Node]], None] | None,
        on_evict: Callable[[list[Node]], None] | None,
    ) -> None:
        """Be told of the nodes each commit adds to the tree (after the forward that wrote
        their K/V) and of the nodes each allocation evicts, together (their K/V still
        intact): how the tiers below the pool get their blocks. Mutates only these two
        callbacks."""
        self._cache.on_commit = on_commit
        self._cache.on_evict = on_evict

    def watchers(
        self,
    ) -> tuple[Callable[[list[Node]], None] | None, Callable[[list[Node]], None] | None]:
        """The (on_commit, on_evict) pair `watch` set: so a second watcher can chain to the
        first instead of taking its place. Pure."""
        return self._cache.on_commit, self._cache.on_evict

    def add_listener(self, listener: BlockListener) -> None:
        """Tell ``listener`` of every block stored in and removed from the tree from now on,
        beside any other listener (KV events, taps). Mutates only the listener list."""
        self._cache.listeners.append(listener)

    def remove_listener(self, listener: BlockListener) -> None:
        """Stop telling ``listener``; ValueError if it was not added. Mutates only the list."""
        self._cache.listeners.remove(listener)

    # -- read-only questions -------------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        """A snapshot: counters so far plus the pool's block states now. Pure."""
        pool = self._cache.pool
        return replace(
            self._stats,
            evicted_blocks=self._cache.evicted_blocks,
            blocks_in_use=pool.num_in_use,
            blocks_cached=pool.num_cached,
            blocks_tails=len(self._cache.partials),
            blocks_free=pool.num_free,
        )

    @property
    def cache_version(self) -> int:
        """Changes whenever a block enters or leaves the cache; matches hold until then. Pure."""
        return self._cache.version

    @property
    def shares_prefixes(self) -> bool:
        """Whether requests share cached blocks (prefix caching) or each computes its own, so
        a caller need not know the flag the manager was built with. Pure."""
        return self.enable_prefix_caching

    def num_available_blocks(self) -> int:
        """Free blocks plus cached ones no request holds (all reclaimable). Pure."""
        return self._cache.num_available()

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match(self, token_ids: Sequence[int], root: int) -> list[Node]:
        """Cached path for the prompt (see BlockCache.match); nothing without caching. Pure."""
        return self._policy.match(token_ids, root)

    def cached_path(self, token_ids: Sequence[int], root: int) -> list[Node]:
        """The prompt's cached full blocks from its first, as admission would match them
        (nothing without caching). Pure: no stats, no LRU touch."""
        return self._match(token_ids, root)

    def cached_blocks(self) -> list[CachedBlock]:
        """Every block in the tree (cached or held), each after its parent, then every tail
        (fewer tokens than a block): with their K/V, what it takes to rebuild this cache
        elsewhere. Pure."""
        return self._cache.listing()

    def cached_prefix_length(self, token_ids: Sequence[int], root: int) -> int:
        """Tokens ``allocate`` would serve from the cache now. Pure: no stats, no LRU touch."""
        nodes = self._match(token_ids, root)
        copy = self._policy.copy_source(token_ids, root, nodes)
        return len(nodes) * self.block_size + (copy.num_tokens if copy else 0)

    def cached_continuation(self, request_id: int, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens with which a cached path (an earlier request that shared all of
        ``token_ids``) goes on past them, looked up from the end of the request's chain. Pure."""
        return self._policy.continuation(self._requests[request_id], token_ids, k)

    def blocks_needed(self, token_ids: Sequence[int], root: int) -> int:
        """Fresh blocks ``allocate`` would take now. Pure."""
        return self._blocks_for(len(token_ids)) - len(self._match(token_ids, root))

    def _shortfall(self, token_ids: Sequence[int], nodes: list[Node]) -> int:
        """Blocks missing for allocate: fresh blocks needed minus those reclaimable once the
        matched path is locked (locking a ref-0 node takes it out of the reclaimable set)."""
        locked_now = self._cache.num_unheld(nodes)
        needed = self._blocks_for(len(token_ids)) - len(nodes)
        return needed - (self.num_available_blocks() - locked_now)

    def can_allocate(
        self, token_ids: Sequence[int], root: int, *, reads_cache: bool = True
    ) -> bool:
        """Whether ``allocate`` (with the same ``reads_cache``) would succeed now. Pure."""
        nodes = self._match(token_ids, root) if reads_cache else []
        return self._shortfall(token_ids, nodes) <= 0

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
        purpose: Purpose = Purpose.ADMISSION,
        *,
        reads_cache: bool = True,
        priority: int = 0,
    ) -> Allocation:
        """Admit a request. Mutates: locks the matched path (ref += 1, out of the evictable set,
        a use each), takes fresh blocks (evicting the eviction policy's victims when the free
        list is short), counts the prompt's query and hit tokens as ``purpose`` says. Every
        block the request uses, now and at ``commit`` and ``free``, is used at ``priority``
        (the priority eviction policy's rank: lower is evicted sooner; the others ignore it).
        ``copy`` names the slots the caller must copy into the first fresh block (see SlotCopy)
        for them to count as cached.
        Not ``reads_cache`` (a request that must compute its whole prompt): nothing is matched
        or copied, every block is fresh; ``commit`` still adds its blocks to the tree for
        others, up to the first one that is cached already. Raises ValueError when blocks are
        short, the prompt is empty or the id is live; nothing is mutated then."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already allocated")
        if not token_ids:
            raise ValueError("cannot allocate an empty prompt")
        nodes = self._match(token_ids, root) if reads_cache else []
        short = self._shortfall(token_ids, nodes)
        if short > 0:
            raise ValueError(f"request {request_id}: {short} blocks short (ask can_allocate)")
        source = self._policy.copy_source(token_ids, root, nodes) if reads_cache else None
        for node in nodes:  # lock before taking fresh blocks, so eviction cannot take them
            self._cache.hold(node, priority)
        table = [node.block_id for node in nodes]
        table.extend(self._cache.take(self._blocks_for(len(token_ids)) - len(nodes)))
        request = RequestBlocks(root, table, nodes, reads_cache=reads_cache, priority=priority)
        self._requests[request_id] = request
        copy = None
        if source is not None:  # the slots past the full blocks, from a cached or running block
            copy = source.into(table[len(nodes)])
            self._cache.touch(source.block_id, priority)
        cached = len(nodes) * self.block_size + (copy.num_tokens if copy else 0)
        self._count(purpose, len(token_ids), cached, copy.num_tokens if copy else 0)
        return Allocation(list(table), cached, copy)

    def _count(self, purpose: Purpose, query: int, hit: int, copied: int) -> None:
        """Add one allocation's tokens to the counters ``purpose`` names. Mutates the stats."""
        stats = self._stats
        if purpose is Purpose.READMISSION:
            stats.readmit_query_tokens += query
            stats.readmit_hit_tokens += hit
        elif purpose is Purpose.ADMISSION:
            stats.query_tokens += query
            stats.hit_tokens += hit
            stats.copied_tokens += copied

    def borrow(
        self, reader_id: int, token_ids: Sequence[int], root: int, *, priority: int = 0
    ) -> list[int]:
        """Hold the cached full blocks of ``token_ids`` from the first, for K/V read into
        another request's blocks (a segment placed after another prefix), until
        ``free(reader_id)``. Returns their block ids (none when nothing is cached). Mutates:
        the path is held (ref += 1, out of the evictable set, used at ``priority``) under
        ``reader_id``, a request that never publishes. Raises ValueError when the id is live."""
        if reader_id in self._requests:
            raise ValueError(f"request {reader_id} is already allocated")
        nodes = self._policy.match_whole(token_ids, root)
        for node in nodes:
            self._cache.hold(node, priority)
        table = [node.block_id for node in nodes]
        self._requests[reader_id] = RequestBlocks(
            root, table, nodes, publishing=False, priority=priority
        )
        return list(table)

    def grow(self, request_id: int, num_tokens: int) -> bool:
        """Grow the table to hold ``num_tokens`` tokens in total, ceil(num_tokens / B) blocks
        (it never shrinks), or return False, changing nothing, when the pool cannot give the
        blocks missing. Mutates the table and the pool (may evict cached blocks)."""
        table = self._requests[request_id].table
        missing = self._blocks_for(num_tokens) - len(table)
        if missing > self.num_available_blocks():
            return False
        if missing > 0:
            table.extend(self._cache.take(missing))
        return True

    def commit(self, request_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """After a forward: publish every full block inside ``num_computed_tokens`` not yet
        committed, and the partial block after them, as the caching policy does (with prefix
        caching: into the tree and on offer; PrefixCaching.publish says how). Mutates the tree,
        the pool and the request's chain. ``token_ids`` must extend the tokens committed before.
        """
        request = self._requests[request_id]
        if num_computed_tokens > len(token_ids):
            raise ValueError(f"{num_computed_tokens} computed tokens > {len(token_ids)} tokens")
        num_full = num_computed_tokens // self.block_size
        if num_full > len(request.table):
            raise ValueError(f"request {request_id}: computed tokens beyond its block table")
        self._policy.publish(request_id, request, token_ids, num_computed_tokens)

    def free(
        self, request_id: int, token_ids: Sequence[int] = (), num_computed_tokens: int = 0
    ) -> None:
        """Finish (or preempt) a request. Mutates: ref -= 1 on every block it holds; tree blocks
        reaching ref 0 stay cached (used, root to leaf, and leaves become evictable);
        private blocks return to the free list, except, with prefix caching, the partial block
        after the chain when ``token_ids`` (with ``num_computed_tokens`` of them in the K/V) say
        what it holds: that one stays cached as a tail (PartialBlocks.tail_of). The request is
        forgotten."""
        request = self._requests.pop(request_id)
        self._policy.release(request_id, request, token_ids, num_computed_tokens)

    def require_cache(self, why: str) -> None:
        """Raise ValueError saying ``why`` when this manager caches nothing (its caching
        policy's answer: CachePolicy.require_cache). Pure."""
        self._policy.require_cache(why)

    def drop_cached(self) -> int:
        """Forget every cached block no request holds (the tree's and the tails): a reset of
        the prefix cache. Mutates the pool and the tree; held blocks and requests are left as
        they are. Returns the blocks freed."""
        return self._cache.drop_unheld()

    # -- checks --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert every invariant (AssertionError names the broken one): see
        kvcache/block_integrity.py for the list."""
        check_block_manager(self._cache, self._requests, self.num_blocks)
        self._policy.check_integrity()
