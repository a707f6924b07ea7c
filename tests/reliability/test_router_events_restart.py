"""A replica restarted on the same KV-event endpoints: the router's feed notices that the
publisher started over (its numbers begin again, its first batch an AllBlocksCleared), even
when that batch went out before the SUB socket reconnected, and its view of the replica is
emptied, then follows the new engine's cache exactly. What went out before the feed started
(the first engine's AllBlocksCleared) comes from the replay socket."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import zmq.asyncio

from kvcache import LLM, SamplingParams
from runner.router.event_feed import EventFeed, endpoints_of
from runner.router.event_index import EventIndex
from runner.router.replicas import Replica
from tests.serve.test_router_events import engine_hashes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine(model: Path, ports: tuple[int, int]) -> LLM:
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{ports[0]}",  # bound on every interface, as vLLM's default
        "replay_endpoint": f"tcp://*:{ports[1]}",
    }
    return LLM(str(model), num_kv_blocks=64, block_size=4, kv_events_config=events)


async def until(check: object, timeout_s: float = 15.0) -> None:
    assert callable(check)
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


def test_a_restarted_replica_empties_its_view(tiny_llama_dir: Path) -> None:
    ports = (free_port(), free_port())
    params = SamplingParams(max_tokens=3, temperature=0)

    async def scenario() -> None:
        first = await asyncio.to_thread(engine, tiny_llama_dir, ports)
        assert first.kv_events is not None
        # The replica's /kvcache/info as the router read it: `*` is reached at its URL's host.
        replica = Replica("http://127.0.0.1:1", healthy=True, index=EventIndex())
        replica.info = {"kv_events": first.kv_events.endpoints()}
        endpoints = endpoints_of(replica)
        assert endpoints is not None and endpoints.endpoint == f"tcp://127.0.0.1:{ports[0]}"
        context = zmq.asyncio.Context()
        feed = asyncio.create_task(EventFeed(context, replica).run())
        index = replica.index
        assert isinstance(index, EventIndex)
        try:
            prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, i] for i in range(20, 26)]
            await asyncio.to_thread(first.generate, prompts, params)
            await until(lambda: index.blocks("GPU") == engine_hashes(first) != set())
            first.kv_events.close()
            second = await asyncio.to_thread(engine, tiny_llama_dir, ports)
            assert second.kv_events is not None
            # Its AllBlocksCleared (number 0) went out as it started, before the SUB socket
            # reconnected: the feed's idle check finds the publisher started over.
            await until(lambda: not index.blocks("GPU"))
            await asyncio.to_thread(second.generate, [[40, 41, 42, 43, 44, 45]], params)
            await until(lambda: index.blocks("GPU") == engine_hashes(second) != set())
            second.kv_events.close()
        finally:
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)
            context.destroy(linger=0)

    asyncio.run(scenario())


def test_a_gap_in_the_numbers_is_replayed() -> None:
    """Batches the feed missed (a SUB socket past its high-water mark drops them) are asked of
    the replay socket before the batch that showed the gap is applied."""
    from runner.kv_events.config import KVEventsConfig
    from runner.kv_events.publisher import KVEventPublisher
    from runner.kv_events.schema import BlockRemoved, BlockStored, EventBatch

    config = KVEventsConfig(True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    publisher = KVEventPublisher(config, block_size=1)

    def store(h: int) -> list[BlockStored]:
        return [BlockStored([h], None, [h], 1, None, "GPU")]

    async def scenario() -> None:
        context = zmq.asyncio.Context()
        replica = Replica("http://127.0.0.1:1", healthy=True, index=EventIndex())
        replica.info = {"kv_events": publisher.endpoints()}
        feed = EventFeed(context, replica)
        index = replica.index
        assert isinstance(index, EventIndex)
        try:
            await until(lambda: publisher.next_seq == 1)  # the start's AllBlocksCleared: 0
            for h in (101, 102, 103, 104):  # four batches, one at a time: numbers 1..4
                publisher.publish(store(h))
                await until(lambda h=h: publisher.next_seq == h - 99)
            await feed._catch_up(index, 0)
            assert index.last_seq == 4 and index.blocks("GPU") == {101, 102, 103, 104}
            index.restart()
            await feed._catch_up(index, 0)  # up to number 1 only, as if the rest were missed
            missed = BlockRemoved([102, 103, 104], "GPU")  # as if numbers 2..4 never came
            index.apply(1, EventBatch(ts=index.last_ts, events=[missed]))
            publisher.publish(store(105))  # number 5: numbers 2..4 are a gap
            await until(lambda: publisher.next_seq == 6)
            replayed = await feed._replay(5)
            assert replayed is not None and [seq for seq, _ in replayed] == [5]
            await feed._receive(index, 5, replayed[0][1])
            assert index.last_seq == 5
            assert index.blocks("GPU") == {101, 102, 103, 104, 105}
        finally:
            context.destroy(linger=0)
            publisher.close()

    asyncio.run(scenario())
