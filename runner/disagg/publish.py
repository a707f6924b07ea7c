"""The prefill worker's side of a handover: make a prompt's blocks available as block values,
held for the direct transport's pull (held.py, zmq_transport.py) or written to the shared
Redis; the answer is the kv_transfer_params a decode worker pulls with.

Direct: the handover opens when the request is queued (``begin``) and fills as its blocks are
committed (commit_tap.py), so the decode worker may pull while the prefill runs; ``publish``
then only waits for the last blocks. Redis: the blocks are read off the pool and written when
the prefill has finished."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvcache.tiers import TierDown
from runner.disagg.blocks import cached_values, prompt_chain
from runner.disagg.commit_tap import CommitTap
from runner.disagg.held import HeldHandovers
from runner.disagg.redis_transport import RedisHandover
from runner.disagg.zmq_transport import ZmqHandoverServer


@dataclass
class PublishCounters:
    handovers: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0  # after the prefill: reading off the pool, encoding, (Redis) writing
    failed: int = 0  # handovers Redis did not take (the decode worker computes their blocks)


class Publisher:
    """Publishes handovers of ``llm``'s prompts over one transport: ``server`` (direct) or
    ``redis``."""

    def __init__(
        self, llm: Any, server: ZmqHandoverServer | None, redis: RedisHandover | None
    ) -> None:
        if (server is None) == (redis is None):
            raise ValueError("a prefill worker hands over through one transport")
        self.llm, self.server, self.redis = llm, server, redis
        self.tap = CommitTap(llm, server.held) if server is not None else None
        self.counters = PublishCounters()

    @property
    def held(self) -> HeldHandovers | None:
        return self.server.held if self.server is not None else None

    def begin(
        self, handover_id: str, token_ids: Sequence[int], cache_salt: str | None
    ) -> dict[str, Any] | None:
        """Open the handover of a queued request's prompt (direct transport only): its blocks
        are held as they are committed. Returns the params a decode worker may pull with
        meanwhile (``open``: the values may still come), or None (Redis: after the prefill)."""
        if self.tap is None or self.server is None:
            return None
        self.tap.open(handover_id, token_ids, cache_salt)
        params = self._params(handover_id, token_ids, cache_salt, 0, 0, 0.0)
        return params | {"open": True}

    def publish(
        self, handover_id: str, token_ids: Sequence[int], cache_salt: str | None
    ) -> dict[str, Any]:
        """Make the prompt's cached blocks available under ``handover_id`` (after its prefill;
        an open handover is closed); returns the kv_transfer_params. When Redis cannot take
        them, the params name no block (the decode worker then computes the prompt)."""
        started = time.perf_counter()
        hashes = prompt_chain(self.llm, token_ids, cache_salt).hashes
        if self.server is not None:
            held = self.server.held
            assert self.tap is not None
            if held.is_open(handover_id):
                self.tap.finish(handover_id)
            else:
                values = cached_values(self.llm, token_ids, cache_salt)
                held.hold(handover_id, hashes[: len(values)], values)
            values = _leading_run(held.get(handover_id, hashes))
        else:
            assert self.redis is not None
            values = cached_values(self.llm, token_ids, cache_salt)
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
    ) -> dict[str, Any]:  # fmt: skip
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
        return self.redis.endpoint if self.redis is not None else None

    def release(self, handover_id: str) -> bool:
        """Free a handover not pulled (its request failed or was aborted elsewhere)."""
        if self.tap is not None:
            self.tap.cancel(handover_id)  # an open one stops filling
        return self.held.release(handover_id) if self.held is not None else False

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = asdict(self.counters)
        if self.server is not None:
            out |= self.server.held.stats()
            out |= {"served_blocks": self.server.served_blocks}
            out |= {"served_bytes": self.server.served_bytes}
        return out

    def close(self) -> None:
        if self.tap is not None:
            self.tap.close()
        if self.server is not None:
            self.server.close()
        if self.redis is not None:
            self.redis.close()


def _leading_run(values: list[bytes | None]) -> list[bytes]:
    """The values up to the first one not held (a decode worker's pull stops there)."""
    out = []
    for value in values:
        if value is None:
            break
        out.append(value)
    return out
