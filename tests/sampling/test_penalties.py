"""Repetition, presence and frequency penalties: the engine's greedy output equals transformers'
greedy `generate` with `repetition_penalty`, and a plain per-token reference for the other two,
in a batch of mixed settings, with the cache on and off and under preemption."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_reference import hf_greedy, make_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from kvcache import LLM, SamplingParams
from runner.sampling.penalties import TokenHistory, penalize

VARIANTS: dict[str, dict[str, Any]] = {
    "cache-on": {},
    "cache-off": {"enable_prefix_caching": False},
    "tiny-pool": {"num_kv_blocks": 40, "block_size": 4},
    "no-cpu-kernels": {"cpu_kernels": False},
}
MAX_NEW = 12


def reference_logits(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """One row's penalties, token by token, as the definitions read."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        value = float(out[token])
        rep = params.repetition_penalty
        out[token] = value / rep if value > 0 else value * rep
    for token in set(output):
        out[token] = out[token] - params.frequency_penalty * output.count(token)
        out[token] = out[token] - params.presence_penalty
    return out


def reference_greedy(hf: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding by whole forward passes of the transformers model, penalized by
    reference_logits."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
            output.append(int(torch.argmax(reference_logits(logits, prompt, output, params))))
    return output


PARAM_CYCLE = [
    SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, repetition_penalty=1.5),
    SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, frequency_penalty=0.7),
    SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
    SamplingParams(
        max_tokens=MAX_NEW,
        temperature=0,
        ignore_eos=True,
        repetition_penalty=0.8,  # below 1: seen tokens become likelier
        presence_penalty=-0.5,
        frequency_penalty=0.4,
    ),
]


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen3_dir"])
def penalty_case(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[list[int]]]:
    path: Path = request.getfixturevalue(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size, seed=7)
    params = [PARAM_CYCLE[i % len(PARAM_CYCLE)] for i in range(len(prompts))]
    refs = [reference_greedy(hf, p, sp) for p, sp in zip(prompts, params, strict=True)]
    return path, prompts, refs


def test_repetition_penalty_matches_transformers(tiny_llama_dir: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size, seed=3)
    llm = LLM(str(tiny_llama_dir))
    for penalty in (1.3, 2.0):
        params = SamplingParams(
            max_tokens=MAX_NEW, temperature=0, ignore_eos=True, repetition_penalty=penalty
        )
        outs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == hf_greedy(hf, prompt, MAX_NEW, None, repetition_penalty=penalty)
        # The penalty must matter somewhere, or this test could not fail.
        plain = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        )
        assert any(o.token_ids != b.token_ids for o, b in zip(outs, plain, strict=True))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixed_penalties_in_one_batch_match_reference(penalty_case: Any, variant: str) -> None:
    path, prompts, refs = penalty_case
    llm = LLM(str(path), **VARIANTS[variant])
    params = [PARAM_CYCLE[i % len(PARAM_CYCLE)] for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs


def test_penalized_sampling_is_reproducible_in_any_batch(tiny_llama_dir: Path) -> None:
    params = SamplingParams(
        max_tokens=10, temperature=0.9, seed=5, frequency_penalty=1.0, repetition_penalty=1.2
    )
    llm = LLM(str(tiny_llama_dir))
    alone = llm.generate([[5, 6, 7, 8]], params)[0].token_ids
    others = [[9, 10, 11], [12, 13, 14, 15, 16]]
    batched = llm.generate([others[0], [5, 6, 7, 8], others[1]], [SamplingParams(), params, params])
    assert batched[1].token_ids == alone


def test_penalties_leave_the_input_untouched() -> None:
    logits = torch.randn(3, 50)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(), SamplingParams()]
    histories = [TokenHistory([1, 2]), None, None]
    out = penalize(logits, params, histories, [[5], [], []])
    assert torch.equal(logits, before)
    assert not torch.equal(out, before)
    assert torch.equal(out[1:], before[1:])
    assert penalize(logits, [SamplingParams()] * 3, [None] * 3, [[2]] * 3) is logits


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 5),
    repetition=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
)
def test_penalize_equals_the_definition(
    seed: int, rows: int, repetition: float, presence: float, frequency: float
) -> None:
    rng = random.Random(seed)
    vocab = 40
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]
    params = [
        SamplingParams(
            repetition_penalty=repetition if rng.random() < 0.7 else 1.0,
            presence_penalty=presence if rng.random() < 0.7 else 0.0,
            frequency_penalty=frequency if rng.random() < 0.7 else 0.0,
        )
        for _ in range(rows)
    ]
    histories = [TokenHistory(p) for p in prompts]
    # Outputs taken in over several steps, as the engine's are.
    for i in range(rows):
        histories[i].output(outputs[i][: len(outputs[i]) // 2])
    out = penalize(logits, params, histories, outputs)
    for i in range(rows):
        expected = reference_logits(logits[i], prompts[i], outputs[i], params[i])
        torch.testing.assert_close(out[i], expected, rtol=0, atol=1e-5)
        assert histories[i].output(outputs[i]).tolist() == outputs[i]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("repetition_penalty", float("nan"), "repetition_penalty must be finite"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
        ("frequency_penalty", "1", "frequency_penalty must be a number"),
    ],
)
def test_bad_penalties_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})
