"""The handovers a prefill worker holds for the direct transport: each prefilled request's
block values, by handover id, until the decode worker has pulled them (it releases them then),
the router releases them (the request failed or was aborted on the decode side), or they
expire. A handover is either held whole (``hold``) or filled block by block while its prefill
runs (``open``, ``add``, ``finish``: commit_tap.py), so a decode worker can pull the first
blocks before the last are computed; an open handover never expires (its prefill ends it).
Bounded in bytes: past the bound the oldest handover goes first (its decode worker then finds
its blocks missing and recomputes them). Thread safe: the HTTP handlers and the tap add, the
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
    open: bool = False  # still being filled by its prefill: more values may come


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

    def open(self, handover_id: str) -> None:
        """Start a handover whose values come one by one (``add``) until ``finish``."""
        with self._lock:
            self._drop(handover_id)
            self._expire_locked()
            self._held[handover_id] = _Handover({}, 0, float("inf"), open=True)

    def add(self, handover_id: str, block_hash: int, value: bytes) -> bool:
        """Add one value to an open handover; False when it is no longer held (released,
        or dropped for room: its decode worker computes what it lacks)."""
        with self._lock:
            entry = self._held.get(handover_id)
            if entry is None or block_hash in entry.values:
                return entry is not None
            for other in [i for i in self._held if i != handover_id]:
                if self._bytes + len(value) <= self.capacity_bytes:
                    break
                self._drop(other)
                self.expired += 1
            if self._bytes + len(value) > self.capacity_bytes:  # alone past the bound
                self._drop(handover_id)
                self.expired += 1
                return False
            entry.values[block_hash] = value
            entry.nbytes += len(value)
            self._bytes += len(value)
            return True

    def finish(self, handover_id: str) -> None:
        """No more values come for the handover; its deadline starts now."""
        with self._lock:
            entry = self._held.get(handover_id)
            if entry is not None:
                entry.open, entry.expires = False, time.monotonic() + self.ttl_s

    def holds(self, handover_id: str) -> bool:
        """Whether the handover is held (not released, expired or dropped for room)."""
        with self._lock:
            self._expire_locked()
            return handover_id in self._held

    def is_open(self, handover_id: str) -> bool:
        with self._lock:
            entry = self._held.get(handover_id)
            return entry is not None and entry.open

    def get(self, handover_id: str, hashes: Sequence[int]) -> list[bytes | None]:
        """The values of ``hashes`` held under the id (None where not held)."""
        return self.get_open(handover_id, hashes)[0]

    def get_open(self, handover_id: str, hashes: Sequence[int]) -> tuple[list[bytes | None], bool]:
        """(``get``'s values, whether the handover is still open: a None may be filled yet)."""
        with self._lock:
            self._expire_locked()
            entry = self._held.get(handover_id)
            values = entry.values if entry is not None else {}
            return [values.get(h) for h in hashes], entry is not None and entry.open

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
