"""Least recently used first: the block whose last use is the oldest goes.

Every use draws a fresh tick from one counter; an evictable block sits in a ``SortedList`` of
ints ``tick * num_blocks + block`` (ticks are unique, so the block id never decides), and
adding, removing and popping the oldest are all O(log n). A parent left childless by an
eviction becomes evictable at its own last use, so it may go next, never before its leaf.
"""

from __future__ import annotations

from collections.abc import Iterable, Set

from sortedcontainers import SortedList


class LRU:
    """The evictable blocks by last use, oldest first. Priorities are ignored."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._tick = 0
        # block -> tick of its last use, for cached blocks: a dict of ints, which the garbage
        # collector never tracks (a list of num_blocks would be traversed while it is young)
        self._last: dict[int, int] = {}
        self._order: SortedList = SortedList()  # evictable blocks' keys
        self._key: dict[int, int] = {}  # evictable block -> its key in _order

    def used(self, block: int, priority: int = 0) -> None:
        self._tick = tick = self._tick + 1
        self._last[block] = tick

    def used_all(self, blocks: Iterable[int], priority: int = 0) -> None:
        tick, last = self._tick, self._last
        for block in blocks:
            tick += 1
            last[block] = tick
        self._tick = tick

    def evictable(self, block: int) -> None:
        if block in self._key:
            raise ValueError(f"block {block} is evictable already")
        key = self._key[block] = self._last[block] * self.num_blocks + block
        self._order.add(key)

    def held(self, block: int) -> None:
        key = self._key.pop(block, None)
        if key is not None:
            self._order.remove(key)

    def victim(self) -> int:
        if not self._order:
            raise ValueError("no evictable block")
        block: int = self._order.pop(0) % self.num_blocks
        del self._key[block]
        del self._last[block]
        return block

    def removed(self, block: int) -> None:
        self.held(block)
        self._last.pop(block, None)

    def rank(self, block: int) -> tuple[int, ...]:
        return (self._last.get(block, 0),)

    def evictable_blocks(self) -> Set[int]:
        return self._key.keys()

    def check_integrity(self) -> None:
        """1. the order and its key map hold the same blocks, each once; 2. each key is its
        block's last use; 3. no use is from the future."""
        assert len(self._order) == len(self._key), "LRU order and its key map differ in size"
        for key in self._order:
            tick, block = divmod(key, self.num_blocks)
            assert self._key.get(block) == key, f"LRU block {block}: key map disagrees"
            assert tick == self._last[block], f"LRU block {block}: not keyed by its last use"
        assert max(self._last.values(), default=0) <= self._tick, "a use from the future"
