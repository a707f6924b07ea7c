"""The host tier: a bounded LRU of encoded block values in this process's memory.

Written on eviction from the device pool (write-back), read at admission. The bound is on the
values' bytes (``host_cache_bytes``); the least recently used value goes first. Thread safe:
the engine's writer thread and its admission both use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvcache.tiers.listener import TierListener


class HostTier:
    """Keys to value bytes, never more than ``capacity_bytes`` of values in all."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"host_cache_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._values: OrderedDict[str, bytes] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self.listener: TierListener | None = None  # told of values stored and let go (events)

    @property
    def nbytes(self) -> int:
        """Bytes of the values held now. Pure."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        """Whether a value is held, without making it recent. Pure."""
        return key in self._values

    def keys(self) -> list[str]:
        """Keys from least to most recently used. Pure copy."""
        with self._lock:
            return list(self._values)

    def has_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held, without making it recent. Pure."""
        with self._lock:
            return [key in self._values for key in keys]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each key (None where absent); a hit becomes the most recent."""
        with self._lock:
            out = []
            for key in keys:
                value = self._values.get(key)
                if value is not None:
                    self._values.move_to_end(key)
                out.append(value)
            return out

    def put(self, key: str, value: bytes) -> bool:
        """Store (or refresh) a value, evicting the least recently used ones to make room.
        A value larger than the whole tier is not stored (returns False)."""
        if len(value) > self.capacity_bytes:
            return False
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            evicted = []
            while self._bytes + len(value) > self.capacity_bytes:
                gone_key, gone = self._values.popitem(last=False)
                self._bytes -= len(gone)
                evicted.append(gone_key)
            self._values[key] = value
            self._bytes += len(value)
            if self.listener is not None:
                if evicted:
                    self.listener.values_removed(self.name, evicted)
                self.listener.value_stored(self.name, key, value)
            return True

    def discard(self, key: str) -> None:
        """Forget a value (one that failed its checks)."""
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
                if self.listener is not None:
                    self.listener.values_removed(self.name, [key])

    def close(self) -> None:
        """Nothing to release; the tiers share one interface."""
