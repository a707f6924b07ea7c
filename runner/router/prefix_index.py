"""What one replica has been sent, as the chained hashes of its prompts' full blocks.

A chained hash names a whole prefix (it is the hash of its block and of its parent's hash), so
a set of them is a radix tree of token blocks in all but shape: a prompt's cached prefix on the
replica is its longest run of leading hashes found in the set. The set is bounded and forgets
the least recently sent hashes first, as the replica's own cache evicts its least recently used
blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY = 1 << 20  # hashes per replica: ~16M tokens of prefixes at 16 tokens a block


class PrefixIndex:
    """Hashes sent to one replica, least recently sent first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading `hashes` were sent here (a replica that has block k of a chain was
        sent blocks 0..k-1 with it). Pure."""
        count = 0
        for h in hashes:
            if h not in self._hashes:
                break
            count += 1
        return count

    def insert(self, hashes: Sequence[int]) -> None:
        """Record a prompt sent here: its hashes become the most recently sent, root first,
        and the oldest beyond capacity are forgotten."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def emptied(self) -> PrefixIndex:
        """A fresh index of the same capacity (a replica that went away holds nothing)."""
        return PrefixIndex(self.capacity)
