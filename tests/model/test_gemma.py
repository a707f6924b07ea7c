"""Gemma 3's departures from Llama, checked piece by piece against transformers' own modules in
bfloat16, where a rounding in another place shows (greedy equality in float32, windows and all:
tests/engine/test_engine_equivalence.py's tiny_gemma3_dir)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcache import LLM, SamplingParams
from runner.backends.cpu.loader import load_cpu_kernels
from runner.model.loader import load_model
from tests.conftest import load_hf_reference


@pytest.fixture(scope="module")
def bf16_pair(make_tiny_model: Callable[..., Path]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ours, transformers') tiny Gemma 3 in bfloat16, on the same weights."""
    path = make_tiny_model("gemma3")
    ours = load_model(str(path), dtype=torch.bfloat16).model
    hf = load_hf_reference(path, torch.bfloat16)
    return ours, hf


def test_norms_scale_by_one_plus_weight_in_float32(bf16_pair: tuple) -> None:
    """Every norm (the four of a layer, q/k, the final one) gives exactly transformers'
    numbers: 1 + weight added in float32, the product rounded once."""
    ours, hf = bf16_pair
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    names = [
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ]
    with torch.no_grad():
        for layer, theirs_layer in zip(ours.layers, hf.model.layers, strict=True):
            for name in names:
                assert torch.equal(getattr(layer, name)(x), getattr(theirs_layer, name)(x))
            heads = x[:, :16]
            assert torch.equal(layer.self_attn.q_norm(heads), theirs_layer.self_attn.q_norm(heads))
        assert torch.equal(ours.norm(x), hf.model.norm(x))


def test_embeddings_scale_by_sqrt_hidden_rounded_to_the_dtype(bf16_pair: tuple) -> None:
    ours, hf = bf16_pair
    ids = torch.arange(3, 40)
    theirs = hf.model.embed_tokens(ids[None])[0]
    mine = ours.embed_tokens(ids) * torch.tensor(ours.embedding_multiplier, dtype=torch.bfloat16)
    assert ours.round_embedding_multiplier
    assert torch.equal(mine, theirs)


def test_layers_read_their_kind_from_the_config(make_tiny_model: Callable[..., Path]) -> None:
    llm = LLM(str(make_tiny_model("gemma3")))
    model = llm.model
    attns = [layer.self_attn for layer in model.layers]
    assert [a.sliding_window for a in attns] == [16, None]
    assert [a.rope_type for a in attns] == ["sliding_attention", None]  # global: the default
    assert attns[0].scale == pytest.approx(24**-0.5)  # query_pre_attn_scalar, not head_dim
    assert [layer.mlp.activation for layer in model.layers] == ["gelu_pytorch_tanh"] * 2
    # The C layers take Gemma 3's sandwich layout too (where they build: AVX-512).
    assert (llm.cpu_layers is not None) == (load_cpu_kernels() is not None)
    # The local layers' table rotates slower than the global one at every position past 0.
    assert set(model.rope_by_type) == {"sliding_attention"}  # the global table is rope_cos
    local_cos, _ = model.rope_by_type["sliding_attention"]
    assert not torch.equal(local_cos[1:], model.rope_cos[1:])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_gemma2_logits_are_capped_as_transformers_caps_them(
    tiny_gemma2_dir: Path, backend: str
) -> None:
    """Gemma 2 caps its attention scores (5 here: every layer's scores bite) and its logits (8):
    the first step's logits of a prompt longer than the window equal transformers' within 1e-4,
    through the torch path and the CPU backend (the C layers where the kernels built)."""
    prompt = [3 + (i * 37) % 300 for i in range(40)]
    hf = load_hf_reference(tiny_gemma2_dir)
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt])).logits[0, -1]
    assert theirs.abs().max() < 8.0 and theirs.abs().max() > 4.0  # the cap shapes them
    llm = LLM(str(tiny_gemma2_dir), attention_backend=backend)
    llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    ours = llm.runner.run(llm.scheduler.schedule().scheduled)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
