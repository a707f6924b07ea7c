"""How many conversations share each block of a prompt, as the router has seen them.

Router-wide (over every replica), each chained block hash keeps the distinct hashes that have
followed it. A block followed by k different blocks is a prefix of (at least) k different
prompts: a system prompt every conversation opens with, a document several questions ask
about. A prompt's block i is shared by k_i conversations, where k_i is the most
continuations any block from i on has (everything before a branch point is common to all its
branches). Bounded: the least recently seen hashes are forgotten first, and a block stops
recording continuations past MAX_CONTINUATIONS (its share is then small enough not to matter).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY = 1 << 20  # hashes remembered, as the prefix indexes hold
MAX_CONTINUATIONS = 64


class SharedPrefixes:
    """Each seen block hash's distinct continuations, least recently seen first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._next: OrderedDict[int, set[int]] = OrderedDict()

    def observe(self, hashes: Sequence[int]) -> list[int]:
        """Record one prompt's chain, then return k_i for each of its blocks (1: only this
        prompt's, or prompts that continue it, such as a conversation's later turns)."""
        for parent, child in zip(hashes, hashes[1:], strict=False):
            following = self._next.setdefault(parent, set())
            if len(following) < MAX_CONTINUATIONS:
                following.add(child)
            self._next.move_to_end(parent)
        if hashes:
            self._next.setdefault(hashes[-1], set())
            self._next.move_to_end(hashes[-1])
        while len(self._next) > self.capacity:
            self._next.popitem(last=False)
        shares = [1] * len(hashes)
        most = 1
        for i in range(len(hashes) - 1, -1, -1):
            most = max(most, len(self._next.get(hashes[i], ())))
            shares[i] = most
        return shares
