"""What a tier tells of the values it holds, for KV events (runner/kv_events/tier_events.py
turns it into vLLM's BlockStored / BlockRemoved with the tier's medium).

The host and disk tiers call their ``listener`` under their own lock, so that a key's store and
removal are told in the order they happened whichever thread made them (the writer, the
prefetcher, a lookup discarding a bad value). The remote (Redis) tier has none: Redis evicts
inside the server, unseen, and every replica reads the same values (docs/SERVE.md, KV events).
"""

from __future__ import annotations

from typing import Protocol


class TierListener(Protocol):
    """Told of every value a tier stores and lets go; must return quickly and never call back
    into the tier (it is called under the tier's lock)."""

    def value_stored(self, tier: str, key: str, value: bytes) -> None:
        """``value`` is held under ``key`` now (a new one, or one that replaced the key's)."""

    def values_removed(self, tier: str, keys: list[str]) -> None:
        """The values under ``keys`` are gone (evicted for room, damaged, deleted)."""
