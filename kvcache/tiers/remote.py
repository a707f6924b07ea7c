"""The remote tier: block values in a Redis server shared by every engine that points at it.

``redis://host:port/db``. A lookup asks first which of a chain's keys the server holds, with
``EXISTS`` (one pipelined round trip; Redis does not count an ``EXISTS`` as a use, so a block
a lookup cannot reach is not made recent by it), then reads only the values that continue the
chain with one ``MGET``: nothing past the chain's first gap is read or refreshed. Writes go
out in pipelines. Capacity is the server's job (``maxmemory`` with an LRU policy): a value
evicted between lookup and read is simply absent, a miss. Every call has a timeout; a failure
(server down, slow, restarted) raises ``TierDown`` and starts a backoff during which calls
fail at once without touching the network, doubling up to ``MAX_BACKOFF_S`` while it keeps
failing and reset by the first call that succeeds. The URL may carry a password: every
message shows it redacted (kvcache.redaction).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvcache.redaction import redact_text, redact_url
from kvcache.tiers.tiered import TierDown

MIN_BACKOFF_S = 0.25
MAX_BACKOFF_S = 30.0


class RemoteTier:
    """Keys to value bytes in one Redis database."""

    name = "remote"

    def __init__(self, url: str, timeout_s: float = 0.5) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"remote_cache_url must be redis://host:port/db, got {redact_url(url)!r}"
            )
        # Imported here, not at the top: an engine without a Redis tier (a GPU image without
        # the redis package) never needs it.
        import redis

        self.url = url
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
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
    def shown_url(self) -> str:
        """The URL as messages show it: without its password. Pure."""
        return redact_url(self.url)

    @property
    def backing_off(self) -> bool:
        return time.monotonic() < self._retry_at

    def _call_failed(self, err: Exception) -> TierDown:
        self._backoff = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self._backoff))
        self._retry_at = time.monotonic() + self._backoff
        # redis-py's text may quote the URL (or the password alone, in an AUTH error).
        text = redact_text(f"{type(err).__name__}: {err}", [self.url])
        return TierDown(f"{self.shown_url}: {text}")

    def _check(self) -> None:
        if self.backing_off:
            raise TierDown(f"{self.shown_url}: backing off after an error")

    def has_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether the server holds each key, in one pipelined round trip of ``EXISTS`` (which
        Redis does not count as a use: nothing is made recent). Raises TierDown."""
        if not keys:
            return []
        self._check()
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            counts = pipe.execute()
        except self._errors as err:
            raise self._call_failed(err) from err
        self._backoff = 0.0
        return [bool(count) for count in counts]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value (None where absent), in one round trip. Raises TierDown."""
        self._check()
        try:
            values = self._client.mget(list(keys)) if keys else []
        except self._errors as err:
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
        except self._errors as err:
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
        except self._errors:
            pass

    def close(self) -> None:
        self._client.close()
