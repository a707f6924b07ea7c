"""The handover through the shared Redis tier: the prefill worker writes a prompt's block
values under their storage keys (kvcache/tiers/block_value.py: the keys every tier uses, so a
decode worker's own remote tier would find them too); the decode worker reads them back a chunk
at a time. Redis is a cache shared by every worker, bounded by its own maxmemory: a release
deletes nothing (other requests with the same prefix may want the blocks)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvcache.tiers import BlockSpec, RemoteTier, storage_key


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

    def fetch(self, hashes: Sequence[int], chunk_blocks: int) -> Iterator[list[bytes | None]]:
        """The values of ``hashes``, ``chunk_blocks`` per round trip. Raises TierDown."""
        for start in range(0, len(hashes), chunk_blocks):
            keys = [storage_key(self.spec, h) for h in hashes[start : start + chunk_blocks]]
            yield self.tier.get_many(keys)

    def close(self) -> None:
        self.tier.close()
