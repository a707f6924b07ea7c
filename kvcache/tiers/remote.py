"""The remote tier: block values in a Redis server shared by every engine that points at it.

``redis://host:port/db``. A chain's keys are read with one ``MGET`` (one round trip, not one
per block); writes go out in pipelines. Capacity is the server's job (``maxmemory`` with an
LRU policy): a value evicted between lookup and read is simply absent, a miss. Every call has
a timeout; a failure (server down, slow, restarted) raises ``TierDown`` and starts a backoff
during which calls fail at once without touching the network, doubling up to
``MAX_BACKOFF_S`` while it keeps failing and reset by the first call that succeeds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis

from kvcache.tiers.tiered import TierDown

MIN_BACKOFF_S = 0.25
MAX_BACKOFF_S = 30.0


class RemoteTier:
    """Keys to value bytes in one Redis database."""

    name = "remote"

    def __init__(self, url: str, timeout_s: float = 0.5) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"remote_cache_url must be redis://host:port/db, got {url!r}")
        self.url = url
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._backoff = 0.0
        self._retry_at = 0.0  # monotonic time before which calls fail at once

    @property
    def backing_off(self) -> bool:
        return time.monotonic() < self._retry_at

    def _call_failed(self, err: Exception) -> TierDown:
        self._backoff = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self._backoff))
        self._retry_at = time.monotonic() + self._backoff
        return TierDown(f"{self.url}: {type(err).__name__}: {err}")

    def _check(self) -> None:
        if self.backing_off:
            raise TierDown(f"{self.url}: backing off after an error")

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value (None where absent), in one round trip. Raises TierDown."""
        self._check()
        try:
            values = self._client.mget(list(keys)) if keys else []
        except (redis.RedisError, OSError) as err:
            raise self._call_failed(err) from err
        self._backoff = 0.0
        return [v if isinstance(v, bytes) else None for v in values]

    def put_many(self, items: Sequence[tuple[str, bytes]], expire_s: float | None = None) -> None:
        """Store values in one pipelined round trip, each expiring after ``expire_s`` when
        given (else kept until Redis evicts it). Raises TierDown."""
        self._check()
        expire_ms = None if expire_s is None else max(1, int(1000 * expire_s))
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, px=expire_ms)
            pipe.execute()
        except (redis.RedisError, OSError) as err:
            raise self._call_failed(err) from err
        self._backoff = 0.0

    def put(self, key: str, value: bytes) -> bool:
        self.put_many([(key, value)])
        return True

    def discard(self, key: str) -> None:
        """Delete a value that failed its checks (best effort: a failure here is ignored)."""
        try:
            if not self.backing_off:
                self._client.delete(key)
        except (redis.RedisError, OSError):
            pass

    def close(self) -> None:
        self._client.close()
