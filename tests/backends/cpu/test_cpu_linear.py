"""Prepacked weights (panel kernel or oneDNN): the packed product equals F.linear, and a packed
model computes the same logits as the plain one (the engine-level greedy equality runs in
test_engine_equivalence.py, packed by default and unpacked as a variant)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.linear import (
    PackedLinear,
    onednn_available,
    prepack_linears,
    prepacking_available,
)
from runner.kv_pool.store import KVStore
from runner.model.cpu_prepack import prepack_for_cpu
from runner.model.decoder import CausalLM
from runner.model.loader import load_model

pytestmark = pytest.mark.skipif(
    not prepacking_available(), reason="neither the panel kernel nor oneDNN runs here"
)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 70),
    in_features=st.integers(1, 96),
    out_features=st.integers(1, 96),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
    panel=st.booleans(),
)
def test_packed_linear_equals_f_linear(
    rows: int, in_features: int, out_features: int, bias: bool, seed: int, panel: bool
) -> None:
    """Either packing: the panel kernel where it builds, and oneDNN (its fallback)."""
    if not panel and not onednn_available():
        pytest.skip("torch built without oneDNN")
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    packed = PackedLinear(weight, b, panel_kernel=panel)
    torch.testing.assert_close(packed(x), F.linear(x, weight, b), atol=1e-4, rtol=1e-4)


def test_packed_linear_accepts_strided_input() -> None:
    weight = torch.randn(32, 48)
    x = torch.randn(48, 10).t()  # [10, 48], not contiguous: o_proj sees reshaped views
    torch.testing.assert_close(PackedLinear(weight, None)(x), F.linear(x, weight))


def test_packed_linear_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float32"):
        PackedLinear(torch.randn(4, 4, dtype=torch.bfloat16), None)


def test_prepack_replaces_float32_linears_only() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), nn.ReLU())
    model.append(nn.Linear(4, 4).to(torch.float64))
    assert prepack_linears(model) == 2
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("PackedLinear") == 2 and kinds.count("Linear") == 1


def prefill_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """Logits of every position after one prefill through a fresh paged store."""
    block_size = 8
    blocks = -(-len(tokens) // block_size)
    kv = KVStore(
        model.num_layers,
        blocks + 1,
        block_size,
        model.num_kv_heads,
        model.head_dim,
        torch.float32,
        "cpu",
    )
    meta = AttentionMetadata.build(
        [len(tokens)], [len(tokens)], [list(range(1, blocks + 1))], block_size
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), meta, kv)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_packed_model_computes_the_same_logits(
    request: pytest.FixtureRequest, fixture: str
) -> None:
    path: Path = request.getfixturevalue(fixture)
    tokens = list(range(3, 45))
    plain = load_model(str(path)).model
    packed = load_model(str(path)).model
    params_before = packed.num_matmul_params()
    layers = len(packed.layers)
    # four projections per layer, plus the head (its own copy when tied to the embedding)
    assert prepack_for_cpu(packed).packed == 4 * layers + 1
    assert isinstance(packed.lm_head, PackedLinear)
    assert packed.num_matmul_params() == params_before
    torch.testing.assert_close(
        prefill_logits(packed, tokens), prefill_logits(plain, tokens), atol=1e-4, rtol=1e-4
    )
