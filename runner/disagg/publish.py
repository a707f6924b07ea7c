"""The prefill worker's side of a handover: after a request's prefill (its first token), read
the prompt's blocks off the pool as block values and make them available, held for the direct
transport's pull (held.py, zmq_transport.py) or written to the shared Redis; the answer is the
kv_transfer_params a decode worker pulls with."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvcache.tiers import TierDown
from runner.disagg.blocks import cached_values, prompt_chain
from runner.disagg.held import HeldHandovers
from runner.disagg.redis_transport import RedisHandover
from runner.disagg.zmq_transport import ZmqHandoverServer


@dataclass
class PublishCounters:
    handovers: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0  # reading off the pool, encoding and (Redis) writing
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
        self.counters = PublishCounters()

    @property
    def held(self) -> HeldHandovers | None:
        return self.server.held if self.server is not None else None

    def publish(
        self, handover_id: str, token_ids: Sequence[int], cache_salt: str | None
    ) -> dict[str, Any]:
        """Make the prompt's cached blocks available under ``handover_id``; returns the
        kv_transfer_params. When Redis cannot take them, the params name no block (the decode
        worker then computes the prompt)."""
        started = time.perf_counter()
        values = cached_values(self.llm, token_ids, cache_salt)
        hashes = prompt_chain(self.llm, token_ids, cache_salt).hashes[: len(values)]
        if self.server is not None:
            self.server.held.hold(handover_id, hashes, values)
            transport, endpoint = "zmq", self.server.endpoint
        else:
            assert self.redis is not None
            transport, endpoint = "redis", self.redis.endpoint
            try:
                self.redis.publish(hashes, values)
            except TierDown:  # a tier that fails is a miss: the decode worker computes them
                self.counters.failed += 1
                values = []
        seconds = time.perf_counter() - started
        nbytes = sum(len(v) for v in values)
        c = self.counters
        c.handovers, c.blocks, c.bytes, c.seconds = (
            c.handovers + 1, c.blocks + len(values), c.bytes + nbytes, c.seconds + seconds,
        )  # fmt: skip
        return {
            "transport": transport,
            "endpoint": endpoint,
            "handover_id": handover_id,
            "prompt_token_ids": list(token_ids),
            "cache_salt": cache_salt,
            "num_blocks": len(values),
            "bytes": nbytes,
            "publish_ms": 1000 * seconds,
        }

    def release(self, handover_id: str) -> bool:
        """Free a handover not pulled (its request failed or was aborted elsewhere)."""
        return self.held.release(handover_id) if self.held is not None else False

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = asdict(self.counters)
        if self.server is not None:
            out |= self.server.held.stats()
            out |= {"served_blocks": self.server.served_blocks}
            out |= {"served_bytes": self.server.served_bytes}
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.redis is not None:
            self.redis.close()
