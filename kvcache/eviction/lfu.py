"""Least frequently used first, ties by recency (SGLang's ``lfu``): a block's rank is how many
times it was used since it was cached, then its last use. A shared system prompt's blocks,
matched by every request, outlive a one-off answer's even when that answer is newer."""

from __future__ import annotations

from kvcache.eviction.ranked import RankedEviction


class LFU(RankedEviction):
    """Rank ``(uses, last use)``; priorities are ignored."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._uses: dict[int, int] = {}  # block -> uses since it was cached

    def rank(self, block: int) -> tuple[int, ...]:
        return self._uses.get(block, 0), self.last.get(block, 0)

    def note(self, block: int, priority: int) -> None:
        self._uses[block] = self._uses.get(block, 0) + 1

    def forget(self, block: int) -> None:
        self._uses.pop(block, None)
