"""The needle harness of the determinism tests: one request ("the needle") run alone and at
some position of a batch of others that share its system prompt, and what it answered, bit for
bit (its token ids, and each position's log-probabilities as float.hex strings, so -0.0 and
0.0 differ and a NaN equals itself)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.engine.api.llm import LLM
from runner.sampling.params import SamplingParams

VOCAB = 2048
# A model a little wider than the suite's tiny ones, so that a product's or a norm's sum has
# enough terms for its order to show in the last bits: 256 wide, 8 query heads over 2 KV heads.
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
}
# Not a multiple of 8 or 16: the prompt's last block is a partial one (a cached tail).
SYSTEM = [3 + (i * 37) % (VOCAB - 3) for i in range(70)]


def prompt(key: int) -> list[int]:
    """The system prompt, then a question of 1-39 tokens drawn from `key`."""
    rng = random.Random(key)
    return SYSTEM + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))]


NEEDLE = prompt(7)


@dataclass(frozen=True)
class Answer:
    """What a request answered, comparable bit for bit."""

    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[tuple[int, str], ...], ...]  # per position: (token id, float.hex)


def answer_of(output: Any) -> Answer:
    """The Answer of one RequestOutput's first sample."""
    sample = output.outputs[0]
    positions = tuple(
        tuple(sorted((token, entry.logprob.hex()) for token, entry in position.items()))
        for position in (sample.logprobs or [])
    )
    return Answer(tuple(sample.token_ids), positions)


def run_needle(
    model: Path,
    others: int,
    at: int,
    params: SamplingParams,
    *,
    seed: int = 0,
    **options: Any,
) -> tuple[Answer, LLM]:
    """The needle at position `at` among `others` other requests (prompt(100 + i)), in one
    `generate` of a fresh engine built with `options`; its Answer and the engine."""
    llm = LLM(str(model), seed=seed, max_num_seqs=128, **options)
    prompts = [prompt(100 + i) for i in range(others)]
    prompts.insert(at, NEEDLE)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return answer_of(outputs[at]), llm
