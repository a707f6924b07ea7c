"""What a block manager shares between requests, chosen once when it is built: ``PrefixCaching``
or ``NoCaching``, two small classes behind one interface (``CachePolicy``), so that the manager
itself never asks which mode it is in.

* ``PrefixCaching``: an admission matches the longest cached prefix and copies the slots past
  it from a partial block (kvcache/partial_blocks.py); a commit publishes each newly computed
  full block to the radix tree and offers the request's partial block; a request that ends
  leaves its full blocks cached and its partial last block kept as a tail.
* ``NoCaching``: nothing is matched, copied, published or kept; every request computes its
  whole prompt and its blocks go back to the free list when it ends.

A request that must compute its whole prompt under prefix caching (``reads_cache`` false at
allocation: its prompt log-probabilities were asked for) matches nothing; it still publishes
its blocks, up to the first one that is cached already (``RequestBlocks.publishing``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvcache.block_cache import BlockCache
from kvcache.hashing import pack_tokens
from kvcache.partial_blocks import TailMatch
from kvcache.radix_tree import Node
from kvcache.request_blocks import RequestBlocks


class CachePolicy(Protocol):
    """How a block manager shares blocks between requests. Each method says what it mutates."""

    def match(self, token_ids: Sequence[int], root: int) -> list[Node]:
        """The cached path an admission of ``token_ids`` would lock (BlockCache.match). Pure."""
        ...

    def copy_source(
        self, token_ids: Sequence[int], root: int, nodes: list[Node]
    ) -> TailMatch | None:
        """The block whose leading slots hold the tokens after the matched ``nodes``. Pure."""
        ...

    def match_whole(self, token_ids: Sequence[int], root: int) -> list[Node]:
        """The cached path of every full block of the tokens, uncapped, for K/V read elsewhere
        (BlockCache.match_whole). Pure."""
        ...

    def continuation(self, request: RequestBlocks, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens with which a cached path goes on past ``token_ids``. Pure."""
        ...

    def require_cache(self, why: str) -> None:
        """Raise ValueError saying ``why`` when this policy caches nothing (a saved cache has
        nowhere to go). Pure."""
        ...

    def publish(
        self, request_id: int, request: RequestBlocks, token_ids: Sequence[int], computed: int
    ) -> None:
        """After a forward: make the request's computed blocks (its full blocks inside the
        first ``computed`` tokens, then its partial block) available to others. Mutates the
        tree, the pool, the request's chain and pins, the offers."""
        ...

    def release(
        self, request_id: int, request: RequestBlocks, token_ids: Sequence[int], computed: int
    ) -> None:
        """A request ends: drop its holds (BlockCache.release), keeping what this policy keeps.
        Mutates the pool, the tails, the offers."""
        ...

    def check_integrity(self) -> None:
        """Assert what this policy promises of the cache (AssertionError names it)."""
        ...


class PrefixCaching:
    """Share every computed block: match, copy, publish, keep tails."""

    def __init__(self, cache: BlockCache) -> None:
        self._cache = cache

    def match(self, token_ids: Sequence[int], root: int) -> list[Node]:
        return self._cache.match(token_ids, root)

    def copy_source(
        self, token_ids: Sequence[int], root: int, nodes: list[Node]
    ) -> TailMatch | None:
        return self._cache.copyable(token_ids, root, nodes)

    def match_whole(self, token_ids: Sequence[int], root: int) -> list[Node]:
        return self._cache.match_whole(token_ids, root)

    def continuation(self, request: RequestBlocks, token_ids: Sequence[int], k: int) -> list[int]:
        return self._cache.continuation(request, token_ids, k)

    def require_cache(self, why: str) -> None:
        """Everything is cached: nothing to refuse."""

    def publish(
        self, request_id: int, request: RequestBlocks, token_ids: Sequence[int], computed: int
    ) -> None:
        """Insert the full blocks not yet on the request's chain; then offer its partial block.
        A block already cached under the same parent with equal tokens leaves the request's
        copy private and pins the cached node (so the chain can continue below it); a block
        whose hash collides with a cached block of other tokens, and every block after it, stay
        private for now. A request that reads nothing stops publishing at the first block that
        is cached already (pinning cached copies it does not use would take blocks the
        scheduler never counted for it)."""
        B = self._cache.block_size
        start, num_full = len(request.chain), computed // B
        if num_full > start and request.publishing:
            parent = request.chain[-1] if request.chain else None
            data = pack_tokens(token_ids[start * B : num_full * B])
            blocks = request.table[start:num_full]
            only_new = not request.reads_cache
            result = self._cache.insert(
                request.root, parent, data, blocks, only_new=only_new, priority=request.priority
            )
            if only_new and result.existing:
                request.publishing = False  # the rest is cached already; its copies stay private
            else:
                request.pins.extend(node.block_id for node in result.existing)  # held by insert
                request.chain.extend(result.existing)
                request.chain.extend(result.created)
            # On a collision the chain stops before the colliding block; the request's own copy
            # stays private and the next commit retries from there (it succeeds once the
            # colliding node has been evicted, since the chain's end is held by this request).
        self._cache.offer(request_id, request, token_ids, computed)

    def release(
        self, request_id: int, request: RequestBlocks, token_ids: Sequence[int], computed: int
    ) -> None:
        self._cache.release(request_id, request, token_ids, computed)

    def check_integrity(self) -> None:
        """Nothing beyond the cache's own invariants (kvcache/block_integrity.py)."""


class NoCaching:
    """Share nothing: the tree and the tails stay empty."""

    def __init__(self, cache: BlockCache) -> None:
        self._cache = cache

    def match(self, token_ids: Sequence[int], root: int) -> list[Node]:
        return []

    def copy_source(
        self, token_ids: Sequence[int], root: int, nodes: list[Node]
    ) -> TailMatch | None:
        return None

    def match_whole(self, token_ids: Sequence[int], root: int) -> list[Node]:
        return []

    def continuation(self, request: RequestBlocks, token_ids: Sequence[int], k: int) -> list[int]:
        return []

    def require_cache(self, why: str) -> None:
        raise ValueError(f"the prefix cache is off in this engine: {why}")

    def publish(
        self, request_id: int, request: RequestBlocks, token_ids: Sequence[int], computed: int
    ) -> None:
        """Nothing is published."""

    def release(
        self, request_id: int, request: RequestBlocks, token_ids: Sequence[int], computed: int
    ) -> None:
        """Every block goes back to the free list: no tail is kept."""
        self._cache.release(request_id, request, (), 0)

    def check_integrity(self) -> None:
        tree, tails = self._cache.tree, self._cache.partials
        assert len(tree) == len(tails) == 0, "cache used while disabled"
