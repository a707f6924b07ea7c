"""`cpu_weight_dtype="bfloat16-dot"`: bfloat16 weights, and every product's input rounded to
bfloat16 too, multiplied in pairs by AVX512-BF16's dot-product instruction (panel_gemm.c).

The reference is transformers' float32 model with its weight matrices rounded to bfloat16 and
every nn.Linear's input rounded to bfloat16 (bench/weight_quality.py round_product_inputs):
each product is then a float32 sum of the same exact products, in another order, so greedy
tokens match and logits agree closely (see test_logits_are_the_rounded_products for how closely).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_reference import (
    ARCH_FIXTURES,
    assert_greedy_matches,
    hf_references,
    make_prompts,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rounded_weights import rounded_hf

from bench.weight_quality import float16_kv, round_product_inputs
from kvcache import LLM, SamplingParams
from runner.backends.cpu.linear import PackedLinear
from runner.backends.cpu.loader import load_cpu_kernels

KERNELS = load_cpu_kernels()
needs_pairs = pytest.mark.skipif(
    KERNELS is None or not KERNELS.has_pairs,
    reason="needs the CPU kernels on a CPU with AVX512-BF16",
)
DOT = {"cpu_weight_dtype": "bfloat16-dot"}


def dot_hf(path: Path) -> Any:
    hf = rounded_hf(path, "bfloat16")
    round_product_inputs(hf)
    return hf


@pytest.fixture(scope="module", params=ARCH_FIXTURES)  # every layout the C layers run
def dot_case(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[list[int]]]:
    path: Path = request.getfixturevalue(request.param)
    hf = dot_hf(path)
    prompts, refs = hf_references(hf, seed=13)
    return path, prompts, refs


@needs_pairs
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 7},
        {"kv_cache_dtype": "auto"},
    ],
    ids=["c-layers", "cache-off", "small-chunks", "defaults"],
)
def test_greedy_matches_hf_with_rounded_product_inputs(dot_case: Any, variant: dict) -> None:
    path, prompts, refs = dot_case
    llm = LLM(str(path), **DOT, **variant)
    assert llm.cpu_layers is not None  # whole steps in layers.c, on pair panels
    assert_greedy_matches(llm, prompts, refs, alone=not variant)


@needs_pairs
def test_logits_are_the_rounded_products(tiny_qwen3_dir: Path) -> None:
    """The first step's logits sit by the reference's, and over ten times closer to it than
    to the model with bfloat16 weights but float32 inputs (what cpu_weight_dtype="bfloat16"
    runs): the inputs really are rounded, as the reference rounds them. Not within 1e-4 as
    other paths are: rounding to bfloat16 turns float-order noise (1e-7) into a whole bfloat16
    step (2^-8 of the value) wherever an input lies near the middle between two bfloat16
    values, and the sums carry that on (6e-4 at most here, against 1e-2 for the inputs not
    rounded at all)."""
    prompt = make_prompts(320, seed=4)[2]
    llm = LLM(str(tiny_qwen3_dir), **DOT)
    llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    logits = llm.runner.run(llm.scheduler.schedule().scheduled)[0]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        reference = dot_hf(tiny_qwen3_dir)(ids).logits[0, -1]
        weights_only = rounded_hf(tiny_qwen3_dir, "bfloat16")(ids).logits[0, -1]
    rounding_effect = float((reference - weights_only).abs().max())
    assert rounding_effect > 1e-3
    assert float((logits - reference).abs().max()) < rounding_effect / 10


@needs_pairs
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    in_features=st.sampled_from([1, 7, 33, 64, 512, 1024]),  # odd: a padded pair
    out_features=st.integers(1, 90),  # up to 6 panels: groups of 4 side by side and a rest
    extra=st.integers(0, 3),  # x rows further apart than they are long
    seed=st.integers(0, 2**16),
)
def test_pair_panels_sum_the_exact_products_of_rounded_inputs(
    rows: int, in_features: int, out_features: int, extra: int, seed: int
) -> None:
    """Against float64 sums of the bfloat16-rounded inputs' products: only float32 rounding of
    the sum is left. And a row's result does not depend on the rows beside it."""
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features + extra, generator=gen)[:, :in_features]
    packed = KERNELS.pack_pairs(weight)
    out = KERNELS.matmul(x, packed, None, out_features)
    exact = x.bfloat16().double() @ weight.bfloat16().double().T
    bound = 1e-6 * (x.bfloat16().double().abs() @ weight.bfloat16().double().abs().T) + 1e-30
    assert bool(((out.double() - exact).abs() <= bound).all())
    for r in {0, rows - 1}:
        assert torch.equal(KERNELS.matmul(x[r : r + 1], packed, None, out_features)[0], out[r])


@needs_pairs
def test_pair_panels_hold_bfloat16_pairs(tiny_llama_dir: Path) -> None:
    full, dot = LLM(str(tiny_llama_dir)), LLM(str(tiny_llama_dir), **DOT)

    def panels(llm: LLM) -> list[torch.Tensor]:
        return [m.packed for m in llm.model.modules() if isinstance(m, PackedLinear)]

    assert {(p.dtype, p.dim()) for p in panels(dot)} == {(torch.bfloat16, 4)}
    assert sum(p.nbytes for p in panels(dot)) * 2 == sum(p.nbytes for p in panels(full))


def test_it_is_refused_where_its_products_cannot_run(tiny_llama_dir: Path) -> None:
    """Without the C kernels or packed weights nothing would round the inputs: refused by name,
    never silently another model."""
    for options in ({"cpu_kernels": False}, {"prepack_weights": False}):
        with pytest.raises(ValueError, match="bfloat16-dot"):
            LLM(str(tiny_llama_dir), **DOT, **options)
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        LLM(str(tiny_llama_dir), **DOT, dtype="bfloat16")


def test_weight_quality_scores_it(tiny_llama_dir: Path) -> None:
    from bench.weight_quality import perplexity

    ids = torch.tensor(make_prompts(320, seed=9)[0] * 3)
    plain = perplexity(tiny_llama_dir, ids, "bfloat16")
    dot = perplexity(tiny_llama_dir, ids, "bfloat16-dot")
    assert 1.0 < dot < float("inf") and dot != plain  # the inputs' rounding is scored too


@needs_pairs
def test_a_prefix_cache_of_bfloat16_weights_does_not_load(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Its keys and values come from other products than bfloat16-dot's: refused by name, and
    the engine's own saved cache loads back."""
    prompt = make_prompts(320, seed=5)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    plain, dot = (
        LLM(str(tiny_llama_dir), cpu_weight_dtype="bfloat16"),
        LLM(str(tiny_llama_dir), **DOT),
    )
    plain.generate([prompt], params)
    dot.generate([prompt], params)
    plain.save_prefix_cache(tmp_path / "plain.safetensors")
    dot.save_prefix_cache(tmp_path / "dot.safetensors")
    fresh = LLM(str(tiny_llama_dir), **DOT)
    with pytest.raises(ValueError, match="saved for weights"):
        fresh.load_prefix_cache(tmp_path / "plain.safetensors")
    assert fresh.load_prefix_cache(tmp_path / "dot.safetensors") > 0
    assert (
        fresh.generate([prompt], params)[0].token_ids == dot.generate([prompt], params)[0].token_ids
    )


@needs_pairs
def test_with_a_float16_kv_cache_too(tiny_qwen2_dir: Path) -> None:
    """The two roundings together (the fastest setting for long contexts): the reference rounds
    the products' inputs and caches float16 keys and values."""
    hf = dot_hf(tiny_qwen2_dir)
    prompts, refs = hf_references(hf, seed=17, options=lambda: float16_kv(hf))
    llm = LLM(str(tiny_qwen2_dir), **DOT, kv_cache_dtype="float16")
    assert_greedy_matches(llm, prompts, refs, alone=True)
