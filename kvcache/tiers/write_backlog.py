"""Committed blocks waiting for room in the tiers' write queue.

The write-through tiers copy a committed block's K/V off the pool and queue it; the queue is
bounded in blocks (the copies it holds are memory), so a commit larger than the room it has
(a long prompt prefilled in one step: 1,024 blocks at a token budget of 16,384) cannot go down
at once. Its blocks wait here instead, as tree nodes, not bytes: their K/V stay in the pool
until the queue has room (the next commit or eviction, or a flush), oldest first, so a
chain's first chunks go down before its later ones. A node that leaves the tree meanwhile
(evicted: its block may hold another block's K/V from then on) is told to ``blocks_removed``
(this is a ``BlockListener``), and every waiting value it is part of is dropped, counted;
nothing else is. Pure Python over ``kvcache.radix_tree.Node``: the copy is the engine's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvcache.radix_tree import Node


class WriteBacklog:
    """Values (each a run of consecutive nodes of one chain) waiting to be copied and queued,
    oldest first. Holds at most what the tree holds: a node evicted is forgotten."""

    def __init__(self) -> None:
        self._values: deque[tuple[Node, ...]] = deque()
        self._waiting: dict[Node, int] = {}  # node -> how many waiting values hold it
        self._gone: set[Node] = set()  # waiting nodes that left the tree
        self.blocks = 0  # blocks in the waiting values

    def __len__(self) -> int:
        return len(self._values)

    def add(self, values: Sequence[Sequence[Node]]) -> None:
        """Append ``values`` (in the order they should go down). Mutates the backlog."""
        for value in values:
            nodes = tuple(value)
            self._values.append(nodes)
            self.blocks += len(nodes)
            for node in nodes:
                self._waiting[node] = self._waiting.get(node, 0) + 1

    def take(self, room: int, capacity: int) -> tuple[list[tuple[Node, ...]], int]:
        """The oldest waiting values that fit in ``room`` blocks, in order, up to the first
        that does not; and how many blocks were dropped on the way: values with a node that
        left the tree, and values larger than the queue's whole ``capacity`` (they never
        fit). Mutates the backlog: what is returned or dropped is no longer in it."""
        taken: list[tuple[Node, ...]] = []
        dropped = 0
        while self._values:
            nodes = self._values[0]
            stale = any(node in self._gone for node in nodes)
            if not stale and len(nodes) <= capacity and len(nodes) > room:
                break
            self._values.popleft()
            self._forget(nodes)
            if stale or len(nodes) > capacity:
                dropped += len(nodes)
            else:
                taken.append(nodes)
                room -= len(nodes)
        return taken, dropped

    def _forget(self, nodes: tuple[Node, ...]) -> None:
        self.blocks -= len(nodes)
        for node in nodes:
            left = self._waiting[node] - 1
            if left:
                self._waiting[node] = left
            else:
                del self._waiting[node]
                self._gone.discard(node)

    # -- BlockListener -------------------------------------------------------------------------
    def blocks_stored(self, nodes: list[Node]) -> None:
        """Nothing to do: a commit's nodes come through ``add``."""

    def blocks_removed(self, nodes: list[Node]) -> None:
        """Evicted nodes: the waiting values that hold one can no longer be copied."""
        if self._waiting:
            self._gone.update(node for node in nodes if node in self._waiting)
