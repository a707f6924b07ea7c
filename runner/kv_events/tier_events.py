"""KV events for the tiers below the pool: the blocks of each value a tier stores or lets go,
as vLLM's BlockStored / BlockRemoved under the tier's medium (host "CPU", as vLLM's CPU
offloading names it; disk "DISK"), with the same chained block hashes as the pool's events.

A tier's value may hold a chunk of several blocks, and one block may sit in two values of a
tier (a single-block value written where a prompt ended, then the chunk that a longer prompt
completed): each block is counted per medium, announced when its first value comes and
removed when its last one goes, so a subscriber's view of a medium is exactly the blocks that
medium can serve. The remote (Redis) tier publishes nothing (docs/SERVE.md, KV events).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from kvcache.hashing import TOKEN_BYTES, unpack_tokens
from kvcache.tiers import DiskTier, HostTier, TieredStore
from kvcache.tiers.block_value import Link, value_links
from runner.kv_events.schema import (
    MEDIUM_DISK,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)

# Each tier's medium, as a subscriber reads it.
MEDIA = {"host": MEDIUM_HOST, "disk": MEDIUM_DISK}
Publish = Callable[[Sequence[Event]], None]


class TierPublisher(Protocol):
    """The publisher the tiers' events go through (publisher.py's KVEventPublisher)."""

    on_cleared: Callable[[AllBlocksCleared], None] | None

    def publish(self, events: Sequence[Event]) -> None: ...


class TierEvents:
    """A tier listener (kvcache.tiers.listener.TierListener) that publishes each tier's
    blocks through ``publish`` (KVEventPublisher.publish). Thread-safe: tiers call it from the
    writer's, the prefetcher's and the engine's threads."""

    def __init__(self, publish: Publish, block_size: int) -> None:
        self.publish = publish
        self.block_size = block_size
        # (tier, key) -> its value's chain flag (a top block first) and full blocks
        self._values: dict[tuple[str, str], tuple[bool, list[Link]]] = {}
        self._counts: dict[tuple[str, int], int] = {}  # (tier, block hash) -> values holding it
        self._lock = threading.Lock()

    def value_stored(self, tier: str, key: str, value: bytes) -> None:
        parsed = value_links(value)
        if parsed is None or tier not in MEDIA:
            return
        top, links = parsed
        full = [link for link in links if len(link.tokens) == TOKEN_BYTES * self.block_size]
        with self._lock:
            # The key's earlier value (a refresh) is let go after the new one is counted: a
            # block both hold stays, unannounced either way.
            fresh = []
            for link in full:
                count = self._counts.get((tier, link.key), 0)
                self._counts[(tier, link.key)] = count + 1
                fresh.append(count == 0)
            events = self._stored(tier, links[0].key, top, full, fresh)
            events += self._forget(tier, [key])
            self._values[(tier, key)] = (top, full)
            if events:
                self.publish(events)

    def values_removed(self, tier: str, keys: list[str]) -> None:
        with self._lock:
            events = self._forget(tier, keys)
            if events:
                self.publish(events)

    def cleared(self, cleared: AllBlocksCleared) -> None:
        """Publish ``cleared`` (a reset of the pool, which the tiers outlive) followed by a
        BlockStored for every block the tiers hold, so that a subscriber that clears all of a
        replica's media on it, as the schema says, learns the tiers' blocks again. Under the
        lock: no tier event can come between them."""
        events: list[Event] = [cleared]
        with self._lock:
            told: set[tuple[str, int]] = set()
            for (tier, _), (top, full) in self._values.items():
                fresh = [(tier, link.key) not in told for link in full]
                told.update((tier, link.key) for link in full)
                if full:
                    events += self._stored(tier, full[0].key, top, full, fresh)
            self.publish(events)

    def _forget(self, tier: str, keys: list[str]) -> list[Event]:
        """The BlockRemoved of the blocks no value of ``tier`` holds once ``keys`` go."""
        gone: list[int] = []
        for key in keys:
            for link in self._values.pop((tier, key), (False, []))[1]:
                block_hash = link.key
                count = self._counts.pop((tier, block_hash)) - 1
                if count:
                    self._counts[(tier, block_hash)] = count
                else:
                    gone.append(block_hash)
        return [BlockRemoved(block_hashes=gone, medium=MEDIA[tier])] if gone else []

    def _stored(
        self, tier: str, first: int, top: bool, full: list[Link], fresh: list[bool]
    ) -> list[Event]:
        """One BlockStored per run of consecutive blocks the medium did not hold before."""
        events: list[Event] = []
        run: list[Link] = []
        for i, link in enumerate([*full, None]):
            if link is not None and fresh[i]:
                run.append(link)
                continue
            if run:
                parent = None if top and run[0].key == first else run[0].parent
                events.append(
                    BlockStored(
                        block_hashes=[r.key for r in run],
                        parent_block_hash=parent,
                        token_ids=[t for r in run for t in unpack_tokens(r.tokens)],
                        block_size=self.block_size,
                        lora_id=None,
                        medium=MEDIA[tier],
                    )
                )
                run = []
        return events


def publish_tier_events(store: TieredStore, publisher: TierPublisher, block_size: int) -> None:
    """Publish the blocks the host and disk tiers of `store` keep and let go, each under its
    medium, beside the pool's events (Redis publishes none)."""
    events = TierEvents(publisher.publish, block_size)
    publisher.on_cleared = events.cleared
    for tier in store.tiers:
        if isinstance(tier, HostTier | DiskTier):
            tier.listener = events
