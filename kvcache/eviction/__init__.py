"""kvcache.eviction: which cached block goes first when the pool runs short.

What it owns: the ``EvictionPolicy`` protocol and the policies by name (``policy.py``), one
policy a file: ``lru`` (least recently used first, the default), ``lfu`` (least often used
first, ties by recency), ``priority`` (the lowest request priority first, ties by recency),
the last two over one ranked set (``ranked.py``). A policy keeps what it ranks by (uses, their
ticks, priorities), the set of evictable blocks and the choice of the next victim; the block
cache (kvcache/block_cache.py) tells it when a block is used, becomes evictable, is held again
or leaves the cache. A new policy is one file here and one entry in ``POLICIES``.

May import: nothing else of the project (sortedcontainers only).
"""

from kvcache.eviction.policy import POLICIES, EvictionPolicy, make_eviction_policy

__all__ = ["POLICIES", "EvictionPolicy", "make_eviction_policy"]
