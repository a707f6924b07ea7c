"""The lowest request priority first, ties by recency (SGLang's ``priority`` eviction): a
block's rank is the highest priority of the requests that used it since it was cached (an int,
lower is evicted sooner; 0 unless the caller says), then its last use. With every request at
the same priority it evicts as ``lru`` does."""

from __future__ import annotations

from kvcache.eviction.ranked import RankedEviction


class PriorityEviction(RankedEviction):
    """Rank ``(highest priority of its users, last use)``."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._priority: dict[int, int] = {}  # block -> highest priority; absent: none yet

    def rank(self, block: int) -> tuple[int, ...]:
        return self._priority.get(block, 0), self.last.get(block, 0)

    def note(self, block: int, priority: int) -> None:
        old = self._priority.get(block)
        if old is None or priority > old:
            self._priority[block] = priority

    def forget(self, block: int) -> None:
        self._priority.pop(block, None)
