"""A prefill worker's Redis handover written while its prefill runs: each value the commit tap
encodes (in the step that committed its block: commit_tap.py) is queued here, never written
in the step itself (a step must not wait on the network), and one thread writes the queue in
pipelines, refreshing the open handovers' markers as it goes (redis_transport.py). When the
prefill ends, ``finish`` waits for that handover's last writes and closes its marker, so a
decode worker pulling meanwhile got the first blocks long before the last were computed."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from kvcache.tiers import TierDown
from runner.disagg.redis_transport import RedisHandover

_BATCH = 16  # values a pipeline at most: ~12 MiB of the default model's


@dataclass
class _Stream:
    pending: int = 0  # values queued and not yet written (or failed)
    written: set[int] = field(default_factory=set)  # block hashes Redis took


class RedisStream:
    """Queues ``add``ed values and writes them to ``redis`` on its own thread."""

    def __init__(self, redis: RedisHandover) -> None:
        self.redis = redis
        self.failed_writes = 0  # values Redis did not take (their blocks are computed)
        self._streams: dict[str, _Stream] = {}
        self._done = threading.Condition()
        self._queue: queue.Queue[tuple[str, int, bytes] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="kv-redis", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the writing thread runs (False once closed)."""
        return self._thread.is_alive()

    def open(self, handover_id: str) -> None:
        """Start a handover (its marker says open). Raises TierDown: the caller hands it over
        when the prefill ends instead."""
        self.redis.mark_open([handover_id])
        self.track(handover_id)

    def track(self, handover_id: str) -> None:
        """Start taking a handover's values, its marker not written yet (no network call: the
        engine's thread opens handovers; the marker follows from the request's handler)."""
        with self._done:
            self._streams[handover_id] = _Stream()

    def add(self, handover_id: str, block_hash: int, value: bytes) -> None:
        """Queue one value of an open handover (called inside a step: never waits)."""
        with self._done:
            stream = self._streams.get(handover_id)
            if stream is None:
                return
            stream.pending += 1
        self._queue.put_nowait((handover_id, block_hash, value))

    def finish(self, handover_id: str, timeout_s: float = 30.0) -> set[int]:
        """Wait for the handover's queued writes, close its marker; the hashes Redis took."""
        with self._done:
            stream = self._streams.get(handover_id)
            if stream is None:
                return set()
            self._done.wait_for(lambda: stream.pending == 0, timeout_s)
            del self._streams[handover_id]
        self.redis.mark_closed(handover_id)
        return stream.written

    def cancel(self, handover_id: str) -> None:
        """Stop a handover (its request failed): what was written stays, as cache entries."""
        with self._done:
            found = self._streams.pop(handover_id, None) is not None
        if found:
            self.redis.mark_closed(handover_id)

    def _write_loop(self) -> None:
        while True:
            items = [self._queue.get()]
            while len(items) < _BATCH and items[-1] is not None:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            batch = [item for item in items if item is not None]
            ok = self._write(batch)
            with self._done:
                for handover_id, block_hash, _ in batch:
                    stream = self._streams.get(handover_id)
                    if stream is not None:
                        stream.pending -= 1
                        if ok:
                            stream.written.add(block_hash)
                self._done.notify_all()
            if items[-1] is None:
                return

    def _write(self, batch: list[tuple[str, int, bytes]]) -> bool:
        if not batch:
            return True
        with self._done:
            still_open = [i for i in {item[0] for item in batch} if i in self._streams]
        try:
            self.redis.publish([h for _, h, _ in batch], [v for _, _, v in batch])
        except TierDown:
            self.failed_writes += len(batch)
            return False
        try:
            self.redis.mark_open(still_open)  # the writer is alive: their markers live on
        except TierDown:
            pass  # the values are written; an expired marker only ends a pull's wait early
        return True

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(30)
