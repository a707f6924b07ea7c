"""The handover overlaps the prefill, over both transports: a prefill worker's open handover
fills with each block as a (chunked) prefill commits it (and, over Redis, is written on as it
fills), a decode worker's pull waits on an open handover and gets the blocks as they come, and
through the router the pulled blocks are in the decode worker's pool before its request is
admitted (the step never copies them in), with the colocated output."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from kvcache import LLM, SamplingParams
from kvcache.tiers import storage_key
from runner.disagg.blocks import prompt_chain
from runner.disagg.commit_tap import CommitTap
from runner.disagg.held import HeldHandovers
from runner.disagg.redis_stream import RedisStream
from runner.disagg.redis_transport import RedisHandover
from runner.disagg.zmq_transport import ZmqHandoverClient, ZmqHandoverServer
from tests.pd.conftest import WorkerFactory
from tests.pd.test_handover import PROMPT
from tests.pd.test_router_pd import pd_router
from tests.redis_server import RedisServer

BUDGET = 64  # tokens a step: the prompt's prefill takes several steps (chunks)


def test_an_open_handover_fills_as_the_prefill_commits(tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir), max_num_batched_tokens=BUDGET, num_kv_blocks=128)
    held = HeldHandovers(1 << 26)
    tap = CommitTap(llm, held)
    try:
        seq = llm.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0))
        tokens = list(seq.prompt_token_ids)
        chain = prompt_chain(llm, tokens, None)
        assert len(chain.hashes) > 2 * BUDGET // llm.config.block_size  # three chunks or more
        tap.open("h", tokens, None)
        llm.step()  # the first chunk: its blocks are held, the handover still open
        time.sleep(0.2)  # (the tap encodes on its own thread)
        values, still_open = held.get_open("h", chain.hashes)
        first_chunk = BUDGET // llm.config.block_size
        assert still_open and all(v is not None for v in values[:first_chunk])
        assert all(v is None for v in values[first_chunk:])
        while llm.has_unfinished():
            llm.step()
        tap.finish("h")
        values, still_open = held.get_open("h", chain.hashes)
        assert not still_open
        # Byte for byte the values a handover read off the pool at the end would hold.
        assert values == llm.cached_block_values(tokens, None)
    finally:
        tap.close()


def test_taps_listen_side_by_side_until_closed(tiny_llama_tok_dir: Path) -> None:
    """Each tap is a block listener of its own: a second one does not displace the first, and
    a closed one hears no more commits (its open handover gets nothing more)."""
    llm = LLM(str(tiny_llama_tok_dir), max_num_batched_tokens=BUDGET, num_kv_blocks=128)
    closed, kept = HeldHandovers(1 << 26), HeldHandovers(1 << 26)
    first, second = CommitTap(llm, closed), CommitTap(llm, kept)
    try:
        seq = llm.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0))
        tokens = list(seq.prompt_token_ids)
        chain = prompt_chain(llm, tokens, None)
        first.open("h", tokens, None)
        second.open("h", tokens, None)
        first.close()
        while llm.has_unfinished():
            llm.step()
        assert closed.get_open("h", chain.hashes)[0] == [None] * len(chain.hashes)
        values, _ = kept.get_open("h", chain.hashes)
        assert values == llm.cached_block_values(tokens, None)
    finally:
        second.close()


def _pull_waits(
    add: Callable[[int, bytes], object],
    finish: Callable[[], object],
    fetch: Callable[[], Iterable[list[bytes | None]]],
) -> None:
    """Blocks 1, 2, 3 asked for 2 a chunk of an open handover holding block 1: the pull waits
    for block 2, takes the first chunk as soon as it is whole, and once the handover closes
    without block 3 it ends with it missing."""
    add(1, b"one")
    got: list[list[bytes | None]] = []
    pull = threading.Thread(target=lambda: got.extend(fetch()))
    pull.start()
    time.sleep(0.3)
    assert not got  # block 2 is not there yet and the handover is open: it waits
    add(2, b"two")
    time.sleep(0.3)
    assert got == [[b"one", b"two"]]  # the first chunk, as soon as it is whole
    finish()  # block 3 never comes: closed, the pull ends with it missing
    pull.join(5)
    assert got == [[b"one", b"two"], [None]]


def test_a_pull_waits_on_an_open_handover() -> None:
    held = HeldHandovers(1 << 20)
    server = ZmqHandoverServer(held)
    client = ZmqHandoverClient(server.endpoint, timeout_s=5)
    try:
        held.open("h")
        _pull_waits(
            lambda h, v: held.add("h", h, v), lambda: held.finish("h"),
            lambda: client.fetch("h", [1, 2, 3], 2),
        )  # fmt: skip
    finally:
        client.close()
        server.close()


def test_an_open_redis_handover_is_written_as_the_prefill_commits(
    tiny_llama_tok_dir: Path, redis_server: RedisServer
) -> None:
    llm = LLM(str(tiny_llama_tok_dir), max_num_batched_tokens=BUDGET, num_kv_blocks=128)
    handover = RedisHandover(redis_server.url, llm.block_spec)
    stream = RedisStream(handover)
    tap = CommitTap(llm, HeldHandovers(1 << 26), stream.add)
    client = redis.Redis.from_url(redis_server.url)
    try:
        seq = llm.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0))
        tokens = list(seq.prompt_token_ids)
        chain = prompt_chain(llm, tokens, None)
        keys = [storage_key(llm.block_spec, h) for h in chain.hashes]
        stream.open("h")
        tap.open("h", tokens, None)
        llm.step()  # the first chunk: written to Redis while the prefill goes on
        first_chunk = BUDGET // llm.config.block_size
        deadline = time.monotonic() + 5
        while client.exists(*keys[:first_chunk]) < first_chunk and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.exists(*keys[:first_chunk]) == first_chunk
        assert client.exists(*keys[first_chunk:]) == 0
        assert client.exists("kvcache:handover:h") == 1  # open: a pull waits for the rest
        while llm.has_unfinished():
            llm.step()
        tap.finish("h")
        assert stream.finish("h") == set(chain.hashes)
        assert client.exists("kvcache:handover:h") == 0  # closed
        assert client.mget(keys) == llm.cached_block_values(tokens, None)
    finally:
        tap.close()
        stream.close()
        handover.close()


def test_a_redis_handover_too_big_to_hold_is_written_whole_at_the_end(
    tiny_llama_tok_dir: Path, redis_server: RedisServer
) -> None:
    """Past the prefill worker's held bytes the open copy is dropped (so nothing more streams):
    at the prefill's end the blocks are read off the pool and written whole, and the open
    handover leaves nothing behind."""
    from runner.disagg.publish import Publisher

    llm = LLM(str(tiny_llama_tok_dir), max_num_batched_tokens=BUDGET, num_kv_blocks=128)
    handover = RedisHandover(redis_server.url, llm.block_spec)
    publisher = Publisher(llm, HeldHandovers(4096), redis=handover)  # under one block's value
    client = redis.Redis.from_url(redis_server.url)
    try:
        seq = llm.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0))
        tokens = list(seq.prompt_token_ids)
        assert publisher.begin("h", tokens, None) is not None  # open
        while llm.has_unfinished():
            llm.step()
        params = publisher.publish("h", tokens, None)
        chain = prompt_chain(llm, tokens, None)
        keys = [storage_key(llm.block_spec, h) for h in chain.hashes]
        assert params["num_blocks"] == len(keys)
        assert client.mget(keys) == llm.cached_block_values(tokens, None)
        assert client.exists("kvcache:handover:h") == 0
        assert publisher.stream is not None and not publisher.stream._streams
    finally:
        publisher.close()


def test_a_redis_pull_waits_on_an_open_handover(
    reference_llm: LLM, redis_server: RedisServer
) -> None:
    handover = RedisHandover(redis_server.url, reference_llm.block_spec)
    stream = RedisStream(handover)
    try:
        stream.open("h")
        finished: list[set[int]] = []
        _pull_waits(
            lambda h, v: stream.add("h", h, v), lambda: finished.append(stream.finish("h")),
            lambda: handover.fetch([1, 2, 3], 2, "h"),
        )  # fmt: skip
        assert finished == [{1, 2}]  # what Redis took
    finally:
        stream.close()
        handover.close()


def test_a_redis_pull_stops_waiting_when_the_writer_is_gone(
    reference_llm: LLM, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill worker that died leaves its marker unrefreshed: once it expires, the pull ends
    with what it has (the rest is computed), long before its own bound on waiting."""
    import runner.disagg.redis_transport as transport

    monkeypatch.setattr(transport, "MARKER_TTL_S", 0.5)
    handover = RedisHandover(redis_server.url, reference_llm.block_spec)
    try:
        handover.mark_open(["h"])
        handover.publish([1], [b"one"])  # then nothing more: no write refreshes the marker
        started = time.monotonic()
        got = list(handover.fetch([1, 2], 1, "h", open_wait_s=60))
        assert got == [[b"one"], [None]]
        assert time.monotonic() - started < 5
    finally:
        handover.close()


@pytest.mark.parametrize("transport", ["zmq", "redis"])
def test_through_the_router_the_blocks_are_in_the_pool_before_admission(
    transport: str, worker: WorkerFactory, reference_llm: LLM, redis_server: RedisServer
) -> None:
    params = SamplingParams(max_tokens=16, temperature=0)
    (want,) = [o.text for o in reference_llm.generate([PROMPT], params)]
    chunked = {"max_num_batched_tokens": BUDGET}
    handover = "zmq" if transport == "zmq" else redis_server.url
    with worker("prefill", handover, **chunked) as prefill, worker("decode", handover) as decode:
        with pd_router([prefill.url], [decode.url]) as router:
            body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
            answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == want
            stats = httpx.get(f"{router.url}/router/stats").json()["handover"]
            pulled = httpx.get(f"{decode.url}/kvcache/disagg").json()["pulled"]
        blocks = stats["blocks"]
        assert blocks > 0 and pulled["loaded_blocks"] == blocks  # loaded by the pull
        tiers = decode.llm.tiers
        assert tiers is not None and tiers.stats()["loaded_blocks"] == blocks  # none at admission
        cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == blocks * decode.llm.config.block_size
        assert prefill.parts.publisher is not None
        assert prefill.parts.publisher.stats()["held"] == 0
        decode.llm.block_manager.check_integrity()


def test_the_handover_opens_before_the_prompts_first_step(
    worker: WorkerFactory, reference_llm: LLM
) -> None:
    """A prefill worker opens a queued prompt's handover on the engine's thread, before any
    step computes the prompt, so every block is caught as it commits and the answer's first
    line is the open handover's params. (Opened from the handler, it waited for the engine
    lock, which the prompt's own steps held, at times to the prefill's end: the handover then
    opened too late or not at all, and the whole pull came after the prefill.)"""
    with worker("prefill", max_num_batched_tokens=BUDGET) as prefill:
        publisher, llm = prefill.parts.publisher, prefill.llm
        assert publisher is not None
        computed_at_open: list[int] = []
        open_handover = publisher.open

        def recording_open(*args: Any) -> None:
            live = [*llm.scheduler.waiting, *llm.scheduler.running]
            computed_at_open.append(sum(s.num_computed_tokens for s in live))
            open_handover(*args)

        publisher.open = recording_open  # type: ignore[method-assign]
        block = llm.config.block_size
        for i in range(3):
            prompt = f"Variant {i}. {PROMPT}"  # none of its blocks cached: several chunks
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
            url = f"{prefill.url}/kvcache/prefill/v1/completions?early=1"
            lines = httpx.post(url, json=body, timeout=60).text.splitlines()
            first, last = (json.loads(line) for line in lines)
            assert first["kv_transfer_params"]["open"]
            assert last["kv_transfer_params"]["num_blocks"] > 2 * BUDGET // block
            (want,) = reference_llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
            assert last["prefill"]["text"] == want.text
    assert computed_at_open == [0, 0, 0]


def test_a_handover_pulled_before_its_publish_does_not_wait_for_the_engine(
    tiny_llama_tok_dir: Path,
) -> None:
    """A pull started beside the prefill can take the last blocks and release the handover
    before the prefill's answer publishes it: the publish then neither reads the blocks off
    the pool again nor waits for the engine lock (the next prompt's step, a second at times)."""
    from runner.disagg.publish import Publisher

    llm = LLM(str(tiny_llama_tok_dir), max_num_batched_tokens=BUDGET, num_kv_blocks=128)
    held = HeldHandovers(1 << 26)
    publisher = Publisher(llm, held, server=ZmqHandoverServer(held))
    try:
        seq = llm.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0))
        tokens = list(seq.prompt_token_ids)
        assert publisher.begin("h", tokens, None) is not None
        while llm.has_unfinished():
            llm.step()
        chain = prompt_chain(llm, tokens, None)
        assert all(v is not None for v in held.get("h", chain.hashes))  # every block came
        held.release("h")  # as the decode worker does once it has them all
        with llm.lock:  # a step of another prompt runs
            worker = threading.Thread(target=publisher.publish, args=("h", tokens, None))
            worker.start()
            worker.join(5)
            assert not worker.is_alive(), "the publish waited for the engine lock"
        assert not held.holds("h")  # not held again: nothing will pull it
    finally:
        publisher.close()


def test_a_handover_whose_open_failed_half_way_is_closed_at_the_end(
    tiny_llama_tok_dir: Path,
) -> None:
    """Held open but unknown to the tap (its open raised after the held copy opened): the
    prefill's end closes it, so its deadline runs and it cannot be held forever."""
    llm = LLM(str(tiny_llama_tok_dir), num_kv_blocks=64)
    held = HeldHandovers(1 << 20, ttl_s=0.2)
    tap = CommitTap(llm, held)
    held.open("h")
    tap.finish("h")
    assert held.holds("h") and not held.is_open("h")
    time.sleep(0.3)
    assert not held.holds("h") and held.stats()["expired"] == 1
