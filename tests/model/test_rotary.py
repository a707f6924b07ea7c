"""Partial rotary (Phi-4-mini rotates 3/4 of each head) and longrope (Phi-3.5, Phi-4-mini) up
to its original context: logits and greedy answers equal transformers' own, through the C
layers and torch's operators alike, and a longrope model's context stops where transformers
would switch every position to its long factors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_reference import assert_greedy_matches, hf_greedy, make_prompts
from transformers import AutoModelForCausalLM

from kvcache import LLM, SamplingParams
from runner.backends.cpu.loader import load_cpu_kernels
from runner.model.layers import rotary_dim

HEAD_DIM = 16  # the tiny models' 64 hidden / 4 heads


def partial(make_tiny_model: Callable[..., Path]) -> Path:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return make_tiny_model("phi3", rope_parameters=rope)


def longrope(make_tiny_model: Callable[..., Path]) -> Path:
    rot = HEAD_DIM * 3 // 4
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(rot // 2)],
        "long_factor": [4.0 + i for i in range(rot // 2)],
        "original_max_position_embeddings": 64,
    }
    return make_tiny_model(
        "phi3",
        rope_parameters=rope,
        max_position_embeddings=256,
        original_max_position_embeddings=64,  # Phi3Config's own field wins over rope's
    )


@pytest.mark.parametrize("build", [partial, longrope], ids=["partial-rotary", "longrope"])
@pytest.mark.parametrize("options", [{}, {"cpu_kernels": False}], ids=["c-layers", "torch"])
def test_greedy_matches_hf(
    make_tiny_model: Callable[..., Path], build: Callable[..., Path], options: dict[str, Any]
) -> None:
    path = build(make_tiny_model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [p[:40] for p in make_prompts(hf.config.vocab_size, seed=21)]
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 10, None) for p in prompts]
    llm = LLM(str(path), **options)
    assert (llm.cpu_layers is not None) == (not options and load_cpu_kernels() is not None)
    assert_greedy_matches(llm, prompts, refs, alone=True)


def test_partial_rotary_passes_the_rest_of_each_head_through(
    make_tiny_model: Callable[..., Path],
) -> None:
    """Half of each head rotates; the logits are transformers' and not those of a model that
    rotates the whole head (which the tables would give if the split were ignored)."""
    path = partial(make_tiny_model)
    llm = LLM(str(path))
    assert rotary_dim(llm.hf_config, HEAD_DIM) == 8 and llm.model.rope_cos.shape[1] == 8
    prompt = make_prompts(320, seed=3)[1]
    llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    logits = llm.runner.run(llm.scheduler.schedule().scheduled)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


def test_a_longrope_context_stops_at_its_original_length(
    make_tiny_model: Callable[..., Path],
) -> None:
    llm = LLM(str(longrope(make_tiny_model)))
    assert llm.max_model_len == 64
    with pytest.raises(ValueError, match="64"):
        llm.generate([[5] * 70], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="longrope"):
        LLM(str(longrope(make_tiny_model)), max_model_len=128)


def test_rope_tables_are_sized_by_the_context_not_the_config(
    make_tiny_model: Callable[..., Path],
) -> None:
    """A config declaring 2^40 positions: with max_model_len=64 the engine loads and answers,
    its tables built with 64 rows (before, the load built the config's 2^40 rows and failed
    to allocate 8 TB; 2^24 rows took 4.5 GB). load_model alone still builds them all."""
    from runner.model.loader import load_model

    path = make_tiny_model("llama", max_position_embeddings=2**40)
    llm = LLM(str(path), max_model_len=64)
    assert (llm.model.rope_cos.shape[0], llm.model.rope_sin.shape[0]) == (64, 64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert load_model(str(path), max_positions=48).model.rope_cos.shape[0] == 48
    small = make_tiny_model("llama", max_position_embeddings=32)
    assert load_model(str(small), max_positions=48).model.rope_cos.shape[0] == 32
    with pytest.raises(ValueError, match="max_positions=0"):
        load_model(str(small), max_positions=0)
