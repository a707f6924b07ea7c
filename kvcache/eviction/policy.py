"""The eviction policy's interface and the policies by name.

The block cache (kvcache/block_cache.py) decides *what* may be evicted: a tree node no request
holds and no child hangs below (taking a leaf keeps every path from the top whole), and every
tail (kvcache/partial_blocks.py). The policy decides *in which order*: it hears of every use of
a cached block, keeps whatever it ranks by, holds the evictable set and names the next victim.
The pool (kvcache/block_pool.py) keeps only reference counts and the free list.

A new policy is one file in this package and one entry in ``POLICIES``; ``RankedEviction``
(kvcache/eviction/ranked.py) gives it the evictable set when it can say a block's rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set
from types import MappingProxyType
from typing import Protocol

from kvcache.eviction.lfu import LFU
from kvcache.eviction.lru import LRU
from kvcache.eviction.priority import PriorityEviction


class EvictionPolicy(Protocol):
    """The order in which cached blocks are evicted. A block is named by its id; every method
    says what it mutates. The cache calls ``used`` only on cached blocks (tree nodes and tails,
    held or not), and ``evictable`` / ``held`` / ``removed`` as a block enters and leaves the
    evictable set, so the set always holds exactly the unheld leaves and the tails."""

    def used(self, block: int, priority: int = 0) -> None:
        """A request with ``priority`` (lower: evicted sooner) used ``block`` now: matched and
        held it, published it, copied from it, finished with it or kept it as a tail. The
        block is not evictable at this moment (the cache takes an evictable one out first and
        puts it back after, so that it takes its new place). Mutates the bookkeeping."""
        ...

    def used_all(self, blocks: Iterable[int], priority: int = 0) -> None:
        """``used`` for each of ``blocks``, in order (a path published or finished with: one
        call, not one a block, on the hot paths). Mutates the bookkeeping."""
        ...

    def evictable(self, block: int) -> None:
        """``block`` may be evicted from now on, ranked by its uses so far. Mutates the set."""
        ...

    def held(self, block: int) -> None:
        """A request holds ``block`` (or it has a child again): no longer evictable, its uses
        remembered. Nothing happens when it was not evictable. Mutates the set."""
        ...

    def victim(self) -> int:
        """Take the first block in the eviction order out of the set and forget it; the caller
        evicts it. Raises ValueError when nothing is evictable. Mutates."""
        ...

    def removed(self, block: int) -> None:
        """``block`` left the cache some other way (a tail replaced, or evicted with its
        parent): forget it, evictable or not. Mutates."""
        ...

    def rank(self, block: int) -> tuple[int, ...]:
        """Where a cached block stands in the eviction order, evictable or not: the lower, the
        sooner it would go. Ties between tails are broken by it (the fewest kept under one
        parent) and continuation guesses follow the highest. Pure."""
        ...

    def evictable_blocks(self) -> Set[int]:
        """The evictable blocks (for integrity checks). Pure: a view the caller must not keep
        across mutations."""
        ...

    def check_integrity(self) -> None:
        """Assert the policy's own invariants (AssertionError names the broken one)."""
        ...


# The policies by the name `BlockManager(eviction_policy=...)` and `--eviction-policy` take;
# each is built with the pool's block count. Read only: a new policy is a new entry here.
POLICIES: Mapping[str, Callable[[int], EvictionPolicy]] = MappingProxyType(
    {
        "lru": LRU,
        "lfu": LFU,
        "priority": PriorityEviction,
    }
)


def check_policy_name(name: str) -> None:
    """Raise ValueError naming ``name`` and the choices when no policy has that name."""
    if name not in POLICIES:
        raise ValueError(
            f"unknown eviction policy {name!r}: choose one of {', '.join(sorted(POLICIES))}"
        )


def make_eviction_policy(name: str, num_blocks: int) -> EvictionPolicy:
    """The policy called ``name`` for a pool of ``num_blocks`` blocks (ValueError naming the
    choices for an unknown name)."""
    check_policy_name(name)
    return POLICIES[name](num_blocks)
