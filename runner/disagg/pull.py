"""The decode worker's side of a handover: before a request is queued, pull the prompt's blocks
its pool and host tier lack from the prefill worker (directly or through Redis; directly, while
the prefill still runs), check each one as it arrives (blocks.py), and copy the run that
passes straight from the transport's buffers into the pool, a few blocks per short hold of the
engine lock (kvcache/tiers/loader.py, TierLoader.install); what the pool cannot take now
waits in the host tier. So the request's admission finds them cached on the device: a step
never stops to copy a long prompt's blocks in (a stall the running decodes would see), and the
pull's CPU on the decode worker's core is one copy a block. Whatever did not arrive, or arrived
bad, is computed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

from kvcache.hashing import unpack_tokens
from kvcache.redaction import redact_text
from kvcache.tiers import HostTier, TierDown, storage_key
from runner.disagg.blocks import PromptChain, check_values, prompt_chain
from runner.disagg.redis_transport import RedisHandover
from runner.disagg.zmq_transport import HandoverUnreachable, ZmqHandoverClient
from runner.engine.api.interface import EngineInterface

# Blocks per round trip. One: a handover's bytes then reach the decode worker a block (0.7 MiB
# of the default model) at a time, spread between its steps. In bursts of 16 blocks (11.8 MiB)
# the running decodes' ITL p99 was 1.9x its p50 in pd_interference, 1.5x with 2 or 4, 1.34x
# with 1; the round trips cost the pull ~1 ms a block of waiting, beside the prefill.
DEFAULT_CHUNK_BLOCKS = 1
LOAD_BLOCKS = 4  # blocks copied into the pool per hold of the engine lock
LOAD_YIELD_S = 0.005  # between two holds: the decodes' next step takes the lock first
# Pulls running at once, each on a thread of the puller's own (it waits on its prefill while the
# handover is open, a long prompt's whole prefill): on the event loop's default executor (six
# threads on two cores) a seventh long prefill's pull waited for one of the six to end.
MAX_PULLS = 64


class Fetched(TypedDict):
    """What the blocks' transfer did: blocks and bytes put in, and why it stopped short."""

    blocks: int
    bytes: int
    reason: str | None  # None: every block asked for came


class PullResult(Fetched):
    """A pull's answer to the router: the prompt's blocks, those held here already, the
    transfer and its milliseconds."""

    wanted: int
    skipped: int
    ms: float


@dataclass
class PullCounters:
    """What the pulls did so far (all counters only grow)."""

    pulls: int = 0
    blocks: int = 0  # blocks that arrived and passed their checks
    bytes: int = 0
    seconds: float = 0.0
    skipped_blocks: int = 0  # blocks not asked for: this worker had them cached
    rejected_blocks: int = 0  # blocks that arrived and failed a check (never served)
    missing_blocks: int = 0  # blocks asked for and not there (computed instead)
    failed_pulls: int = 0  # the other side did not answer
    loaded_blocks: int = 0  # copied into the pool by the pull (not by a step's admission)


def host_tier_of(llm: EngineInterface) -> HostTier:
    """The host tier a decode worker pulls into (it must have one: --host-cache-bytes)."""
    host = llm.host_tier()
    if host is None:
        raise ValueError("a decode worker needs a host tier (--host-cache-bytes)")
    return host


class Puller:
    """Pulls handovers into ``llm``'s host tier."""

    def __init__(
        self,
        llm: EngineInterface,
        redis: RedisHandover | None = None,
        chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
        timeout_s: float = 5.0,
    ) -> None:
        self.llm, self.redis = llm, redis
        self.host = host_tier_of(llm)
        self.chunk_blocks, self.timeout_s = chunk_blocks, timeout_s
        self.counters = PullCounters()
        self.active = 0  # pulls running now (each waits on its prefill while it is open)
        self._active_lock = threading.Lock()
        self.executor = ThreadPoolExecutor(MAX_PULLS, thread_name_prefix="kv-pull")

    def pull(self, params: dict[str, Any]) -> PullResult:
        """Pull the handover ``params`` describe (a prefill worker's kv_transfer_params);
        returns what this pull did. Never raises for the other side's faults: a block that
        does not come is a block computed here. Raises ValueError for params that are not a
        handover's."""
        try:
            tokens = [int(t) for t in params["prompt_token_ids"]]
            transport, handover_id = str(params["transport"]), str(params["handover_id"])
            endpoint = str(params.get("endpoint", ""))
            salt = params.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise TypeError(f"cache_salt must be a string, got {type(salt).__name__}")
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"kv_transfer_params: {err!r}") from err
        if transport not in ("zmq", "redis"):
            raise ValueError(f"kv_transfer_params.transport: unknown transport {transport!r}")
        with self._active_lock:
            self.active += 1
        try:
            return self._pull(tokens, transport, handover_id, endpoint, salt)
        finally:
            with self._active_lock:
                self.active -= 1

    def _pull(
        self, tokens: list[int], transport: str, handover_id: str, endpoint: str, salt: str | None
    ) -> PullResult:
        started = time.perf_counter()
        llm, chain = self.llm, prompt_chain(self.llm, tokens, salt)
        keys = [storage_key(llm.block_spec, h) for h in chain.hashes]
        start = llm.cached_prefix(tokens, salt).blocks  # what the pool holds already
        for value in self.host.get_many(keys[start:]):
            if value is None:
                break
            start += 1  # held in the host tier already (checked again at admission)
        out: PullResult = {"wanted": len(keys), "skipped": start, "blocks": 0, "bytes": 0,
                           "reason": None, "ms": 0.0}  # fmt: skip
        try:
            out |= self._fetch(transport, endpoint, handover_id, chain, salt, start, keys)
        except (HandoverUnreachable, TierDown, OSError) as err:
            self.counters.failed_pulls += 1
            out["reason"] = self._shown(err)
        out["ms"] = 1000 * (time.perf_counter() - started)
        c = self.counters
        c.pulls += 1
        c.blocks += out["blocks"]
        c.bytes += out["bytes"]
        c.seconds += out["ms"] / 1000
        c.skipped_blocks += start
        return out

    def _fetch(
        self, transport: str, endpoint: str, handover_id: str, chain: PromptChain,
        salt: str | None, start: int, keys: list[str],
    ) -> Fetched:  # fmt: skip
        hashes = chain.hashes[start:]
        client = None
        if transport == "redis":
            if self.redis is None:  # misconfigured: computed here, and the reason says why
                raise HandoverUnreachable("this decode worker has no --handover redis://")
            chunks: Iterator[Sequence[bytes | memoryview | None]]
            chunks = self.redis.fetch(hashes, self.chunk_blocks, handover_id)
        else:
            client = ZmqHandoverClient(endpoint, self.timeout_s)
            chunks = client.fetch(handover_id, hashes, self.chunk_blocks)
        at, nbytes, reason = start, 0, None
        try:
            # Blocks arrive one a round trip and go into the pool LOAD_BLOCKS a hold: each hold
            # waits for the running step, so one a hold made a handover's tail a step a block.
            pending_at, pending_kvs, pending = at, [], []
            try:
                for values in chunks if hashes else []:
                    checked = check_values(self.llm, chain, at, values)
                    passed = [value for value in values[: checked.passed] if value is not None]
                    nbytes += sum(len(value) for value in passed)
                    pending_kvs += checked.kvs
                    pending += passed
                    at += checked.passed
                    del values, passed
                    if len(pending) >= LOAD_BLOCKS or checked.reason is not None:
                        self._install(chain, salt, keys, pending_at, pending_kvs, pending)
                        pending_at, pending_kvs, pending = at, [], []  # buffers free for the next
                    if checked.reason is not None:
                        reason = checked.reason
                        if "missing" in reason:
                            self.counters.missing_blocks += len(keys) - at
                        else:
                            self.counters.rejected_blocks += 1
                        break
            except (HandoverUnreachable, TierDown, OSError) as err:
                # The other side stopped answering (a stall, a death): the blocks that came
                # before are kept, the rest computed here.
                self.counters.failed_pulls += 1
                reason = self._shown(err)
            if pending:
                self._install(chain, salt, keys, pending_at, pending_kvs, pending)
        finally:
            if client is not None:
                try:
                    client.release(handover_id)  # the prefill worker frees its copy now
                except HandoverUnreachable:
                    pass  # gone: its copy expires there (held.py), nothing is held here
                finally:
                    client.close()
        return {"blocks": at - start, "bytes": nbytes, "reason": reason}

    def _shown(self, err: Exception) -> str:
        """A failure as the pull's answer says it: the Redis password masked."""
        secrets = [self.redis.endpoint] if self.redis is not None else []
        return redact_text(f"{type(err).__name__}: {err}", secrets)

    def _install(
        self,
        chain: PromptChain,
        salt: str | None,
        keys: list[str],
        first: int,
        kvs: Sequence[memoryview],
        values: Sequence[bytes | memoryview],
    ) -> None:
        """Put checked blocks ``first``, ``first + 1``, ... of the prompt (``kvs``, the K/V of
        ``values``) straight into the pool, LOAD_BLOCKS per short hold of the lock, so the
        decodes' steps go on between them, each waiting one hold at most. Those the pool cannot
        take now (no room, or an earlier block evicted meanwhile) are copied into the host tier,
        where admission finds them."""
        llm = self.llm
        B = llm.config.block_size
        tokens = _tokens_of(chain, first + len(kvs)) + [0]  # one past: never the last block
        done = 0
        while done < len(kvs):
            if done:
                time.sleep(LOAD_YIELD_S)  # the decodes' next step takes the lock first
            upto = min(done + LOAD_BLOCKS, len(kvs))
            held, loaded = llm.install_blocks(  # one short hold of the engine lock
                tokens[: (first + upto) * B + 1], salt, first + done, kvs[done:upto]
            )
            self.counters.loaded_blocks += loaded
            if held < upto - done:  # the pool is short: the rest waits in the host tier
                for i in range(done + held, len(kvs)):
                    self.host.put(keys[first + i], bytes(values[i]))
                return
            done = upto

    def stats(self) -> dict[str, object]:
        return asdict(self.counters) | {"active": self.active}

    def close(self) -> None:
        """Take no more pulls (the running ones end on their own: each is bounded)."""
        self.executor.shutdown(wait=False, cancel_futures=True)


def _tokens_of(chain: PromptChain, blocks: int) -> list[int]:
    """The token ids of the chain's first ``blocks`` blocks."""
    return unpack_tokens(b"".join(chain.tokens[:blocks]))
