"""KV events in vLLM's schema: a subscriber decoding with vLLM's published types rebuilds the
engine's cached prefixes exactly, under load and through an eviction storm, live or replayed."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import msgspec
import pytest
from subscriber import Subscriber

from runner.engine.api.llm import LLM
from runner.kv_events.config import KVEventsConfig
from runner.kv_events.publisher import EventQueue
from runner.kv_events.schema import BlockRemoved, BlockStored, EventBatch, encode_batch
from runner.sampling.params import SamplingParams

EVENTS = {
    "enable_kv_cache_events": True,
    "endpoint": "tcp://127.0.0.1:0",
    "replay_endpoint": "tcp://127.0.0.1:0",
}


def engine_prefixes(llm: LLM) -> set[tuple[int, ...]]:
    """Each full cached block's whole token prefix, from the engine's own listing."""
    block_size = llm.config.block_size
    listing = {
        c.block_id: c for c in llm.block_manager.cached_blocks() if len(c.token_ids) == block_size
    }
    out = set()
    for block in listing.values():
        tokens: tuple[int, ...] = ()
        walk = block
        while True:
            tokens = tuple(walk.token_ids) + tokens
            if walk.parent is None:
                break
            walk = listing[walk.parent]
        out.add(tokens)
    return out


def test_the_wire_format_is_vllms() -> None:
    """The bytes, read as plain msgpack: [ts, [[tag, fields in vLLM's order]], rank]."""
    stored = BlockStored(
        block_hashes=[11, 12],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="GPU",
    )
    raw = msgspec.msgpack.decode(encode_batch(EventBatch(ts=1.5, events=[stored])))
    assert raw == [1.5, [["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU"]], None]


def test_config_parses_vllms_json_and_names_bad_keys() -> None:
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config.publishes and config.topic == "kv"
    with pytest.raises(ValueError, match="unknown key.*endpont"):
        KVEventsConfig.parse({"endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="publisher must be one of"):
        KVEventsConfig.parse({"publisher": "kafka"})
    assert not KVEventsConfig.parse({"enable_kv_cache_events": False}).publishes


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts over four shared stems (long enough to fill blocks), each with its own tail."""
    stems = [[rng.randrange(3, 300) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    return [
        rng.choice(stems) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 20))]
        for _ in range(n)
    ]


@pytest.mark.parametrize("pool_blocks", [2000, 24])  # roomy; an eviction storm
def test_a_subscriber_rebuilds_the_cached_prefixes(tiny_llama_dir: Path, pool_blocks: int) -> None:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=pool_blocks, block_size=4, kv_events_config=EVENTS)
    publisher = llm.kv_events
    assert publisher is not None
    live = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    rng = random.Random(pool_blocks)
    try:
        params = SamplingParams(max_tokens=6, temperature=0)
        for _ in range(3):
            llm.generate(prompts(rng, 12), params)
            live.drain()
            assert live.prefixes() == engine_prefixes(llm)
        evicted = llm.block_manager.stats.evicted_blocks
        assert (evicted > 0) == (pool_blocks < 1000), evicted
        # The cached prefix a router would compute for a prompt equals the engine's.
        for prompt in prompts(rng, 5):
            known = live.prefixes()
            k = max((len(p) for p in known if tuple(prompt[: len(p)]) == p), default=0)
            k = min(k, (len(prompt) - 1) // 4 * 4)  # the engine leaves one token to compute
            # (full blocks only: a partial block's copy is no KV event, as in vLLM)
            served = llm.block_manager.cached_prefix_length(prompt, llm._root(None))
            assert k == served // 4 * 4
        assert live.media == {"GPU"}
        # A subscriber that joins late replays the whole history and agrees too.
        late = Subscriber(publisher.endpoint, publisher.replay_endpoint)
        try:
            late.replay_from(0)
            assert late.prefixes() == engine_prefixes(llm)
        finally:
            late.close()
    finally:
        live.close()
        publisher.close()


def test_a_full_queue_drops_the_oldest_and_says_so() -> None:
    """Events dropped for a full queue are reported, so the publisher skips a sequence number
    (the subscriber replays or resyncs): never a silently wrong view."""
    queue = EventQueue(limit=2)
    first, second, third = (BlockRemoved(block_hashes=[k], medium="GPU") for k in (1, 2, 3))
    queue.put([first])
    assert queue.take() == ([first], False)
    queue.put([first, second])
    queue.put([third])
    assert queue.take() == ([second, third], True)
    assert queue.dropped == 1
    assert queue.take() == ([], False)


def test_a_plain_endpoint_connects_to_a_subscriber_that_binds(tiny_llama_dir: Path) -> None:
    """As vLLM's publisher (and as llm-d deploys it): an endpoint without a wildcard host is the
    subscriber's, which binds it; the engine connects and sends under its topic."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    events = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "kv@pod-a@tiny"}
    events["replay_endpoint"] = "tcp://127.0.0.1:0"  # the replay socket always binds
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4, kv_events_config=events)
    publisher = llm.kv_events
    assert publisher is not None and not publisher.binds
    assert publisher.endpoints()["binds"] is False
    scheduler = Subscriber(endpoint, publisher.replay_endpoint, bind=True)
    rng = random.Random(3)
    try:
        for _ in range(20):  # until the connection is up: what went before it, a replay gives
            llm.generate(prompts(rng, 3), SamplingParams(max_tokens=3, temperature=0))
            scheduler.drain(quiet_s=0.1)
            if scheduler.topics:
                break
        assert scheduler.topics == {b"kv@pod-a@tiny"}
        assert scheduler.prefixes() == engine_prefixes(llm) != set()
    finally:
        publisher.close()
        scheduler.close()
