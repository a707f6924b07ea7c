"""`cpu_weight_dtype="bfloat16"` / `"int8"`: the CPU engine runs the float32 model whose weight
matrices are rounded to bfloat16, or quantized to int8 with a scale per group of 32, with 2- or
1-byte panels in the C kernels.

The reference is transformers' own unbatched greedy `generate` on the same rounded weights in
float32: the kernels widen each stored weight to exactly that float32 value, so the engine must
match it token for token, as the float32 engine matches the float32 model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_reference import assert_greedy_matches, hf_references, make_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import AutoModelForCausalLM

from kvcache import LLM, SamplingParams
from runner.backends.cpu.linear import PackedLinear
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.cpu.quant import INT8_GROUP, dequantize_int8, quantize_int8
from tests.conftest import load_hf_reference

needs_kernel = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)
BF16 = {"cpu_weight_dtype": "bfloat16"}
VARIANTS: dict[str, dict[str, Any]] = {
    "c-layers": {},
    "cache-off": {"enable_prefix_caching": False},
    "small-chunks": {"max_num_batched_tokens": 7},
    "no-cpu-kernels": {"cpu_kernels": False},  # oneDNN on the rounded float32 weights
    "unpacked-weights": {"prepack_weights": False},  # torch's products, same weights
}


def rounded_hf(path: Path, dtype: str = "bfloat16") -> Any:
    """transformers' float32 model with every Linear and Embedding weight rounded to `dtype`."""
    hf = load_hf_reference(path)
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                w = module.weight
                w.copy_(
                    w.to(torch.bfloat16)
                    if dtype == "bfloat16"
                    else dequantize_int8(quantize_int8(w))
                )
    return hf


@pytest.fixture(
    scope="module",
    params=[
        (arch, dtype)
        for dtype in ("bfloat16", "int8")
        for arch in ("tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir")
    ],
    ids=lambda p: f"{p[0].removeprefix('tiny_').removesuffix('_dir')}-{p[1]}",
)
def rounded_case(
    request: pytest.FixtureRequest,
) -> tuple[Path, str, list[list[int]], list[list[int]]]:
    arch, dtype = request.param
    path: Path = request.getfixturevalue(arch)
    hf = rounded_hf(path, dtype)
    prompts, refs = hf_references(hf, seed=11)
    return path, dtype, prompts, refs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf_on_rounded_weights(rounded_case: Any, variant: str) -> None:
    path, dtype, prompts, refs = rounded_case
    llm = LLM(str(path), cpu_weight_dtype=dtype, **VARIANTS[variant])
    assert_greedy_matches(llm, prompts, refs, alone=variant == "c-layers")


@needs_kernel
def test_panels_hold_fewer_bytes_and_steps_run_in_c(tiny_llama_dir: Path) -> None:
    full = LLM(str(tiny_llama_dir))
    half = LLM(str(tiny_llama_dir), **BF16)
    quarter = LLM(str(tiny_llama_dir), cpu_weight_dtype="int8")

    def panels(llm: LLM) -> list[torch.Tensor]:
        return [m.packed for m in llm.model.modules() if isinstance(m, PackedLinear)]

    assert {p.dtype for p in panels(half)} == {torch.bfloat16}
    assert {p.dtype for p in panels(quarter)} == {torch.int8}
    full_bytes = sum(p.nbytes for p in panels(full))
    assert sum(p.nbytes for p in panels(half)) * 2 == full_bytes
    # int8: a byte a weight plus 4 bytes of scale per 32 weights
    assert sum(p.nbytes for p in panels(quarter)) == full_bytes // 4 * (1 + 4 / INT8_GROUP)
    assert half.cpu_layers is not None  # whole steps in layers.c, on bf16 panels
    assert quarter.cpu_layers is not None
    # Norms stay float32 and unrounded.
    norm = half.model.layers[0].input_layernorm.weight
    assert norm.dtype == torch.float32
    assert torch.equal(norm, full.model.layers[0].input_layernorm.weight)


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    in_features=st.sampled_from([1, 7, 33, 64, 512]),  # 33: a partial int8 group; 512: padded rows
    out_features=st.integers(1, 90),  # up to 6 panels: groups of 4 side by side and a rest
    seed=st.integers(0, 2**16),
)
def test_rounded_panels_equal_float32_panels_of_the_rounded_weights(
    rows: int, in_features: int, out_features: int, seed: int
) -> None:
    """Bit for bit: the widening is exact (bf16) or the dequantizing rounding itself (int8),
    and the order of the sums is the same (a few rows run several panels side by side)."""
    kernel = load_cpu_kernels()
    assert kernel is not None
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    rounded = weight.to(torch.bfloat16).float()
    half = kernel.matmul(x, kernel.pack(weight, torch.bfloat16), None, out_features)
    assert torch.equal(half, kernel.matmul(x, kernel.pack(rounded), None, out_features))
    int8 = quantize_int8(weight)
    quarter = kernel.matmul(x, kernel.pack(weight, torch.int8, int8), None, out_features)
    deq = dequantize_int8(int8)
    assert torch.equal(quarter, kernel.matmul(x, kernel.pack(deq), None, out_features))


def test_bad_weight_dtype_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="cpu_weight_dtype"):
        LLM("unused", cpu_weight_dtype="float8")
    # it rounds a float32 model: with another dtype it would silently do nothing
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        LLM(str(tiny_llama_dir), cpu_weight_dtype="int8", dtype="bfloat16")


def test_rounding_without_the_kernels_says_it_gains_nothing(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        LLM(str(tiny_llama_dir), cpu_weight_dtype="int8", cpu_kernels=False)
    assert "no faster and no smaller" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        LLM(str(tiny_llama_dir), cpu_weight_dtype="int8")
    assert "no faster" not in caplog.text or load_cpu_kernels() is None


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c", "onednn"])
def test_logits_are_the_rounded_models(tiny_qwen3_dir: Path, dtype: str, cpu_kernels: bool) -> None:
    """Tighter than greedy tokens: the first step's logits equal the rounded model's within
    float-order noise, and sit measurably away from the unrounded model's."""
    prompt = make_prompts(320, seed=4)[2]
    llm = LLM(str(tiny_qwen3_dir), cpu_weight_dtype=dtype, cpu_kernels=cpu_kernels)
    llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    logits = llm.runner.run(llm.scheduler.schedule().scheduled)[0]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        rounded = rounded_hf(tiny_qwen3_dir, dtype)(ids).logits[0, -1]
        exact = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)(ids)
    torch.testing.assert_close(logits, rounded, atol=1e-4, rtol=1e-4)
    assert (logits - exact.logits[0, -1]).abs().max() > 1e-2


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 20),
    cols=st.integers(1, 100),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_int8_quantization_is_symmetric_per_group(
    rows: int, cols: int, scale: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen) * scale
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and int(q.abs().max()) <= 127
    assert scales.shape == (rows, -(-cols // INT8_GROUP)) and bool((scales > 0).all())
    deq = dequantize_int8((q, scales))
    # each weight within half a step of its group's grid; each group's largest reaches 127
    step = scales.repeat_interleave(INT8_GROUP, dim=1)[:, :cols]
    assert bool(((deq - weight).abs() <= step * 0.5001).all())
    padded = torch.nn.functional.pad(q.abs().int(), (0, scales.shape[1] * INT8_GROUP - cols))
    assert bool((padded.view(rows, -1, INT8_GROUP).amax(dim=2) == 127).all())


def test_weight_quality_scores_each_rounding(tiny_llama_dir: Path) -> None:
    from bench.weight_quality import perplexity

    ids = torch.tensor(make_prompts(320, seed=9)[0] * 3)
    scores = {dtype: perplexity(tiny_llama_dir, ids, dtype) for dtype in ("float32", "int8")}
    assert all(1.0 < s < float("inf") for s in scores.values())
    assert scores["int8"] != scores["float32"]  # the rounded model is another model
