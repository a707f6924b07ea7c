"""Two fused elementwise kernels for the decode graph (issue 39: fewer kernels a step), for 16-bit
activations on a GPU:

- add_rms_norm: the residual add folded into the RMSNorm that follows it. transformers adds the
  attention's (or the MLP's) output to the residual stream, rounds the sum to the activations'
  dtype, and normalises that sum for the next sublayer: an add kernel, then the norm's. Here
  one pass reads both rows, writes the rounded sum (the next residual) and its norm.
- silu_mul: SiLU of the gate times the up projection, read from the fused gate_up output
  [T, 2I], as torch computes F.silu(gate) * up in 16 bits (the SiLU in float32 rounded once,
  then the product rounded once): one kernel instead of three (split, SiLU, multiply).

Both keep torch's order of operations and roundings (the norm is rms_norm.py's store_rms_norm),
so they equal the torch path within one unit in the last place (the sum of squares is added in
another order). They also run in float32 (a float32 model on a GPU), where nothing
rounds the result to 16 bits afterwards: there Triton's defaults would compile the square root,
the divisions and the exponential to approximate instructions (sqrt.approx.ftz.f32,
div.full.f32, ex2.approx.f32 on sm_90), a few units in the last place off torch's, which is
enough to flip a greedy argmax. In float32 the kernels therefore use the correctly rounded
square root and division (tl.math.sqrt_rn, div_rn) and CUDA's own expf (libdevice.exp, what
torch's SiLU calls); runner/backends/triton/aot.py reads the float32 PTX for the approximate
forms. The interpreter computes exactly in numpy, where libdevice is not available, so there
the exponential stays tl.exp. The model's layers call them in a GPU step with Triton attention
(CausalLM.forward passes `fused`): DecoderLayer folds its residual add into the MLP's norm
(RMSNorm.add_forward) and the MLP runs silu_mul; the post-norm and sandwich layers only the
latter. The add before the next layer's input norm stays unfused (it crosses layers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.backends.triton.common import interpreting, pow2_at_least, rounded
from runner.backends.triton.rms_norm import row_tile, store_rms_norm

try:  # CUDA's math library (its expf); absent from Triton builds without the NVIDIA backend
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - every Triton the project supports has it
    libdevice = None


@triton.jit
def _add_rms_norm_kernel(
    x_ptr: tl.tensor,  # [T, dim], the sublayer's output
    residual_ptr: tl.tensor,  # [T, dim]
    scale_ptr: tl.tensor,  # [dim]
    sum_ptr: tl.tensor,  # [T, dim] out: x + residual, rounded (the next residual)
    out_ptr: tl.tensor,  # [T, dim] out: its RMSNorm
    stride_x: int,
    stride_r: int,
    dim: int,
    eps: float,
    D_PAD: tl.constexpr,
    SCALE_IN_FLOAT32: tl.constexpr,
    PRECISE: tl.constexpr,  # float32: correctly rounded square root and divisions
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D_PAD)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    total = rounded(x + res, out_ty)  # a 16-bit add, as torch's
    tl.store(sum_ptr + row * dim + cols, total.to(out_ty), mask=mask)
    store_rms_norm(total, scale_ptr, out_ptr, row, cols, mask, dim, eps, SCALE_IN_FLOAT32, PRECISE)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    scale_in_float32: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * scale, x + residual) for x, residual [T, dim] (rows may be
    strided, the last dim contiguous): the sum rounded to x's dtype as torch's add rounds it,
    then normalised as runner/backends/triton/rms_norm.py does. Returns new contiguous tensors."""
    if x.dim() != 2 or residual.shape != x.shape or scale.shape != (x.shape[1],):
        raise ValueError(
            f"add_rms_norm of {tuple(x.shape)} and {tuple(residual.shape)} by a scale of "
            f"{tuple(scale.shape)}"
        )
    if residual.dtype != x.dtype or (not scale_in_float32 and scale.dtype != x.dtype):
        raise ValueError(
            f"add_rms_norm needs one dtype: {x.dtype}, {residual.dtype}, {scale.dtype}"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens, dim = x.shape
    if tokens:
        _add_rms_norm_kernel[(tokens,)](
            x,
            residual,
            scale.contiguous(),
            total,
            out,
            x.stride(0),
            residual.stride(0),
            dim,
            eps,
            SCALE_IN_FLOAT32=scale_in_float32,
            PRECISE=x.dtype == torch.float32,
            **row_tile(dim),
        )
    return out, total


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr: tl.tensor,  # [T, 2 * inter]: gate, then up
    out_ptr: tl.tensor,  # [T, inter]
    stride_t: int,
    inter: int,
    BLOCK: tl.constexpr,
    PRECISE: tl.constexpr,  # float32: correctly rounded division
    CUDA_EXP: tl.constexpr,  # float32 compiled for a GPU: CUDA's expf, not ex2.approx
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    base = gate_up_ptr + row * stride_t
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if CUDA_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    if PRECISE:
        act = tl.math.div_rn(gate, 1.0 + e)
    else:
        act = gate / (1.0 + e)
    act = rounded(act, out_ty)  # F.silu: float32 inside, rounded
    tl.store(out_ptr + row * inter + cols, rounded(act * up, out_ty).to(out_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up [T, 2I] (gate the first I columns, up the last), as torch
    computes it in gate_up's dtype. Returns a new contiguous [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul needs [T, 2I], got {tuple(gate_up.shape)}")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, pow2_at_least(inter, floor=16))
    if tokens and inter:
        grid = (tokens, triton.cdiv(inter, block))
        precise = gate_up.dtype == torch.float32
        _silu_mul_kernel[grid](
            gate_up,
            out,
            gate_up.stride(0),
            inter,
            BLOCK=block,
            PRECISE=precise,
            CUDA_EXP=precise and libdevice is not None and not interpreting(),
        )
    return out
