"""The handover between a real prefill worker and a real decode worker, over each transport:
the decode worker's greedy output equals the colocated engine's, its prompt's blocks came
from the prefill worker (counted as cached, not computed), blocks it had cached were not sent,
and a block missing or damaged in transit is computed, never served."""

from __future__ import annotations

import httpx
import pytest

from kvcache import LLM, SamplingParams
from tests.pd.conftest import Worker, WorkerFactory
from tests.redis_server import RedisServer

PROMPT = "Disaggregated prefill hands the KV blocks of a long prompt over to the decoder. " * 2


def handover(prefill: Worker, decode: Worker, body: dict) -> tuple[dict, dict]:
    """The router's two steps before the request itself: prefill, then pull."""
    answer = httpx.post(f"{prefill.url}/kvcache/prefill/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    pulled = httpx.post(f"{decode.url}/kvcache/pull", json=params, timeout=60)
    assert pulled.status_code == 200, pulled.text
    return params, pulled.json()


def complete(decode: Worker, body: dict) -> dict:
    answer = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def expected(reference_llm: LLM, prompt: str, max_tokens: int) -> str:
    (out,) = reference_llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))
    return out.text


@pytest.mark.parametrize("transport", ["zmq", "redis"])
def test_handover_gives_the_colocated_output(
    transport: str, worker: WorkerFactory, reference_llm: LLM, redis_server: RedisServer
) -> None:
    handover_to = "zmq" if transport == "zmq" else redis_server.url
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    with worker("prefill", handover_to) as prefill, worker("decode", handover_to) as decode:
        params, pulled = handover(prefill, decode, body)
        blocks = (len(params["prompt_token_ids"]) - 1) // decode.llm.config.block_size
        assert params["num_blocks"] == blocks and blocks >= 8
        assert pulled["blocks"] == blocks and pulled["reason"] is None
        answer = complete(decode, body)
        assert answer["choices"][0]["text"] == expected(reference_llm, PROMPT, 24)
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == blocks * decode.llm.config.block_size  # none of them recomputed
        if transport == "zmq":  # pulled, so released: the prefill worker holds nothing
            assert prefill.parts.publisher is not None
            assert prefill.parts.publisher.stats()["held"] == 0
        # The same prompt again: the decode worker has every block, none is sent.
        _, again = handover(prefill, decode, body)
        assert again["skipped"] == blocks and again["blocks"] == 0
        decode.llm.block_manager.check_integrity()


def test_a_prompt_given_as_segments_goes_through_the_handover(
    worker: WorkerFactory, reference_llm: LLM
) -> None:
    """A completions body with segments: the prefill worker hands over its exact prefix (a
    blend's K/V past it are never published, so never sent); the decode worker computes or
    blends the rest. blend_ratio 1 gives the colocated output of the joined text, and a blended
    request runs to its end with the decode worker's pool intact."""
    docs = [PROMPT, "Tiers below the pool keep blocks that the device evicts. " * 3]
    segments = ["Read the notes.\n", docs[0], docs[1], "\nSummarize them."]
    plain = {"segments": segments, "blend_ratio": 1, "max_tokens": 12, "temperature": 0}
    with worker("prefill", "zmq") as prefill, worker("decode", "zmq") as decode:
        handover(prefill, decode, plain)
        answer = complete(decode, plain)
        assert answer["choices"][0]["text"] == expected(reference_llm, "".join(segments), 12)
        for opening in ("Notes:\n", "More notes:\n", "Read the notes.\n"):
            body = {**plain, "segments": [opening, docs[1], docs[0], "\nSay it."]}
            del body["blend_ratio"]
            handover(prefill, decode, body)
            answer = complete(decode, body)
            assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert answer["usage"]["prompt_tokens_details"].get("reused_segment_tokens", 0) > 0
        decode.llm.block_manager.check_integrity()
        prefill.llm.block_manager.check_integrity()
