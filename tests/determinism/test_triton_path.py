"""Deterministic mode's CUDA path, run on the CPU: attention_backend="triton" runs the same
batch-invariant Triton kernels (products, LM head, attention) in Triton's interpreter on CPU
tensors. A tiny Llama's needle answers bit for bit the same alone and in a batch with chunked
prompts and a cached system prompt, and beside speculative guesses; its greedy tokens are the
default engine's."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

from runner.engine.api.llm import LLM
from runner.model.batch_invariant import RowsLinear
from runner.sampling.params import SamplingParams
from tests.determinism.needle import Answer, answer_of

GREEDY = SamplingParams(max_tokens=5, temperature=0, logprobs=2)
SYSTEM = [3 + (i * 37) % 120 for i in range(21)]  # 21 tokens: a partial last block of 8


def prompt(key: int) -> list[int]:
    rng = random.Random(key)
    return SYSTEM + [rng.randrange(3, 120) for _ in range(rng.randrange(1, 9))]


def needle(model: Path, others: int, at: int, **options: Any) -> tuple[Answer, LLM]:
    llm = LLM(str(model), deterministic=True, attention_backend="triton", block_size=8, **options)
    prompts = [prompt(100 + i) for i in range(others)]
    prompts.insert(at, prompt(7))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return answer_of(outs[at]), llm


@pytest.fixture(scope="module")
def model(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama")


def test_the_triton_path_answers_the_same_in_a_batch(model: Path) -> None:
    alone, llm = needle(model, 0, 0, enable_prefix_caching=False)
    assert llm.runner.model.lm_head.__class__ is RowsLinear  # the kernels did run
    assert llm.attention.name == "triton-deterministic"
    batched, _ = needle(model, 4, 2, max_num_batched_tokens=13)
    assert batched == alone
    default = LLM(str(model), block_size=8).generate([{"prompt_token_ids": prompt(7)}], GREEDY)
    assert tuple(default[0].token_ids) == alone.token_ids


def test_the_triton_path_answers_the_same_beside_speculative_guesses(model: Path) -> None:
    """Beside 3 looping requests whose n-gram guesses are checked (several query rows of a
    sequence in one step), and their drafted tokens equal to one token a step."""
    alone, _ = needle(model, 0, 0, enable_prefix_caching=False)
    llm = LLM(str(model), deterministic=True, attention_backend="triton", speculative_tokens=3)
    loops = [{"prompt_token_ids": [5 + i, 9, 12, 40] * 5} for i in range(3)]
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    requests = [loops[0], {"prompt_token_ids": prompt(7)}, *loops[1:]]
    outs = llm.generate(requests, [plain, GREEDY, plain, plain])
    assert answer_of(outs[1]) == alone
    assert llm.stats()["num_accepted_tokens"] > 0
    one_by_one = LLM(str(model), deterministic=True, attention_backend="triton")
    expected = [o.token_ids for o in one_by_one.generate(loops, plain)]
    assert [outs[0].token_ids, outs[2].token_ids, outs[3].token_ids] == expected
