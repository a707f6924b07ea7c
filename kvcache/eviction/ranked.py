"""An evictable set ordered by a rank a policy computes from a block's uses: the lowest rank
goes first. What LFU and priority eviction share (kvcache/eviction/lfu.py, priority.py); a
new policy that can say a block's rank subclasses ``RankedEviction`` and defines ``rank`` and,
when it keeps more than the last use, ``note``.
"""

from __future__ import annotations

from collections.abc import Iterable, Set

from sortedcontainers import SortedList


class RankedEviction:
    """Evictable blocks as ``(rank, block)`` in a ``SortedList``; every use draws a fresh tick
    from one counter (``last``: the recency every rank may break ties with)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._tick = 0
        # block -> tick of its last use, for cached blocks (a dict of ints: never tracked by
        # the garbage collector, as a list of num_blocks would be while young)
        self.last: dict[int, int] = {}
        self._order: SortedList = SortedList()
        self._key: dict[int, tuple[tuple[int, ...], int]] = {}  # evictable block -> its entry

    # -- what a subclass defines ---------------------------------------------------------------
    def rank(self, block: int) -> tuple[int, ...]:
        """The block's rank: the lowest is evicted first. Pure."""
        raise NotImplementedError

    def note(self, block: int, priority: int) -> None:
        """Record one use beyond its tick (a count, a priority). Mutates the subclass's state."""

    def forget(self, block: int) -> None:
        """Drop what ``note`` recorded of a block that left the cache. Mutates."""

    # -- the EvictionPolicy protocol -----------------------------------------------------------
    def used(self, block: int, priority: int = 0) -> None:
        self._tick = tick = self._tick + 1
        self.last[block] = tick
        self.note(block, priority)

    def used_all(self, blocks: Iterable[int], priority: int = 0) -> None:
        for block in blocks:
            self.used(block, priority)

    def evictable(self, block: int) -> None:
        if block in self._key:
            raise ValueError(f"block {block} is evictable already")
        entry = self._key[block] = (self.rank(block), block)
        self._order.add(entry)

    def held(self, block: int) -> None:
        entry = self._key.pop(block, None)
        if entry is not None:
            self._order.remove(entry)

    def victim(self) -> int:
        if not self._order:
            raise ValueError("no evictable block")
        _, block = self._order.pop(0)
        del self._key[block]
        self.removed(block)
        return block

    def removed(self, block: int) -> None:
        self.held(block)
        self.last.pop(block, None)
        self.forget(block)

    def evictable_blocks(self) -> Set[int]:
        return self._key.keys()

    def check_integrity(self) -> None:
        """1. the order and its entry map hold the same blocks, each once; 2. each entry is its
        block's rank now; 3. no use is from the future."""
        name = type(self).__name__
        assert len(self._order) == len(self._key), f"{name}: order and entry map differ in size"
        for entry in self._order:
            rank, block = entry
            assert self._key.get(block) == entry, f"{name} block {block}: entry map disagrees"
            assert rank == self.rank(block), f"{name} block {block}: not at its rank"
        assert max(self.last.values(), default=0) <= self._tick, f"{name}: a use from the future"
