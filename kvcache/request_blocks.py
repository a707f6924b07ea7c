"""The blocks one live request holds: its block table, its chain of cached nodes, its pins.

The block manager keeps one per request; its integrity check (kvcache/block_integrity.py) reads
them, which is why they live apart from both."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.radix_tree import Node


@dataclass(slots=True)
class RequestBlocks:
    root: int  # namespace root of the request's chain
    table: list[int]  # block table, append-only
    chain: list[Node]  # node of each committed full block, in order
    pins: list[int] = field(default_factory=list)  # blocks held only because the chain needs them
    # False: matched nothing at admission (its every block is its own), and it publishes its
    # blocks only while none is cached already (kvcache/cache_policy.py says why).
    reads_cache: bool = True
    # Whether its blocks still go to the tree, its partial block is offered, and its partial
    # last block is kept as a tail when it ends (kvcache/partial_blocks.py).
    publishing: bool = True
    # The request's priority for the eviction policy (kvcache/eviction/priority.py: lower is
    # evicted sooner); every block it uses is used at it.
    priority: int = 0
