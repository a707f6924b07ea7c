"""The fused residual-add RMSNorm and SiLU-times-up kernels (runner/backends/triton/
fused_elementwise.py) against torch's own operations in the same dtype: within one unit in the
last place, nearly all values equal. In Triton's interpreter on the CPU; on a GPU on CUDA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from runner.attention.metadata import AttentionMetadata
from runner.backends.torch.backend import TORCH_ATTENTION
from runner.backends.triton.common import interpreting
from runner.backends.triton.fused_elementwise import add_rms_norm, silu_mul
from runner.kv_pool.store import KVStore
from runner.model.layers import RMSNorm
from runner.model.loader import load_model
from tests.backends.triton.triton_cases import assert_within_an_ulp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("in_float32", "offset"), [(False, 0.0), (True, 0.0), (True, 1.0)])
@pytest.mark.parametrize("dim", [48, 576])
def test_add_rms_norm_equals_add_then_norm(
    dtype: torch.dtype, in_float32: bool, offset: float, dim: int
) -> None:
    torch.manual_seed(dim)
    norm = RMSNorm(dim, 1e-6, in_float32, offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(dim) + (0.0 if offset else 1.0))
    norm = norm.to(DEVICE)
    wide = (4 * torch.randn(13, 2 * dim)).to(dtype).to(DEVICE)
    x = wide[:, dim:]  # strided rows, as a slice of a wider output
    residual = (4 * torch.randn(13, dim)).to(dtype).to(DEVICE)
    out, total = add_rms_norm(x, residual, norm.scale(), norm.eps, in_float32)
    ref_total = x + residual
    assert torch.equal(total, ref_total)  # the add rounds once, as torch's
    assert_within_an_ulp(out, norm.torch_path(ref_total), 0.98)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [24, 1536])
def test_silu_mul_equals_torch(dtype: torch.dtype, inter: int) -> None:
    torch.manual_seed(inter)
    gate_up = (3 * torch.randn(7, 2 * inter)).to(dtype).to(DEVICE)
    gate, up = gate_up.split(inter, dim=-1)
    got = silu_mul(gate_up)
    assert got.is_contiguous()
    assert_within_an_ulp(got, F.silu(gate) * up, 0.97)


def test_float32_kernels_are_torchs_within_float32_rounding() -> None:
    """In float32 (exact math: correctly rounded square root and divisions) the fused kernels
    give torch's float32 results within a few float32 roundings: the residual sum exactly,
    the norm and the SiLU to a relative 1e-6."""
    torch.manual_seed(5)
    dim = 96
    norm = RMSNorm(dim, 1e-6, False, 0.0).to(DEVICE)
    x = 4 * torch.randn(9, dim, device=DEVICE)
    residual = 4 * torch.randn(9, dim, device=DEVICE)
    out, total = add_rms_norm(x, residual, norm.scale(), norm.eps, False)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(out, norm.torch_path(x + residual), rtol=1e-6, atol=1e-7)
    gate_up = 3 * torch.randn(5, 2 * 40, device=DEVICE)
    gate, up = gate_up.split(40, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-7)


def test_bad_shapes_and_no_rows() -> None:
    x = torch.ones(2, 16, dtype=torch.bfloat16, device=DEVICE)
    scale = torch.ones(16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="add_rms_norm of"):
        add_rms_norm(x, x[:, :8], scale, 1e-6, False)
    with pytest.raises(ValueError, match="one dtype"):
        add_rms_norm(x, x.half(), scale, 1e-6, False)
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul(x[:, :7])
    empty = x[:0]
    assert add_rms_norm(empty, empty, scale, 1e-6, False)[0].shape == (0, 16)
    assert silu_mul(empty).shape == (0, 8)


@pytest.mark.skipif(
    DEVICE == "cpu" and not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1"
)
@pytest.mark.parametrize(("arch", "dtype"), [("qwen3", torch.float32), ("llama", torch.bfloat16)])
def test_decoder_layer_fused_equals_unfused(
    make_tiny_model: Callable[..., Path], arch: str, dtype: torch.dtype
) -> None:
    """A decoder layer's forward with `fused` (the residual add folded into the MLP's norm,
    SiLU * up in one kernel: what a GPU step with Triton attention runs) against the same layer
    unfused, over a prefill of 5 tokens then a decode of 2 sequences."""
    model = load_model(make_tiny_model(arch), device=DEVICE, dtype=dtype).model
    layer = model.layers[0]
    kv = KVStore(1, 8, 4, model.num_kv_heads, model.head_dim, dtype, DEVICE)
    gen = torch.Generator().manual_seed(1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for query_lens, ctxs, tables in (([5], [5], [[1, 2]]), ([1, 1], [6, 3], [[1, 2], [3]])):
        meta = AttentionMetadata.build(query_lens, ctxs, tables, 4, DEVICE)
        t = sum(query_lens)
        h = torch.randn(t, model.hidden_size, generator=gen).to(dtype).to(DEVICE)
        pos = torch.tensor(
            [c - q + i for q, c in zip(query_lens, ctxs, strict=True) for i in range(q)],
            device=DEVICE,
        )
        cos, sin = model.rope_cos[pos], model.rope_sin[pos]
        outs = []
        for fused in (False, True):
            k_cache, v_cache = (c.clone() for c in kv.layer(0))
            with torch.inference_mode():
                outs.append(
                    layer(
                        h.clone(), cos, sin, meta, k_cache, v_cache, TORCH_ATTENTION.attend, fused
                    )
                )
        kv.layer(0)[0].copy_(k_cache)
        kv.layer(0)[1].copy_(v_cache)
        torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
        assert not torch.equal(outs[0], h)  # the layer did change the stream
