"""deterministic=True (docs/DETERMINISM.md): a "needle" request answers bit for bit the same,
token ids and log-probabilities, alone and at any position of a batch of 1-64 other requests
sharing its system prompt, whatever the token budget (so however its prompt is chunked), with
the prefix cache on or off, through preemption and recompute, and from a disk tier; sampled
without a seed too. The default mode's answers do differ in such batches (the negative
controls), so each comparison can fail."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runner.backends.cpu.loader import load_cpu_kernels
from runner.engine.api.llm import LLM
from runner.sampling.params import SamplingParams
from tests.determinism.needle import MODEL_SHAPE, NEEDLE, Answer, answer_of, run_needle

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="deterministic mode needs the CPU's C kernels (AVX-512)"
)

GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, logprobs=3)  # no seed: the engine's


@pytest.fixture(scope="module")
def model(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama", **MODEL_SHAPE)


def alone(model: Path, block_size: int, params: SamplingParams = GREEDY) -> Answer:
    """The needle by itself, cache off, its prompt in one step."""
    options: dict[str, Any] = {"block_size": block_size, "enable_prefix_caching": False}
    answer, _ = run_needle(model, 0, 0, params, deterministic=True, **options)
    return answer


def random_case(seed: int) -> tuple[int, int, dict[str, Any]]:
    """(others, the needle's position, engine options): a batch of 1-64 others, the needle
    anywhere in it, a token budget from 8 to 600 (prompts cut into chunks anywhere), the cache
    on or off."""
    rng = random.Random(seed)
    others = rng.randint(1, 64)
    options = {
        "max_num_batched_tokens": rng.randint(8, 600),
        "enable_prefix_caching": rng.random() < 0.7,
    }
    return others, rng.randint(0, others), options


def check_cases(model: Path, seeds: range, block_size: int) -> None:
    reference = alone(model, block_size)
    assert len(reference.token_ids) == 12 and len(reference.logprobs) == 12
    for seed in seeds:
        others, at, options = random_case(seed)
        got, _ = run_needle(
            model, others, at, GREEDY, deterministic=True, block_size=block_size, **options
        )
        assert got == reference, f"case {seed}: {others} others, needle at {at}, {options}"


@pytest.mark.parametrize("block_size", [8, 16])
def test_the_needle_answers_the_same_in_random_batches(model: Path, block_size: int) -> None:
    check_cases(model, range(1000 * block_size, 1000 * block_size + 3), block_size)


@pytest.mark.slow
def test_the_needle_answers_the_same_in_many_random_batches(model: Path) -> None:
    check_cases(model, range(40), 16)


def test_a_cached_prompt_and_one_chunked_small_answer_the_same(model: Path) -> None:
    """The needle's prompt cached but for its last token (whose row then goes alone, as a
    decode's does), and its prompt in chunks of 5 tokens beside the others' decodes."""
    reference = alone(model, 8)
    llm = LLM(str(model), deterministic=True, block_size=8)
    first = llm.generate([{"prompt_token_ids": NEEDLE}], GREEDY)[0]
    again = llm.generate([{"prompt_token_ids": NEEDLE}], GREEDY)[0]
    assert again.num_cached_tokens == len(NEEDLE) - 1
    chunked, _ = run_needle(
        model, 9, 4, GREEDY, deterministic=True, block_size=8, max_num_batched_tokens=5
    )
    assert [answer_of(first), answer_of(again), chunked] == [reference] * 3
    assert alone(model, 16) == reference  # a row's keys go 16 at a time whatever the blocks


def test_a_sliding_window_model_answers_the_same(make_tiny_model: Callable[..., Path]) -> None:
    """Mistral's window of 20 keys: a prompt's tile of rows starts reading at its first row's
    window, which its later rows mask; where that start falls must not change their sums."""
    windowed = make_tiny_model("mistral", **MODEL_SHAPE, sliding_window=20)
    reference = alone(windowed, 8)
    for others, at, budget in ((9, 3, 13), (30, 30, 40), (5, 0, 7)):
        got, _ = run_needle(
            windowed,
            others,
            at,
            GREEDY,
            deterministic=True,
            block_size=8,
            max_num_batched_tokens=budget,
        )
        assert got == reference, f"{others} others, needle at {at}, budget {budget}"


def test_a_float16_kv_cache_answers_the_same(model: Path) -> None:
    """Keys and values stored as float16 (decodes then attend as one-token prompts)."""
    half: dict[str, Any] = {"kv_cache_dtype": "float16", "deterministic": True}
    reference, _ = run_needle(model, 0, 0, GREEDY, enable_prefix_caching=False, **half)
    got, _ = run_needle(model, 20, 13, GREEDY, max_num_batched_tokens=48, **half)
    assert got == reference


def test_preemption_and_recompute_answer_the_same(model: Path) -> None:
    """A pool too small for the batch: sequences are preempted and recomputed, decoded
    positions then computed again as prompt rows."""
    reference = alone(model, 8)
    for cache in (True, False):
        got, llm = run_needle(
            model,
            30,
            30,
            GREEDY,
            deterministic=True,
            block_size=8,
            num_kv_blocks=48,
            enable_prefix_caching=cache,
        )
        assert llm.scheduler.num_preemptions > 0
        assert got == reference, f"prefix cache {cache}"


def test_blocks_from_a_disk_tier_answer_the_same(model: Path, tmp_path: Path) -> None:
    reference = alone(model, 16)
    disk: dict[str, Any] = {"disk_cache_dir": str(tmp_path / "disk"), "block_size": 16}
    got, writer = run_needle(model, 20, 11, GREEDY, deterministic=True, **disk)
    writer.flush_cache_tiers()
    assert got == reference
    fresh = LLM(str(model), deterministic=True, **disk)  # a restart: only the disk is shared
    out = fresh.generate([{"prompt_token_ids": NEEDLE}], GREEDY)[0]
    assert out.num_cached_tokens >= 64  # its system prompt's full blocks, read from disk
    assert answer_of(out) == reference


def test_a_sampled_request_without_a_seed_answers_the_same(model: Path) -> None:
    reference = alone(model, 16, SAMPLED)
    got, _ = run_needle(model, 12, 9, SAMPLED, deterministic=True, max_num_batched_tokens=64)
    assert got == reference
    seeded = SamplingParams(max_tokens=12, temperature=1.0, logprobs=3, seed=5)
    assert alone(model, 16, seeded) != reference  # the prompt's seed, not a fixed one
    other_engine_seed, _ = run_needle(model, 0, 0, SAMPLED, seed=1, deterministic=True)
    assert other_engine_seed.token_ids != reference.token_ids  # the engine's seed counts


def test_the_default_mode_differs_in_these_batches(model: Path) -> None:
    """The negative controls: without the mode the needle's log-probabilities change with its
    batch (16 decodes score their shared system prompt together, a cached prompt's last row
    goes through the decode kernel, not the prefill one), and its unseeded samples with the
    requests before it."""
    plain, _ = run_needle(model, 0, 0, GREEDY, block_size=16, enable_prefix_caching=False)
    batched, _ = run_needle(model, 15, 6, GREEDY, block_size=16)
    assert batched.logprobs != plain.logprobs
    sampled, _ = run_needle(model, 0, 0, SAMPLED)
    sampled_late, _ = run_needle(model, 12, 9, SAMPLED, max_num_batched_tokens=64)
    assert sampled_late.token_ids != sampled.token_ids


def test_the_mode_is_refused_where_it_cannot_hold(model: Path) -> None:
    refusals: tuple[tuple[dict[str, Any], str], ...] = (
        ({"attention_backend": "triton", "cpu_weight_dtype": "int8-dot"}, "cpu_weight_dtype"),
        ({"attention_backend": "torch"}, "attention_backend"),
        ({"cpu_weight_dtype": "int8-dot"}, "cpu_weight_dtype"),
        ({"dtype": "bfloat16"}, "dtype"),
    )
    for options, named in refusals:
        with pytest.raises(ValueError, match=named):
            LLM(str(model), deterministic=True, **options)


def test_the_command_line_takes_the_flag_and_names_it_when_it_cannot_hold(
    model: Path, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from cli import main

    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 3}\n')
    args = ["generate", str(source), "--model", str(model), "--deterministic"]
    bad = ["-o", str(tmp_path / "x.jsonl"), "--cpu-weight-dtype", "int8-dot"]
    refused = CliRunner().invoke(main, [*args, *bad])
    assert refused.exit_code == 2, refused.output
    assert "--deterministic" in refused.output and "cpu_weight_dtype" in refused.output
    ran = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "out.jsonl")])
    assert ran.exit_code == 0, ran.output
    assert '"token_ids"' in (tmp_path / "out.jsonl").read_text()
