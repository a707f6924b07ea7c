"""RMSNorm in one Triton kernel, for 16-bit activations on a GPU.

In bfloat16 / float16 the torch path of `runner.model.layers.RMSNorm` is transformers' order of
operations: a float32 copy, its square, the mean, the epsilon, the rsqrt, the product, the
rounding to the input dtype, the scale. That is about eight kernels a norm, and a Qwen3 decode
step has 113 norms: on an H200 those small kernels took about 1.6 ms of a 5.6 ms decode graph.
This kernel does the same operations, in the same order and dtypes, in one pass over each row.
Only the sum of squares is added in another order, so results can differ from the torch path
in the last bit of a float32 mean, and so, rarely, by one unit in the last place of the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.backends.triton.common import pow2_at_least, rounded

# Importing triton_common above chose the interpreter where there is no CUDA device.


@triton.jit
def store_rms_norm(
    x: tl.tensor,  # [D_PAD] float32 holding out's dtype's values, 0 past dim
    scale_ptr: tl.tensor,  # [dim]: the weight (or Gemma's 1 + weight, in float32)
    out_ptr: tl.tensor,  # rows of dim, contiguous, the input's dtype
    row: int,
    cols: tl.tensor,  # [D_PAD] arange
    mask: tl.tensor,  # cols < dim
    dim: int,
    eps: float,
    SCALE_IN_FLOAT32: tl.constexpr,  # scale, then round (OLMo 2, Gemma); else round, then scale
    PRECISE: tl.constexpr,  # float32: correctly rounded square root and divisions
) -> None:
    """Row `row` of out: the RMSNorm of x times the scale, in transformers' operations and
    dtypes (the norm in float32, the scale's product as a 16-bit one unless SCALE_IN_FLOAT32).
    PRECISE keeps the square root and divisions correctly rounded where nothing rounds the
    result to 16 bits afterwards (float32), as torch's are."""
    squares = tl.sum(x * x, axis=0)
    if PRECISE:
        mean = tl.math.div_rn(squares, dim.to(tl.float32))  # type: ignore[attr-defined]
        normed = x * tl.math.div_rn(1.0, tl.math.sqrt_rn(mean + eps))
    else:
        normed = x * (1.0 / tl.sqrt(squares / dim + eps))
    scale = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if SCALE_IN_FLOAT32:
        out = scale * normed
    else:  # a 16-bit product, as torch computes one: in float32, rounded once below
        out = scale * rounded(normed, out_ty)
    tl.store(out_ptr + row * dim + cols, rounded(out, out_ty).to(out_ty), mask=mask)


def row_tile(dim: int) -> dict[str, int]:
    """The launch constants of a kernel with one program a row of `dim` values: the row padded
    to a power of two (D_PAD) and warps for 4 to 8 values a thread (a head: 1 warp)."""
    d_pad = pow2_at_least(dim, floor=1)
    return {"D_PAD": d_pad, "num_warps": min(8, max(1, d_pad // 256))}


@triton.jit
def _rms_norm_kernel(
    x_ptr: tl.tensor,  # [A, B, dim] rows, last dim contiguous
    scale_ptr: tl.tensor,  # [dim]: the weight (or Gemma's 1 + weight, in float32)
    out_ptr: tl.tensor,  # [A * B, dim], contiguous, the input's dtype
    stride_a: int,
    stride_b: int,
    dim: int,
    eps: float,
    NUM_B: tl.constexpr,
    D_PAD: tl.constexpr,  # dim rounded up to a power of two
    SCALE_IN_FLOAT32: tl.constexpr,  # scale, then round (OLMo 2, Gemma); else round, then scale
) -> None:
    row = tl.program_id(0)
    cols = tl.arange(0, D_PAD)
    mask = cols < dim
    base = (row // NUM_B) * stride_a + (row % NUM_B) * stride_b
    x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    store_rms_norm(x, scale_ptr, out_ptr, row, cols, mask, dim, eps, SCALE_IN_FLOAT32, False)


def rms_norm(
    x: torch.Tensor, scale: torch.Tensor, eps: float, scale_in_float32: bool
) -> torch.Tensor:
    """RMSNorm of x [..., dim] over its last dim (contiguous; the rows may be strided, e.g. the
    heads of a slice of a fused projection), multiplied by scale [dim]. Returns a new
    contiguous tensor of x's shape and dtype. Without `scale_in_float32` the scale must have
    x's dtype: the product is then a 16-bit one, as in torch."""
    dim = x.shape[-1]
    if x.dim() < 2 or scale.shape != (dim,):
        raise ValueError(f"rms_norm of {tuple(x.shape)} by a scale of {tuple(scale.shape)}")
    if not scale_in_float32 and scale.dtype != x.dtype:
        raise ValueError(f"a {scale.dtype} scale rounds to {x.dtype} only with scale_in_float32")
    if x.dim() == 2:
        rows = x.unsqueeze(1)  # [T, 1, dim]: still a view, whatever x's row stride
    elif x.dim() == 3:
        rows = x  # [T, heads, dim], e.g. q viewed as heads inside the fused qkv output
    else:
        rows = x.reshape(-1, *x.shape[-2:])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = rows.shape[0] * rows.shape[1]
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            rows,
            scale.contiguous(),
            out,
            rows.stride(0),
            rows.stride(1),
            dim,
            eps,
            NUM_B=rows.shape[1],
            SCALE_IN_FLOAT32=scale_in_float32,
            **row_tile(dim),
        )
    return out
