"""`cpu_weight_dtype="int8-dot"`: weights quantized to int8 with one scale per output column,
and every product's input rows quantized to int8 with one scale per row, multiplied by
AVX512-VNNI's integer dot product (runner/backends/cpu/csrc/quad_gemm.c).

The reference is transformers' float32 model with its weight matrices so quantized and every
nn.Linear's input rounded by quant.py's quantize_rows (`int8_dot_hf`): the kernel's int32 sums
are exact, so each product is the reference's up to float32 rounding of its sum, and greedy
tokens match.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_reference import assert_greedy_matches, hf_greedy, make_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kvcache import LLM
from runner.backends.cpu.linear import PackedLinear
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.cpu.quant import quantize_int8_columns, quantize_rows
from tests.conftest import load_hf_reference

KERNELS = load_cpu_kernels()
needs_quads = pytest.mark.skipif(
    KERNELS is None or not KERNELS.has_quads,
    reason="needs the CPU kernels on a CPU with AVX512-VNNI",
)
INT8_DOT = {"cpu_weight_dtype": "int8-dot"}


def int8_dot_hf(path: Path) -> Any:
    """transformers' float32 model as int8-dot computes it: every Linear and Embedding weight
    quantized per row, every Linear's input quantized per row (both kept as float32)."""
    hf = load_hf_reference(path)
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                q, scales = quantize_int8_columns(module.weight)
                module.weight.copy_(q.float() * scales)
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (quantize_rows(args[0]),))
    return hf


@needs_quads
@pytest.mark.parametrize("arch", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_gemma3_dir"])
@pytest.mark.parametrize(
    "variant", [{}, {"max_num_batched_tokens": 7}], ids=["c-layers", "small-chunks"]
)
def test_greedy_matches_hf_with_quantized_product_inputs(
    arch: str, variant: dict, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(arch)
    hf = int8_dot_hf(path)
    prompts = make_prompts(hf.config.vocab_size, seed=13)
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 10, None) for p in prompts]
    llm = LLM(str(path), **INT8_DOT, **variant)
    assert llm.cpu_layers is not None  # whole steps in layers.c, on quad panels
    assert_greedy_matches(llm, prompts, refs, alone=not variant)


@needs_quads
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    in_features=st.sampled_from([1, 3, 7, 33, 64, 512, 1024]),  # a padded quad
    out_features=st.integers(1, 90),  # up to 6 panels: groups of 4 side by side and a rest
    extra=st.integers(0, 3),  # x rows further apart than they are long
    seed=st.integers(0, 2**16),
)
def test_quad_panels_sum_the_exact_products_of_quantized_inputs(
    rows: int, in_features: int, out_features: int, extra: int, seed: int
) -> None:
    """Against float64 sums of the quantized inputs' products: only the float32 rounding of the
    scaled sum is left. And a row's result does not depend on the rows beside it."""
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features + extra, generator=gen)[:, :in_features]
    q, scales = quantize_int8_columns(weight)
    packed = KERNELS.pack_quads((q, scales))
    out = KERNELS.matmul(x, packed, None, out_features)
    xq, wq = quantize_rows(x).double(), (q.double() * scales.double())
    exact = xq @ wq.T
    bound = 1e-6 * (xq.abs() @ wq.abs().T) + 1e-30
    assert bool(((out.double() - exact).abs() <= bound).all())
    for r in {0, rows - 1}:
        assert torch.equal(KERNELS.matmul(x[r : r + 1], packed, None, out_features)[0], out[r])


def test_rows_of_zeros_stay_zero() -> None:
    """An all-zero row keeps scale 1 (no division by zero): its products are 0."""
    x = torch.zeros(2, 40)
    assert torch.equal(quantize_rows(x), x)
    if KERNELS is not None and KERNELS.has_quads:
        packed = KERNELS.pack_quads(quantize_int8_columns(torch.randn(20, 40)))
        assert torch.equal(KERNELS.matmul(x, packed, None, 20), torch.zeros(2, 20))


@needs_quads
def test_quad_panels_hold_a_quarter_of_the_bytes(tiny_llama_dir: Path) -> None:
    full, dot = LLM(str(tiny_llama_dir)), LLM(str(tiny_llama_dir), **INT8_DOT)

    def panels(llm: LLM) -> list[torch.Tensor]:
        return [m.packed for m in llm.model.modules() if isinstance(m, PackedLinear)]

    assert {(p.dtype, p.dim()) for p in panels(dot)} == {(torch.int8, 4)}
    assert sum(p.nbytes for p in panels(dot)) * 3.5 < sum(p.nbytes for p in panels(full))


def test_it_is_refused_where_its_products_cannot_run(tiny_llama_dir: Path) -> None:
    """Without the C kernels or packed weights nothing would quantize the inputs: refused by
    name, never silently another model."""
    for options in ({"cpu_kernels": False}, {"prepack_weights": False}):
        with pytest.raises(ValueError, match="int8-dot"):
            LLM(str(tiny_llama_dir), **INT8_DOT, **options)
