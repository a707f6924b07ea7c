"""Deterministic mode beside the features its first tests left out: a prefix read back from the
host tier and from a real Redis tier, speculative decoding (others' guesses checked in the same
step as the needle, and the needle's own guesses), and a prefill/decode handover between real
prefill and decode workers. Each compares the needle bit for bit with the needle alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from runner.backends.cpu.loader import load_cpu_kernels
from runner.engine.api.llm import LLM
from runner.sampling.params import SamplingParams
from tests.determinism.needle import MODEL_SHAPE, NEEDLE, Answer, answer_of, run_needle
from tests.pd.conftest import start_worker, stop_worker
from tests.redis_server import RedisServer, redis_server  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="deterministic mode needs the CPU's C kernels (AVX-512)"
)

GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=3)


@pytest.fixture(scope="module")
def model(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama", **MODEL_SHAPE)


@pytest.fixture(scope="module")
def reference(model: Path) -> Answer:
    """The needle by itself, cache off, its prompt in one step."""
    options: dict[str, Any] = {"block_size": 16, "enable_prefix_caching": False}
    answer, _ = run_needle(model, 0, 0, GREEDY, deterministic=True, **options)
    return answer


def read_back(model: Path, reference: Answer, **tier: Any) -> None:
    """The needle in a batch written to `tier`, then alone in a fresh engine on the same tier
    whose prefix comes from it: both bitwise equal to the needle alone."""
    got, writer = run_needle(model, 20, 11, GREEDY, deterministic=True, block_size=16, **tier)
    assert got == reference
    writer.flush_cache_tiers()
    return_path = LLM(str(model), deterministic=True, block_size=16, **tier)
    out = return_path.generate([{"prompt_token_ids": NEEDLE}], GREEDY)[0]
    assert out.num_cached_tokens >= 64  # the system prompt's full blocks, read from the tier
    assert answer_of(out) == reference


def test_blocks_from_the_host_tier_answer_the_same(model: Path, reference: Answer) -> None:
    """A pool of 24 blocks: the needle's system prompt, written to the host tier by a batch,
    is evicted by unrelated prompts, and the needle's prefix comes back from the host tier."""
    tier: dict[str, Any] = {"host_cache_bytes": 64 << 20, "num_kv_blocks": 24, "block_size": 16}
    llm = LLM(str(model), deterministic=True, max_num_seqs=8, **tier)
    others = [{"prompt_token_ids": NEEDLE[:70] + [5 + i] * (i + 3)} for i in range(6)]
    llm.generate(others, GREEDY)
    rng = random.Random(3)
    unrelated = [
        [rng.randrange(3, MODEL_SHAPE["vocab_size"]) for _ in range(150)] for _ in range(6)
    ]
    llm.generate([{"prompt_token_ids": p} for p in unrelated], GREEDY)
    out = llm.generate([{"prompt_token_ids": NEEDLE}], GREEDY)[0]
    assert llm.stats()["cache_tiers"]["tiers"]["host"]["hit_blocks"] >= 4
    assert out.num_cached_tokens >= 64
    assert answer_of(out) == reference


def test_blocks_from_a_redis_tier_answer_the_same(
    model: Path,
    reference: Answer,
    redis_server: RedisServer,  # noqa: F811 - the imported fixture
) -> None:
    read_back(model, reference, remote_cache_url=redis_server.url)


def looping(key: int) -> list[int]:
    """A prompt that repeats a short unit, so the n-gram guesser finds guesses in it."""
    rng = random.Random(key)
    unit = [rng.randrange(3, MODEL_SHAPE["vocab_size"]) for _ in range(rng.randrange(3, 9))]
    return unit * 6


def test_speculative_decoding_answers_the_same(model: Path, reference: Answer) -> None:
    """The needle (its log-probabilities asked for, so never drafted itself) beside 12 looping
    requests whose guesses are checked in the same steps; and a looping needle, drafted, whose
    tokens equal its tokens without speculation."""
    llm = LLM(str(model), deterministic=True, speculative_tokens=4, max_num_seqs=32)
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    loops = [{"prompt_token_ids": looping(i)} for i in range(12)]
    requests = [*loops[:6], {"prompt_token_ids": NEEDLE}, *loops[6:]]
    outs = llm.generate(requests, [plain] * 6 + [GREEDY] + [plain] * 6)
    assert answer_of(outs[6]) == reference
    assert llm.stats()["num_accepted_tokens"] > 0  # guesses were checked beside it
    # Drafted: its tokens are the same as one token a step, in a batch and alone.
    alone = LLM(str(model), deterministic=True, enable_prefix_caching=False)
    expected = [o.token_ids for o in alone.generate(loops, plain)]
    assert [o.token_ids for o in outs[:6] + outs[7:]] == expected


def test_a_prefill_decode_handover_answers_the_same(tiny_llama_tok_dir: Path) -> None:
    """A prompt prefilled by a real prefill worker, its blocks handed over (ZeroMQ) to a real
    decode worker, which answers: its tokens and their log-probabilities equal the colocated
    engine's alone, bit for bit (JSON floats round-trip exactly)."""
    prompt = "Deterministic inference hands the same bits over from prefill to decode. " * 2
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2}
    colocated = LLM(str(tiny_llama_tok_dir), deterministic=True, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    (alone,) = colocated.generate([prompt], params)
    want = [
        position[token].logprob
        for token, position in zip(alone.token_ids, alone.logprobs or [], strict=True)
    ]
    prefill = start_worker(tiny_llama_tok_dir, "prefill", deterministic=True)
    try:
        decode = start_worker(tiny_llama_tok_dir, "decode", deterministic=True)
        try:
            first = httpx.post(
                f"{prefill.url}/kvcache/prefill/v1/completions", json=body, timeout=60
            )
            assert first.status_code == 200, first.text
            handed = first.json()["kv_transfer_params"]
            pulled = httpx.post(f"{decode.url}/kvcache/pull", json=handed, timeout=60)
            assert pulled.status_code == 200 and pulled.json()["blocks"] >= 4, pulled.text
            answer = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            choice = answer.json()["choices"][0]
            cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == pulled.json()["blocks"] * decode.llm.config.block_size
        finally:
            stop_worker(decode)
    finally:
        stop_worker(prefill)
    assert choice["text"] == alone.text
    got = choice["logprobs"]["token_logprobs"]
    assert [x.hex() for x in got] == [x.hex() for x in want]
