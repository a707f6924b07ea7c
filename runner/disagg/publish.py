"""The prefill worker's side of a handover: make a prompt's blocks available as block values,
held for the direct transport's pull (held.py, zmq_transport.py) or written to the shared
Redis; the answer is the kv_transfer_params a decode worker pulls with.

Over either transport the handover opens when the request is queued (``begin``) and fills as
its blocks are committed (commit_tap.py), so the decode worker may pull while the prefill runs;
``publish`` then only waits for the last blocks. Direct: the values are held here until
pulled. Redis: each is also written on as it comes (redis_stream.py), and the copy held here
only lasts until the prefill's end. A handover not begun (a prefill answered in one line) is
read off the pool when the prefill ends."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvcache.redaction import redact_url
from kvcache.tiers import TierDown
from runner.disagg.blocks import prompt_chain
from runner.disagg.commit_tap import CommitTap
from runner.disagg.held import HeldHandovers
from runner.disagg.redis_stream import RedisStream
from runner.disagg.redis_transport import RedisHandover
from runner.disagg.zmq_transport import ZmqHandoverServer
from runner.engine.api.interface import EngineInterface
from runner.serve.json_types import JSONBody


@dataclass
class PublishCounters:
    handovers: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0  # after the prefill: reading off the pool, encoding, (Redis) writing
    failed: int = 0  # handovers Redis did not take (the decode worker computes their blocks)


@dataclass(eq=False)
class Publisher:
    """Publishes handovers of ``llm``'s prompts over one transport: ``server`` (direct) or
    ``redis``."""

    llm: EngineInterface
    held: HeldHandovers
    server: ZmqHandoverServer | None = None
    redis: RedisHandover | None = None
    stream: RedisStream | None = field(init=False, default=None)
    tap: CommitTap = field(init=False)
    counters: PublishCounters = field(init=False, default_factory=PublishCounters)

    def __post_init__(self) -> None:
        if (self.server is None) == (self.redis is None):
            raise ValueError("a prefill worker hands over through one transport")
        if self.redis is not None:
            self.stream = RedisStream(self.redis)
        add = self.stream.add if self.stream is not None else None
        self.tap = CommitTap(self.llm, self.held, add)

    def begin(
        self, handover_id: str, token_ids: Sequence[int], cache_salt: str | None
    ) -> JSONBody | None:
        """``open`` and ``announce`` at once."""
        self.open(handover_id, token_ids, cache_salt)
        return self.announce(handover_id, token_ids, cache_salt)

    def open(self, handover_id: str, token_ids: Sequence[int], cache_salt: str | None) -> None:
        """Open the handover of a queued request's prompt: its blocks are held (and queued for
        Redis) as they are committed. On the engine's thread, before the prompt's first step
        (Submission.on_queued): no network call here, the engine would wait on it."""
        if self.stream is not None:
            self.stream.track(handover_id)
        self.tap.open(handover_id, token_ids, cache_salt)

    def announce(
        self, handover_id: str, token_ids: Sequence[int], cache_salt: str | None
    ) -> JSONBody | None:
        """The params a decode worker may pull an opened handover with meanwhile (``open``:
        the values may still come), once (over Redis) its marker says open; None when Redis
        cannot be reached now (the handover is then written whole when the prefill ends, or
        computed)."""
        if self.stream is not None:
            try:
                self.stream.redis.mark_open([handover_id])
            except TierDown:
                self.tap.cancel(handover_id)
                self.stream.cancel(handover_id)
                self.held.release(handover_id)
                return None
        params = self._params(handover_id, token_ids, cache_salt, 0, 0, 0.0)
        return params | {"open": True}

    def publish(
        self, handover_id: str, token_ids: Sequence[int], cache_salt: str | None
    ) -> JSONBody:
        """Make the prompt's cached blocks available under ``handover_id`` (after its prefill;
        an open handover is closed); returns the kv_transfer_params. When Redis cannot take
        them, the params name no block (the decode worker then computes the prompt)."""
        started = time.perf_counter()
        hashes = prompt_chain(self.llm, token_ids, cache_salt).hashes
        held = self.held
        begun = self.tap.is_filling(handover_id)
        # Begun, direct: filled as it committed, and it may be held no more (the pull, started
        # beside the prefill, can take the last blocks and release it before this runs; read
        # off the pool again, it waited for the engine lock, which the next prompt's step may
        # hold a second). Over Redis the copy here lasts until now, unless dropped for room.
        if held.is_open(handover_id) or (begun and self.redis is None):
            self.tap.finish(handover_id)
            values = _leading_run(held.get(handover_id, hashes))
            if self.stream is not None:  # what Redis took; the copy held here is done with
                written = self.stream.finish(handover_id)
                values = values[: _run_in(hashes[: len(values)], written)]
                held.release(handover_id)
        elif self.redis is None:
            values = self.llm.cached_block_values(token_ids, cache_salt)
            held.hold(handover_id, hashes[: len(values)], values)
            values = _leading_run(held.get(handover_id, hashes))
        else:  # over Redis, not begun (or its copy here dropped for room): written whole
            assert self.stream is not None
            self.stream.cancel(handover_id)
            values = self.llm.cached_block_values(token_ids, cache_salt)
            try:
                self.redis.publish(hashes[: len(values)], values)
            except TierDown:  # a tier that fails is a miss: the decode worker computes them
                self.counters.failed += 1
                values = []
        seconds = time.perf_counter() - started
        nbytes = sum(len(v) for v in values)
        c = self.counters
        c.handovers, c.blocks, c.bytes, c.seconds = (
            c.handovers + 1, c.blocks + len(values), c.bytes + nbytes, c.seconds + seconds,
        )  # fmt: skip
        return self._params(handover_id, token_ids, cache_salt, len(values), nbytes, seconds)

    def _params(
        self, handover_id: str, token_ids: Sequence[int], cache_salt: str | None, blocks: int,
        nbytes: int, seconds: float,
    ) -> JSONBody:  # fmt: skip
        return {
            "transport": "zmq" if self.server is not None else "redis",
            "endpoint": self.server.endpoint if self.server is not None else self.redis_url,
            "handover_id": handover_id,
            "prompt_token_ids": list(token_ids),
            "cache_salt": cache_salt,
            "num_blocks": blocks,
            "bytes": nbytes,
            "publish_ms": 1000 * seconds,
        }

    @property
    def redis_url(self) -> str | None:
        """The Redis handover's URL as shown (params, stats): its password masked. The decode
        worker reads Redis at its own --handover URL, never at this one."""
        return redact_url(self.redis.endpoint) if self.redis is not None else None

    @property
    def alive(self) -> bool:
        """Whether the transport's thread (the ZeroMQ server, the Redis writer) still runs."""
        if self.server is not None:
            return self.server.alive
        return self.stream is None or self.stream.alive

    def release(self, handover_id: str) -> bool:
        """Free a handover not pulled (its request failed or was aborted elsewhere)."""
        self.tap.cancel(handover_id)  # an open one stops filling
        if self.stream is not None:
            self.stream.cancel(handover_id)
        return self.held.release(handover_id)

    def stats(self) -> JSONBody:
        out: JSONBody = asdict(self.counters) | self.held.stats()
        if self.server is not None:
            out |= {"served_blocks": self.server.served_blocks}
            out |= {"served_bytes": self.server.served_bytes}
        if self.stream is not None:
            out |= {"failed_writes": self.stream.failed_writes}
        return out

    def close(self) -> None:
        self.tap.close()
        if self.server is not None:
            self.server.close()
        if self.stream is not None:
            self.stream.close()
        if self.redis is not None:
            self.redis.close()


def _run_in(hashes: Sequence[int], written: set[int]) -> int:
    """How many of ``hashes``, from the first, are in ``written`` (a pull stops at a gap)."""
    return next((i for i, h in enumerate(hashes) if h not in written), len(hashes))


def _leading_run(values: list[bytes | None]) -> list[bytes]:
    """The values up to the first one not held (a decode worker's pull stops there)."""
    out = []
    for value in values:
        if value is None:
            break
        out.append(value)
    return out
