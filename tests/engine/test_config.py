"""EngineConfig: the per-device default of the token budget, and bad values refused by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcache import LLM, SamplingParams
from runner.engine.config import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, EngineConfig


def test_the_token_budget_defaults_per_device() -> None:
    assert EngineConfig().token_budget == CPU_TOKEN_BUDGET == 512
    assert EngineConfig(device=torch.device("cpu")).token_budget == CPU_TOKEN_BUDGET
    assert EngineConfig(device="cuda:0").token_budget == GPU_TOKEN_BUDGET == 2048
    assert EngineConfig(max_num_batched_tokens=7, device="cuda").token_budget == 7


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_batched_tokens", 0),
        ("kv_cache_dtype", "int4"),
        ("block_size", 3),
        ("dtype", "float8"),
        ("dtype", "float64"),
        ("device", "gpu"),
        ("device", "cuda:x"),
        ("max_num_seqs", 0),
        ("gpu_memory_utilization", 1.5),
    ],
)
def test_bad_values_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_auto_dtype_is_the_default() -> None:
    assert EngineConfig(dtype="auto").dtype is None is EngineConfig().dtype
    assert EngineConfig(dtype="bfloat16").dtype == "bfloat16"


def test_the_default_budget_reaches_the_scheduler(
    make_tiny_model: Callable[..., Path],
) -> None:
    """A 600-token prompt on the CPU is prefilled in chunks of 512 by default, in one step
    when the budget says so; the answer is the same."""
    path = make_tiny_model("llama", max_position_embeddings=1024)
    prompt = [3 + i % 200 for i in range(600)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    answers, chunks = [], []
    for options in ({}, {"max_num_batched_tokens": 1024}):
        llm = LLM(str(path), **options)
        answers.append(llm.generate([prompt], params)[0].token_ids)
        chunks.append(
            [s["num_prefill_tokens"] for s in llm.recorder.steps if s["num_prefill_tokens"]]
        )
    assert chunks == [[512, 88], [600]]
    assert answers[0] == answers[1]


def test_max_model_len_bounds_requests_and_the_pool(
    make_tiny_model: Callable[..., Path],
) -> None:
    """A shorter context than the model's: a longer prompt is refused naming it, an answer stops
    there ("length"), the default pool and the RoPE tables shrink to it, and the answers up to
    there are the full-context engine's."""
    path = make_tiny_model("llama", max_position_embeddings=512)
    full, short = LLM(str(path)), LLM(str(path), max_model_len=48)
    assert (full.max_model_len, short.max_model_len) == (512, 48)
    assert short.block_manager.num_blocks * 512 == full.block_manager.num_blocks * 48
    assert (full.model.rope_cos.shape[0], short.model.rope_sin.shape[0]) == (512, 48)
    with pytest.raises(ValueError, match="48"):
        short.generate([[5] * 48], SamplingParams(max_tokens=1))
    prompt = [3 + i % 200 for i in range(40)]
    out = short.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert (len(out[0].token_ids), out[0].finish_reason) == (8, "length")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert full.generate([prompt], params)[0].token_ids == out[0].token_ids
    with pytest.raises(ValueError, match="longer than the model's context"):
        LLM(str(path), max_model_len=513)


def test_an_empty_cache_key_and_a_remote_password_are_not_silent() -> None:
    """cache_key="" (an unset $SECRET) is refused, not unsigned; a bad remote URL's error
    and the config's repr never show its password."""
    with pytest.raises(ValueError, match="cache_key is empty"):
        EngineConfig(cache_key="")
    with pytest.raises(ValueError, match="remote_cache_url") as err:
        EngineConfig(remote_cache_url="http://:hunter2@127.0.0.1:1")
    assert "hunter2" not in str(err.value)
    assert "hunter2" not in repr(EngineConfig(remote_cache_url="redis://:hunter2@127.0.0.1:1/0"))


def test_the_eviction_policy_is_chosen_by_name(tiny_llama_dir: Path) -> None:
    """EngineConfig.eviction_policy reaches the block manager the engine builds; a bad name is
    refused naming it and the choices, in the config and on the command line."""
    from click.testing import CliRunner

    from cli import main

    with pytest.raises(ValueError, match=r"one of lfu, lru, priority, got 'fifo'"):
        EngineConfig(eviction_policy="fifo")
    assert LLM(str(tiny_llama_dir)).block_manager.eviction_policy == "lru"
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    answers = []
    for name in ("lfu", "priority"):
        llm = LLM(str(tiny_llama_dir), eviction_policy=name)
        assert llm.block_manager.eviction_policy == name
        answers.append(llm.generate([[5, 6, 7] * 10] * 2, params)[1])
        assert answers[-1].num_cached_tokens > 0  # the second prompt hit the first's blocks
    assert answers[0].token_ids == answers[1].token_ids
    bad = CliRunner().invoke(main, ["generate", "in.jsonl", "--eviction-policy", "fifo"])
    assert bad.exit_code == 2 and "'fifo' is not one of 'lfu', 'lru', 'priority'" in bad.output


def test_priority_keeps_an_urgent_prefix_cached(tiny_llama_dir: Path) -> None:
    """eviction_policy="priority" with vLLM's `generate(..., priority=...)`, a lower value the
    more urgent request (as priority scheduling admits it first): when the pool runs short, the
    blocks of the prompt of priority 5 go and those of priority 0 stay (under "lru" the older,
    urgent prompt's would go first)."""
    from kvcache import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    kept, dropped = [5 + i % 7 for i in range(64)], [9 + i % 5 for i in range(64)]
    filler = [[20 + j, 30 + i % 11] * 16 for j, i in enumerate(range(3))]
    for policy, survivor, gone in (("priority", kept, dropped), ("lru", dropped, kept)):
        llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=12, eviction_policy=policy)
        llm.generate([kept], params, priority=[0])
        llm.generate([dropped], params, priority=[5])
        llm.generate(filler, params, priority=[1, 1, 1])  # needs blocks: one prompt's must go
        assert llm.cached_prefix(survivor, None).blocks == 3, policy  # its full blocks, all
        assert llm.cached_prefix(gone, None).blocks < 3, policy
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate([kept, dropped], params, priority=[1])
