"""Where the Triton tests run: on the CPU in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports Triton), and on a CUDA device where there is one."""

from __future__ import annotations

import pytest
import torch

from runner.backends.triton.common import interpreting

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1"),
    ),
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]
# How far a kernel's output may stand from the torch reference's, by dtype.
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def assert_within_an_ulp(got: torch.Tensor, ref: torch.Tensor, equal_share: float = 0.0) -> None:
    """Every value of a 16-bit result equal to the torch path's or one unit in the last place
    from it, and at least `equal_share` of them equal (a float32 result: all equal). The
    kernels add in another order than torch (and on a GPU take another's square root), which
    moves a float32 intermediate by its last bit and, rarely, a rounding."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype == torch.float32:
        assert torch.equal(got, ref)
        return
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[ref.dtype]
    magnitude = ref.float().abs().clamp_min(2.0**-14)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa_bits)
    diff = (got.float() - ref.float()).abs()
    assert bool((diff <= ulp).all()), f"{int((diff > ulp).sum())} values off by over an ulp"
    assert float((got == ref).float().mean()) >= equal_share
