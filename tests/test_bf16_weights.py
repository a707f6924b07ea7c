"""`cpu_weight_dtype="bfloat16"`: the CPU engine runs the float32 model whose weight matrices are
rounded to bfloat16, with 2-byte panels in the C kernels.

The reference is transformers' own unbatched greedy `generate` on the same rounded weights in
float32: a bfloat16 weight widens to float32 exactly, so the engine must match it token for token,
as the float32 engine matches the float32 model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_equivalence import hf_greedy, make_prompts
from torch import nn
from transformers import AutoModelForCausalLM

from kvcache import LLM, SamplingParams
from runner.cpu_kernel_loader import load_cpu_kernels
from runner.cpu_linear import PackedLinear

needs_kernel = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)
BF16 = {"cpu_weight_dtype": "bfloat16"}
VARIANTS: dict[str, dict[str, Any]] = {
    "c-layers": BF16,
    "cache-off": {**BF16, "enable_prefix_caching": False},
    "small-chunks": {**BF16, "max_num_batched_tokens": 7},
    "no-cpu-kernels": {**BF16, "cpu_kernels": False},  # oneDNN on the rounded float32 weights
    "unpacked-weights": {**BF16, "prepack_weights": False},  # torch's products, same weights
}


def rounded_hf(path: Path) -> Any:
    """transformers' float32 model with every Linear and Embedding weight rounded to bf16."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.copy_(module.weight.to(torch.bfloat16))
    return hf


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def rounded_case(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[list[int]]]:
    path: Path = request.getfixturevalue(request.param)
    hf = rounded_hf(path)
    prompts = make_prompts(hf.config.vocab_size, seed=11)
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 10, None) for p in prompts]
    return path, prompts, refs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf_on_rounded_weights(rounded_case: Any, variant: str) -> None:
    path, prompts, refs = rounded_case
    llm = LLM(str(path), **VARIANTS[variant])
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs  # warm: cache hits
    if variant == "c-layers":
        alone = [llm.generate([p], params)[0].token_ids for p in prompts[:3]]
        assert alone == refs[:3]


@needs_kernel
def test_panels_hold_half_the_bytes_and_steps_run_in_c(tiny_llama_dir: Path) -> None:
    full = LLM(str(tiny_llama_dir))
    half = LLM(str(tiny_llama_dir), **BF16)

    def panels(llm: LLM) -> list[torch.Tensor]:
        return [m.packed for m in llm.model.modules() if isinstance(m, PackedLinear)]

    assert {p.dtype for p in panels(half)} == {torch.bfloat16}
    assert sum(p.nbytes for p in panels(half)) * 2 == sum(p.nbytes for p in panels(full))
    assert half.model.cpu_layers is not None  # whole steps in layers.c, on bf16 panels
    # Norms stay float32 and unrounded.
    norm = half.model.layers[0].input_layernorm.weight
    assert norm.dtype == torch.float32
    assert torch.equal(norm, full.model.layers[0].input_layernorm.weight)


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    in_features=st.sampled_from([1, 7, 64, 512]),  # 512: the padded-rows path
    out_features=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_bf16_panels_equal_float32_panels_of_the_rounded_weights(
    rows: int, in_features: int, out_features: int, seed: int
) -> None:
    """Bit for bit: the widening is exact and the order of the sums is the same."""
    kernel = load_cpu_kernels()
    assert kernel is not None
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    rounded = weight.to(torch.bfloat16).float()
    half = kernel.matmul(x, kernel.pack(weight, torch.bfloat16), None, out_features)
    full = kernel.matmul(x, kernel.pack(rounded), None, out_features)
    assert torch.equal(half, full)


def test_bad_weight_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_weight_dtype"):
        LLM("unused", cpu_weight_dtype="float8")


@pytest.mark.parametrize("options", [BF16, {**BF16, "cpu_kernels": False}], ids=["c", "onednn"])
def test_logits_are_the_rounded_models(tiny_qwen3_dir: Path, options: dict[str, Any]) -> None:
    """Tighter than greedy tokens: the first step's logits equal the rounded model's within
    float-order noise, and sit measurably away from the unrounded model's."""
    prompt = make_prompts(320, seed=4)[2]
    llm = LLM(str(tiny_qwen3_dir), **options)
    llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    logits = llm.runner.run(llm.scheduler.schedule().scheduled)[0]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        rounded = rounded_hf(tiny_qwen3_dir)(ids).logits[0, -1]
        exact = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)(ids)
    torch.testing.assert_close(logits, rounded, atol=1e-4, rtol=1e-4)
    assert (logits - exact.logits[0, -1]).abs().max() > 1e-2
