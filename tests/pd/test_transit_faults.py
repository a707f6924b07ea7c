"""Blocks that go wrong between the workers: a value damaged in transit, a value of another
block in its place, and a value that never arrives are each caught by the decode worker's
checks; the blocks from there on are computed, never served, and the output is still the
colocated engine's."""

from __future__ import annotations

import httpx
import redis

from kvcache import LLM
from kvcache.tiers import storage_key
from runner.disagg.blocks import prompt_chain
from tests.pd.conftest import Worker, WorkerFactory
from tests.pd.test_handover import PROMPT, complete, expected
from tests.redis_server import RedisServer

BAD = 3  # the block that goes wrong


def prefill_only(prefill: Worker, body: dict) -> dict:
    answer = httpx.post(f"{prefill.url}/kvcache/prefill/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["kv_transfer_params"]


def pull_and_check(decode: Worker, params: dict, body: dict, reference_llm: LLM) -> dict:
    pulled = httpx.post(f"{decode.url}/kvcache/pull", json=params, timeout=60).json()
    assert pulled["blocks"] == BAD  # the good run before the bad block, nothing after it
    answer = complete(decode, body)
    assert answer["choices"][0]["text"] == expected(reference_llm, PROMPT, 16)
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == BAD * decode.llm.config.block_size  # the rest was computed here
    decode.llm.block_manager.check_integrity()
    return pulled


def held_values(prefill: Worker, handover_id: str) -> dict[int, bytes]:
    publisher = prefill.parts.publisher
    assert publisher is not None and publisher.held is not None
    return publisher.held._held[handover_id].values


def test_damaged_and_swapped_blocks_over_zmq(worker: WorkerFactory, reference_llm: LLM) -> None:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    with worker("prefill") as prefill, worker("decode") as decode:
        params = prefill_only(prefill, body)
        values = held_values(prefill, params["handover_id"])
        hashes = list(values)
        damaged = bytearray(values[hashes[BAD]])
        damaged[len(damaged) // 2] ^= 0xFF  # one flipped byte in the K/V
        values[hashes[BAD]] = bytes(damaged)
        pulled = pull_and_check(decode, params, body, reference_llm)
        assert "checksum" in pulled["reason"]
        assert decode.parts.puller is not None
        assert decode.parts.puller.stats()["rejected_blocks"] == 1

    other = {"prompt": "x" + PROMPT[1:], "max_tokens": 16, "temperature": 0}
    with worker("prefill") as prefill, worker("decode") as decode:
        params = prefill_only(prefill, body)
        values = held_values(prefill, params["handover_id"])
        hashes = list(values)
        # A well-formed value of the same place in another prompt's chain, sent instead.
        foreign = held_values(prefill, prefill_only(prefill, other)["handover_id"])
        values[hashes[BAD]] = list(foreign.values())[BAD]
        pulled = pull_and_check(decode, params, body, reference_llm)
        assert "another block's hash" in pulled["reason"]


def test_missing_block_over_redis(
    worker: WorkerFactory, reference_llm: LLM, redis_server: RedisServer
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    url = redis_server.url
    with worker("prefill", url) as prefill, worker("decode", url) as decode:
        params = prefill_only(prefill, body)
        chain_keys = sorted(k.decode() for k in redis.Redis.from_url(url).keys("kvcache:*"))
        assert len(chain_keys) == params["num_blocks"]
        chain = prompt_chain(decode.llm, params["prompt_token_ids"], None)
        redis.Redis.from_url(url).delete(storage_key(decode.llm.block_spec, chain.hashes[BAD]))
        pulled = pull_and_check(decode, params, body, reference_llm)
        assert "missing" in pulled["reason"]


def test_redis_down_is_computed_not_failed(
    worker: WorkerFactory, reference_llm: LLM, redis_server: RedisServer
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    url = redis_server.url
    with worker("prefill", url) as prefill, worker("decode", url) as decode:
        redis_server.stop()
        params = prefill_only(prefill, body)
        assert params["num_blocks"] == 0  # Redis did not take them: nothing to pull
        publisher = prefill.parts.publisher  # and the handover it opened left nothing behind
        assert publisher is not None and publisher.stream is not None
        assert not publisher.stream._streams and publisher.held.stats()["held"] == 0
        pulled = httpx.post(f"{decode.url}/kvcache/pull", json=params, timeout=60).json()
        assert pulled["blocks"] == 0 and pulled["reason"] is not None  # Redis down here too
        answer = complete(decode, body)
        assert answer["choices"][0]["text"] == expected(reference_llm, PROMPT, 16)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
