"""The handovers a prefill worker holds for the direct transport: each prefilled request's
block values, by handover id, until the decode worker has pulled them (it releases them then),
the router releases them (the request failed or was aborted on the decode side), or they
expire. Bounded in bytes: past the bound the oldest handover goes first (its decode worker then
finds its blocks missing and recomputes them). Thread safe: the HTTP handlers add, the
transport's thread serves and releases."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_TTL_S = 30.0  # vLLM keeps unpulled blocks 120 s (PR #24249); a pull takes milliseconds


@dataclass
class _Handover:
    values: dict[int, bytes]  # block hash -> encoded block value
    nbytes: int
    expires: float


class HeldHandovers:
    """Handover id -> that request's block values, at most ``capacity_bytes`` in all."""

    def __init__(self, capacity_bytes: int, ttl_s: float = DEFAULT_TTL_S) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"handover capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes, self.ttl_s = capacity_bytes, ttl_s
        self._held: OrderedDict[str, _Handover] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self.expired = 0  # handovers dropped unpulled: by their deadline or for room
        self.released = 0

    def hold(self, handover_id: str, hashes: Sequence[int], values: Sequence[bytes]) -> None:
        """Hold ``values`` (block ``hashes[i]``'s value is ``values[i]``) under the id."""
        entry = _Handover(
            dict(zip(hashes, values, strict=True)),
            sum(len(v) for v in values),
            time.monotonic() + self.ttl_s,
        )
        with self._lock:
            self._drop(handover_id)
            self._expire_locked()
            while self._held and self._bytes + entry.nbytes > self.capacity_bytes:
                self._drop(next(iter(self._held)))
                self.expired += 1
            if entry.nbytes <= self.capacity_bytes:
                self._held[handover_id] = entry
                self._bytes += entry.nbytes

    def get(self, handover_id: str, hashes: Sequence[int]) -> list[bytes | None]:
        """The values of ``hashes`` held under the id (None where not held)."""
        with self._lock:
            self._expire_locked()
            entry = self._held.get(handover_id)
            values = entry.values if entry is not None else {}
            return [values.get(h) for h in hashes]

    def release(self, handover_id: str) -> bool:
        """Free the handover's values; False when it was not held (already released)."""
        with self._lock:
            found = self._drop(handover_id)
            self.released += found
            return found

    def _drop(self, handover_id: str) -> bool:
        entry = self._held.pop(handover_id, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        return True

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for handover_id in [i for i, e in self._held.items() if e.expires <= now]:
            self._drop(handover_id)
            self.expired += 1

    def stats(self) -> dict[str, int]:
        """Held handovers and bytes now; expired and released so far."""
        with self._lock:
            self._expire_locked()
            held = {"held": len(self._held), "held_bytes": self._bytes}
            return held | {"expired": self.expired, "released": self.released}
