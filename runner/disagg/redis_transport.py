"""The handover through the shared Redis tier: the prefill worker writes a prompt's block
values under their storage keys (kvcache/tiers/block_value.py: the keys every tier uses, so a
decode worker's own remote tier would find them too); the decode worker reads them back a chunk
at a time. Redis is a cache shared by every worker, bounded by its own maxmemory: a release
deletes nothing (other requests with the same prefix may want the blocks).

While its prefill runs a handover is open: a marker key says so (it expires unless the writes
refresh it, so a prefill worker that died leaves no pull waiting past it), and a pull asks
again for the blocks not written yet, as over the direct transport."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from kvcache.tiers import BlockSpec, RemoteTier, storage_key

OPEN_POLL_S = 0.05  # how often a pull asks again for blocks an open handover lacks
MARKER_TTL_S = 30.0  # an open marker not refreshed for this long is gone (its writer died)
DEFAULT_OPEN_WAIT_S = 600.0  # the longest a pull waits on one open handover


class RedisHandover:
    """Both sides of the Redis handover for one model (its BlockSpec names the keys)."""

    def __init__(self, url: str, spec: BlockSpec, timeout_s: float = 2.0) -> None:
        self.tier = RemoteTier(url, timeout_s=timeout_s)
        self.spec = spec
        self.endpoint = url

    def publish(self, hashes: Sequence[int], values: Sequence[bytes]) -> None:
        """Write the values (one pipelined round trip). Raises TierDown."""
        items = [(storage_key(self.spec, h), v) for h, v in zip(hashes, values, strict=True)]
        if items:
            self.tier.put_many(items)

    def mark_open(self, handover_ids: Sequence[str]) -> None:
        """Say (again) that these handovers are still being written. Raises TierDown."""
        marks = [(self._marker(i), b"open") for i in handover_ids]
        if marks:
            self.tier.put_many(marks, expire_s=MARKER_TTL_S)

    def mark_closed(self, handover_id: str) -> None:
        """No more values come for the handover (best effort: else its marker expires)."""
        self.tier.discard(self._marker(handover_id))

    def fetch(
        self,
        hashes: Sequence[int],
        chunk_blocks: int,
        handover_id: str | None = None,
        open_wait_s: float = DEFAULT_OPEN_WAIT_S,
    ) -> Iterator[list[bytes | None]]:
        """The values of ``hashes``, ``chunk_blocks`` per round trip (None where absent). With
        ``handover_id``, a chunk is asked for again while that handover is open, until its
        values are all there or it closes (the marker is read in the same round trip). Raises
        TierDown."""
        deadline = time.monotonic() + open_wait_s
        marker = [self._marker(handover_id)] if handover_id is not None else []
        for start in range(0, len(hashes), chunk_blocks):
            keys = [storage_key(self.spec, h) for h in hashes[start : start + chunk_blocks]]
            values: list[bytes | None] = [None] * len(keys)
            while True:
                missing = [i for i, v in enumerate(values) if v is None]
                got = self.tier.get_many([keys[i] for i in missing] + marker)
                found, still_open = (got[:-1], got[-1] is not None) if marker else (got, False)
                for i, value in zip(missing, found, strict=False):
                    values[i] = value
                if None not in values or not still_open or time.monotonic() > deadline:
                    break
                time.sleep(OPEN_POLL_S)
            yield values

    def _marker(self, handover_id: str) -> str:
        return f"kvcache:handover:{handover_id}"

    def close(self) -> None:
        self.tier.close()
