"""A commit larger than the write queue (a long prompt prefilled in one step, as with a GPU's
token budget or chunked prefill off) reaches the disk and Redis tiers whole: what the queue has
no room for waits in the pool and goes down as the queue drains, oldest first. Only a waiting
block evicted before its turn is dropped, with the values it is part of."""

from __future__ import annotations

from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcache import LLM, SamplingParams
from kvcache.hashing import pack_tokens
from kvcache.radix_tree import Node
from kvcache.tiers.write_backlog import WriteBacklog
from tests.redis_server import RedisServer

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
# Blocks of one token: a 320-token prompt is one commit of 320 blocks, past the write queue's
# 256 (a chunk of 256 and 64 single blocks).
ONE_STEP = {"block_size": 1, "max_num_batched_tokens": 512, "enable_chunked_prefill": False}
PROMPT = [3 + (i * 7) % 290 for i in range(320)]


def test_a_commit_of_320_blocks_reaches_disk_and_redis(
    tiny_llama_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    model = str(tiny_llama_dir)
    reference = LLM(model, enable_prefix_caching=False).generate([PROMPT], GREEDY)[0].token_ids
    disk = str(tmp_path / "disk")
    writer = LLM(model, disk_cache_dir=disk, remote_cache_url=redis_server.url, **ONE_STEP)
    assert writer.generate([PROMPT], GREEDY)[0].token_ids == reference
    writer.flush_cache_tiers()
    stats = writer.stats()["cache_tiers"]
    assert stats["dropped_writes"] == 0 and stats["waiting_writes"] == 0
    for name in ("disk", "remote"):
        assert stats["tiers"][name]["written_blocks"] >= len(PROMPT)
    for tier in ({"disk_cache_dir": disk}, {"remote_cache_url": redis_server.url}):
        fresh = LLM(model, **tier, **ONE_STEP)  # a restart: nothing shared but the tier
        out = fresh.generate([PROMPT], GREEDY)[0]
        assert out.token_ids == reference
        assert out.num_cached_tokens == len(PROMPT) - 1  # every block but the last token's


def nodes(count: int) -> list[Node]:
    """A chain of ``count`` nodes (blocks 0, 1, ...)."""
    out: list[Node] = []
    for i in range(count):
        out.append(Node(1000 + i, pack_tokens([i]), i, out[-1] if out else None, 7))
    return out


def test_the_backlog_goes_oldest_first_and_drops_only_what_was_evicted() -> None:
    a, b, c, d, e = nodes(5)
    backlog = WriteBacklog()
    backlog.add([(a, b, c), (d,), (e,)])
    assert backlog.take(2, capacity=8) == ([], 0)  # the oldest does not fit: nothing jumps it
    backlog.blocks_removed([d])  # evicted while waiting: its value can no longer be copied
    assert backlog.take(4, capacity=8) == ([(a, b, c), (e,)], 1)
    assert len(backlog) == 0 and backlog.blocks == 0
    backlog.add([(a, b, c), (d, e)])
    assert backlog.take(8, capacity=2) == ([(d, e)], 3)  # larger than the queue: never fits
    backlog.blocks_removed([a])  # no longer waiting: nothing to forget
    assert len(backlog) == 0


class BacklogMachine(RuleBasedStateMachine):
    """The backlog against a list: values come out in the order they went in, never one with
    an evicted node, each value once (taken or dropped), never more blocks than the room."""

    CAPACITY = 4

    def __init__(self) -> None:
        super().__init__()
        self.chain = nodes(12)
        self.backlog = WriteBacklog()
        self.ref: list[tuple[Node, ...]] = []  # waiting values, oldest first
        self.evicted: set[Node] = set()
        self.count = 0  # values added

    @rule(first=st.integers(0, 11), size=st.integers(1, 5))
    def add(self, first: int, size: int) -> None:
        value = tuple(self.chain[first : first + size])
        if any(node in self.evicted for node in value):
            return  # the engine commits only nodes in the tree
        self.backlog.add([value])
        self.ref.append(value)

    @rule(index=st.integers(0, 11))
    def evict(self, index: int) -> None:
        self.evicted.add(self.chain[index])
        self.backlog.blocks_removed([self.chain[index]])

    @rule(room=st.integers(0, 6))
    def take(self, room: int) -> None:
        taken, dropped = self.backlog.take(room, self.CAPACITY)
        expected, expected_dropped = [], 0
        while self.ref:
            value = self.ref[0]
            stale = any(node in self.evicted for node in value)
            if not stale and len(value) <= self.CAPACITY and len(value) > room:
                break
            self.ref.pop(0)
            if stale or len(value) > self.CAPACITY:
                expected_dropped += len(value)
            else:
                expected.append(value)
                room -= len(value)
        assert (taken, dropped) == (expected, expected_dropped)
        assert not any(node in self.evicted for value in taken for node in value)

    @invariant()
    def counts_agree(self) -> None:
        assert len(self.backlog) == len(self.ref)
        assert self.backlog.blocks == sum(len(value) for value in self.ref)


TestBacklog = BacklogMachine.TestCase
TestBacklog.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
