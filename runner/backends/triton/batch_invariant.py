"""Batch-invariant matrix products for deterministic mode on CUDA (docs/DETERMINISM.md).

cuBLAS picks its kernel, its tiles and whether to split the sum over K from the shape of the
product, so a row's result in a decode of 1 row and in a step of 256 rows is summed in other
orders and differs in its last bits. This kernel's launch depends on M (the number of rows)
only through its grid: the tiles (BLOCK_M x BLOCK_N, and BLOCK_K along K) and the warps are
constants, there is no split-K and no autotuning, and each output tile sums K from 0 up in
chunks of BLOCK_K, one tl.dot at a time into one float32 accumulator. A row lands at another
position of its tile when M changes, and a tensor-core product sums each output element in
the same order whatever its position, so the row's bits stay the same.

Float32 operands are multiplied as IEEE float32 (no TF32). Under Triton's interpreter (no GPU)
a chunk's products are summed by tl.sum instead of tl.dot: the interpreter's tl.dot is numpy's
matmul, which multiplies bfloat16's raw storage (runner/backends/triton/common.py dot_config)
and whose OpenBLAS micro-kernels sum a row in another order at another place of the tile. So
the CPU tests check the kernel's tiling and order over K; that a GPU's tensor-core product sums
a row the same at any place of its tile is what the GPU check (scripts/gpu_check.sh) measures.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.backends.triton.common import interpreting

# The tiles of every product, whatever its shape. 64 x 64 output tiles summed 32 at a time
# along K: small enough for a decode of one row not to waste a GPU's whole tile, large
# enough for a prompt's rows to run on tensor cores.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4


@triton.jit
def _rows_matmul_kernel(
    x_ptr: tl.tensor,  # [M, K], last dim contiguous
    w_ptr: tl.tensor,  # [N, K], last dim contiguous (nn.Linear's weight)
    bias_ptr: tl.tensor,  # [N] or unread
    out_ptr: tl.tensor,  # [M, N], contiguous
    M: int,
    N: int,
    K: int,
    stride_xm: int,
    stride_wn: int,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # float32 operands: IEEE products, no TF32
    ON_TENSOR_CORES: tl.constexpr,  # tl.dot on a GPU; in the interpreter, see below
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
) -> None:
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # K from 0 up, BK at a time: the one order every row's sum takes, whatever M is.
    for k0 in range(0, K, BK):
        kk = k0 + ks
        a_mask = (rows[:, None] < M) & (kk[None, :] < K)
        a = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=a_mask, other=0.0)
        b_mask = (kk[:, None] < K) & (cols[None, :] < N)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None], mask=b_mask, other=0.0)
        if ON_TENSOR_CORES:
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        else:  # the interpreter: its tl.dot is numpy's matmul, whose bits move with a row's
            # place in the tile; a broadcast product summed over the chunk's axis does not.
            prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    out = out_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def rows_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) -> [..., N] in x's dtype: `F.linear`, each row's
    result the same bits whatever the other rows are and however many (module docstring)."""
    if x.shape[-1] != weight.shape[1] or weight.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype}, weight is {weight.dtype}: the product needs one dtype")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _rows_matmul_kernel[grid](
            rows,
            w,
            w if bias is None else bias,
            out,
            m,
            n,
            k,
            rows.stride(0),
            w.stride(0),
            HAS_BIAS=bias is not None,
            UPCAST=x.dtype == torch.float32,
            ON_TENSOR_CORES=not interpreting(),
            BM=BLOCK_M,
            BN=BLOCK_N,
            BK=BLOCK_K,
            num_warps=NUM_WARPS,
        )
    return out.reshape(*x.shape[:-1], n)


@triton.jit
def _log_softmax_kernel(
    x_ptr: tl.tensor,  # [M, V] float32, contiguous
    out_ptr: tl.tensor,  # [M, V] float32
    V: int,
    BV: tl.constexpr,
) -> None:
    """One row per program: its maximum, then the sum of exp(x - max) BV values at a time from
    the first, then x - max - log(sum). The same order for a row whatever the batch."""
    base = tl.program_id(0).to(tl.int64) * V
    offs = tl.arange(0, BV)
    top = tl.full((BV,), float("-inf"), tl.float32)
    for v0 in range(0, V, BV):
        x = tl.load(x_ptr + base + v0 + offs, mask=v0 + offs < V, other=float("-inf"))
        top = tl.maximum(top, x)
    row_max = tl.max(top, axis=0)
    total = tl.zeros((BV,), tl.float32)
    for v0 in range(0, V, BV):
        x = tl.load(x_ptr + base + v0 + offs, mask=v0 + offs < V, other=float("-inf"))
        total += tl.exp(x - row_max)
    shift = row_max + tl.log(tl.sum(total, axis=0))
    for v0 in range(0, V, BV):
        x = tl.load(x_ptr + base + v0 + offs, mask=v0 + offs < V, other=0.0)
        tl.store(out_ptr + base + v0 + offs, x - shift, mask=v0 + offs < V)


def rows_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension of float32 logits [M, V], each row alone in a fixed
    order (1,024 values at a time): torch's kernel also reduces a row in one block sized by V,
    but this one is ours to keep so."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [M, V] float32, got {tuple(logits.shape)} {logits.dtype}")
    x = logits.contiguous()
    out = torch.empty_like(x)
    if x.shape[0] and x.shape[1]:
        _log_softmax_kernel[(x.shape[0],)](x, out, x.shape[1], BV=1024, num_warps=4)
    return out
