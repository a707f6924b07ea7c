"""RoPE and the K/V store in one kernel (runner/backends/triton/rope_store.py) against the torch
path (apply_rope, then the cache written at the slots): q out and the cache contents bit for bit
in float32, within an ulp in bfloat16; GQA, partial rotary, padding slots. In Triton's
interpreter on the CPU; on a GPU on CUDA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from runner.attention.metadata import AttentionMetadata
from runner.backends.torch.backend import TORCH_ATTENTION
from runner.backends.triton.attention import triton_backend
from runner.backends.triton.common import interpreting
from runner.backends.triton.rope_store import rope_store, rope_store_fits
from runner.kv_pool.store import KVStore
from runner.model.decoder_layers import Attention
from runner.model.layers import apply_rope, rope_cos_sin
from runner.model.loader import load_model
from tests.backends.triton.triton_cases import assert_within_an_ulp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def torch_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The torch path: rotate, then write the valid slots of the flat cache."""
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keep = slots >= 0
    heads, dim = k_cache.shape[2:]
    k_cache.view(-1, heads, dim)[slots[keep]] = k[keep]
    v_cache.view(-1, heads, dim)[slots[keep]] = v[keep]
    return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "factor"),
    [(4, 2, 16, 1.0), (3, 3, 24, 1.0), (4, 1, 16, 0.75)],  # GQA, odd heads, partial rotary
)
def test_rope_store_equals_rope_then_store(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, factor: float
) -> None:
    torch.manual_seed(heads * head_dim)
    config = SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=factor)
    table_cos, table_sin = rope_cos_sin(config, head_dim, 64, dtype, DEVICE)
    assert table_cos.shape[-1] == int(head_dim * factor)
    tokens, blocks, block_size = 7, 6, 4
    # q, k, v as strided views of one fused projection, as the model hands them over.
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)).to(dtype).to(DEVICE)
    q, k, v = (
        p.view(tokens, -1, head_dim)
        for p in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    )
    positions = torch.tensor([0, 5, 9, 63, 17, 2, 40], device=DEVICE)
    cos, sin = table_cos[positions], table_sin[positions]
    slots = torch.tensor([0, 5, -1, 23, 6, -1, 13], device=DEVICE)  # two padding rows
    cache = (torch.randn(2, blocks, block_size, kv_heads, head_dim)).to(dtype).to(DEVICE)
    ref_k, ref_v = cache[0].clone(), cache[1].clone()
    ref_q = torch_rope_store(q, k, v, cos, sin, ref_k, ref_v, slots)
    got_k, got_v = cache[0].clone(), cache[1].clone()
    got_q = rope_store(q, k, v, cos, sin, got_k, got_v, slots)
    assert got_q.shape == ref_q.shape and got_q.is_contiguous()
    assert_within_an_ulp(got_q, ref_q)
    assert_within_an_ulp(got_k, ref_k)  # the padding rows' slots untouched, the rest rotated
    assert torch.equal(got_v, ref_v)  # v is copied as it is
    assert not torch.equal(got_k, cache[0])  # it did write


def test_refuses_what_it_does_not_take() -> None:
    q = torch.randn(2, 2, 8, device=DEVICE)
    k = v = torch.randn(2, 1, 8, device=DEVICE)
    cos = sin = torch.randn(2, 8, device=DEVICE)
    cache = torch.zeros(4, 2, 1, 8, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    assert rope_store_fits(q, k, v, cos, cache)
    assert not rope_store_fits(q, k, v, cos.half(), cache)  # tables of another dtype
    assert not rope_store_fits(q, k, v, cos[:, :3], cache)  # an odd rotary width
    assert not rope_store_fits(q, k, v, torch.randn(2, 10, device=DEVICE), cache)  # wider than D
    with pytest.raises(ValueError, match="one dtype"):
        rope_store(q, k, v, cos, sin, cache.half(), cache.half(), slots)
    with pytest.raises(ValueError, match="do not fit cache"):
        rope_store(q, k, v, cos, sin, torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8), slots)
    with pytest.raises(ValueError, match="need 2 rows"):
        rope_store(q, k, v, cos, sin, cache, cache.clone(), slots[:1])
    out = rope_store(q[:0], k[:0], v[:0], cos[:0], sin[:0], cache, cache.clone(), slots[:0])
    assert out.shape == (0, 2, 8)


@pytest.mark.skipif(
    DEVICE == "cpu" and not interpreting(), reason="Triton needs CUDA or its interpreter"
)
@pytest.mark.parametrize(
    ("arch", "dtype", "overrides"),
    [
        ("qwen3", torch.float32, {}),  # q/k norms per head, then RoPE
        ("llama", torch.bfloat16, {}),  # q and k straight from the fused projection
        ("phi3", torch.float32, {"partial_rotary_factor": 0.5}),  # partial rotary
    ],
)
def test_attention_with_rope_store_equals_torch_path(
    make_tiny_model: Callable[..., Path],
    arch: str,
    dtype: torch.dtype,
    overrides: dict[str, float],
) -> None:
    """A layer's attention with `attend_stored` (the fused RoPE + store, then Triton attention
    without its store: what a GPU step runs) against the torch path, over a prefill of 5 tokens
    then a decode of 2 sequences: same output, same cache."""
    model = load_model(make_tiny_model(arch, **overrides), device=DEVICE, dtype=dtype).model
    attn: Attention = model.layers[0].self_attn  # type: ignore[assignment]
    if overrides:
        assert model.rope_cos.shape[-1] < model.head_dim
    kv = KVStore(1, 8, 4, model.num_kv_heads, model.head_dim, dtype, DEVICE)
    backend = triton_backend()
    inner = backend.attend_stored
    assert inner is not None
    used: list[int] = []

    def attend_stored(*args: Any) -> torch.Tensor:
        used.append(1)  # the fused path was taken, not the fallback
        return inner(*args)

    gen = torch.Generator().manual_seed(1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for query_lens, ctxs, tables in (([5], [5], [[1, 2]]), ([1, 1], [6, 3], [[1, 2], [3]])):
        meta = AttentionMetadata.build(query_lens, ctxs, tables, 4, DEVICE)
        t = sum(query_lens)
        x = torch.randn(t, model.hidden_size, generator=gen).to(dtype).to(DEVICE)
        pos = torch.tensor(
            [c - q + i for q, c in zip(query_lens, ctxs, strict=True) for i in range(q)],
            device=DEVICE,
        )
        cos, sin = model.rope_cos[pos], model.rope_sin[pos]
        outs, caches = [], []
        for stored in (None, attend_stored):
            k_cache, v_cache = (c.clone() for c in kv.layer(0))
            with torch.inference_mode():
                outs.append(
                    attn(x, cos, sin, meta, k_cache, v_cache, TORCH_ATTENTION.attend, stored)
                )
            caches.append((k_cache, v_cache))
        kv.layer(0)[0].copy_(caches[0][0])
        kv.layer(0)[1].copy_(caches[0][1])
        torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
        for got, ref in zip(caches[1], caches[0], strict=True):
            assert_within_an_ulp(got, ref)
    assert len(used) == 2
