"""The Triton RMSNorm (runner/backends/triton/rms_norm.py) against the torch path of RMSNorm, which
is transformers' order of operations. On the CPU it runs in Triton's interpreter, where its 16-bit
results equal the torch path's bit for bit; on a GPU the same cases run on the device."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runner.backends.triton.rms_norm import rms_norm
from runner.model.layers import RMSNorm
from tests.backends.triton.triton_cases import assert_within_an_ulp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (scale_in_float32, offset): Llama-style, OLMo 2-style, Gemma-style
NORM_KINDS = [(False, 0.0), (True, 0.0), (True, 1.0)]


def make_norm(dim: int, dtype: torch.dtype, in_float32: bool, offset: float) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, in_float32, offset).to(dtype)
    with torch.no_grad():  # Gemma stores weight - 1: small values around 0
        norm.weight.copy_(0.3 * torch.randn(dim) + (0.0 if offset else 1.0))
    return norm.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("in_float32", "offset"), NORM_KINDS)
@pytest.mark.parametrize("dim", [16, 48, 64, 576])
def test_rows_equal_the_torch_path(
    dtype: torch.dtype, in_float32: bool, offset: float, dim: int
) -> None:
    torch.manual_seed(dim)
    norm = make_norm(dim, dtype, in_float32, offset)
    x = (4 * torch.randn(37, dim)).to(dtype).to(DEVICE)
    got = rms_norm(x, norm.scale(), norm.eps, in_float32)
    ref = norm.torch_path(x)
    assert got.is_contiguous()
    assert_within_an_ulp(got, ref, 0.98)


@pytest.mark.parametrize(("in_float32", "offset"), NORM_KINDS)
def test_strided_heads_of_a_fused_projection(in_float32: bool, offset: float) -> None:
    """Qwen3's per-head q norm: [T, heads, head_dim] viewed inside the fused qkv output, whose
    rows are wider than the heads; the kernel reads them in place and writes a fresh tensor."""
    torch.manual_seed(1)
    head_dim, heads, tokens = 32, 3, 9
    norm = make_norm(head_dim, torch.bfloat16, in_float32, offset)
    qkv = torch.randn(tokens, 7 * head_dim).to(torch.bfloat16).to(DEVICE)
    q = qkv[:, head_dim : 4 * head_dim].view(tokens, heads, head_dim)
    assert not q.is_contiguous()
    got = rms_norm(q, norm.scale(), norm.eps, in_float32)
    assert_within_an_ulp(got, norm.torch_path(q), 0.98)
    deeper = qkv[:, : 6 * head_dim].reshape(tokens, 2, heads, head_dim)
    assert torch.equal(
        rms_norm(deeper, norm.scale(), norm.eps, in_float32).view(tokens * 2, heads, head_dim),
        rms_norm(deeper.reshape(-1, heads, head_dim), norm.scale(), norm.eps, in_float32),
    )


def test_no_rows_and_bad_arguments() -> None:
    norm = make_norm(16, torch.bfloat16, False, 0.0)
    empty = torch.zeros(0, 16, dtype=torch.bfloat16, device=DEVICE)
    assert rms_norm(empty, norm.scale(), norm.eps, False).shape == (0, 16)
    x = torch.ones(2, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="scale of"):
        rms_norm(x, norm.scale()[:8], norm.eps, False)
    with pytest.raises(ValueError, match="only with scale_in_float32"):
        rms_norm(x, norm.scale().float(), norm.eps, False)
