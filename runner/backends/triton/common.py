"""Shared pieces of the Triton kernels: the CPU interpreter fallback, tile helpers, the
attention-logit soft cap, and rounding to a 16-bit dtype as torch rounds.

Without a GPU the kernels run in Triton's interpreter: runner/__init__.py sets TRITON_INTERPRET
before any kernel module imports Triton (`interpreting()` says which).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors) instead of on a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def pow2_at_least(n: int, floor: int = 16) -> int:
    """Smallest power of two >= n and >= floor; tl.dot needs every tile dimension >= 16."""
    return max(floor, triton.next_power_of_2(n))


def dot_config(cache_dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """(operand dtype, input_precision) for the kernels' tl.dot calls on a cache of this dtype.

    Operands stay in the cache dtype (fp32 accumulation either way) except for bf16 under the
    interpreter, whose tl.dot multiplies bf16's raw uint16 storage: there they go up to fp32.
    fp32 operands get exact IEEE products so results match the torch path (tf32 would drop ~3
    decimal digits); the precision is ignored for fp16 / bf16 operands.
    """
    if cache_dtype == torch.bfloat16 and interpreting():
        return tl.float32, "ieee"
    operand = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if cache_dtype not in operand:
        raise ValueError(f"unsupported KV cache dtype {cache_dtype}")
    return operand[cache_dtype], "ieee" if cache_dtype == torch.float32 else "tf32"


LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: exp(x) == exp2(x * log2(e))


def check_softcap(softcap: float | None) -> None:
    """A soft cap c replaces each score s by c * tanh(s / c); only c > 0 (finite) means that."""
    if softcap is not None and not (0.0 < softcap < float("inf")):
        raise ValueError(f"attention soft cap {softcap} must be a positive finite number")


def log2_softcap(softcap: float | None) -> float:
    """The kernel argument for a soft cap: c * log2(e), or 0.0 (unread) without a cap.

    The kernels hold scores in base 2, s2 = s * log2(e). Capping s2 with c2 = c * log2(e) is the
    natural-units cap carried over exactly: c2 * tanh(s2 / c2) = log2(e) * c * tanh(s / c)."""
    check_softcap(softcap)
    return 0.0 if softcap is None else softcap * LOG2E


@triton.jit
def soft_cap(s: tl.tensor, cap: float) -> tl.tensor:
    """cap * tanh(s / cap), elementwise, for finite s (cap before masking: tanh(-inf) = -1).

    tanh from exp2 rather than libdevice so the interpreter runs it too; tanh(|x|) =
    (1 - e) / (1 + e) with e = exp(-2|x|) <= 1 never overflows, and the sign comes back after.
    Near 0, 1 - e cancels: the capped score is off by about cap * 2^-23 at most (6e-6 for
    Gemma 2's cap of 50), far below what moves a softmax weight."""
    x = s / cap
    e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0.0, -t, t)


def default_tile(dtype: torch.dtype) -> int:
    """Key/query tile length: 64 for 16-bit caches, 32 for fp32 so K, V and Q tiles of head_dim
    128 still fit in shared memory with software pipelining."""
    return 32 if dtype == torch.float32 else 64


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take strides for every dimension but assume the head dimension has stride 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches [num_blocks, block_size, Hkv, D] must share shape, dtype and strides (the
    kernels take one set of strides for both; KVStore.layer() gives such a pair)."""
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
            f"{tuple(v_cache.shape)} {v_cache.dtype} differ"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need equal strides and a contiguous head dim")


def check_window(window: int | None) -> None:
    """A sliding window W counts the keys a query sees, its own included: W >= 1."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window} must be at least 1")


@dataclass(frozen=True)
class PagedShapes:
    """What decode and prefill attention read off their checked operands."""

    q: torch.Tensor  # the queries [tokens, Hq, D], their head dimension contiguous
    block_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    softcap_log2: float  # the kernels' soft-cap argument (log2_softcap)


def paged_shapes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    window: int | None,
    softcap: float | None,
) -> PagedShapes:
    """Check queries against a cache pair [num_blocks, block_size, Hkv, D], a window and a soft
    cap (ValueError naming what does not fit), and read their shapes."""
    check_cache_pair(k_cache, v_cache)
    q = last_dim_contiguous(q)
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    check_window(window)
    cap = log2_softcap(softcap)  # validates it
    return PagedShapes(q, block_size, num_q_heads, num_kv_heads, head_dim, cap)


def paged_args(q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> tuple[float | int, ...]:
    """The arguments every paged attention kernel takes after its tensors, in their order: the
    softmax scale in base 2 (scale * log2(e)), q [T, Hq, D]'s strides by token and head, then
    the cache [num_blocks, block_size, Hkv, D]'s by block, offset and head (both with a
    contiguous head dimension)."""
    return (scale * LOG2E, q.stride(0), q.stride(1), *k_cache.stride()[:3])


def paged_constexprs(
    k_cache: torch.Tensor, group: int, window: int | None, use_softcap: bool
) -> dict[str, int | bool | str | tl.dtype]:
    """The constants the paged attention kernels (decode, its shared-prefix pass, prefill) are
    compiled for: the cache's block size and head dimension, `group` query heads per KV head,
    whether a window masks keys and a soft cap the scores, and the dot's operands (dot_config)."""
    _, block_size, _, head_dim = k_cache.shape
    dot_dtype, precision = dot_config(k_cache.dtype)
    return {
        "BLOCK_SIZE": block_size,
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "D_PAD": pow2_at_least(head_dim),
        "USE_WINDOW": window is not None,
        "USE_SOFTCAP": use_softcap,
        "DOT_DTYPE": dot_dtype,
        "DOT_PRECISION": precision,
    }


@triton.jit
def rounded(x: tl.tensor, out_ty: tl.constexpr) -> tl.tensor:
    """float32 x rounded to out_ty (to nearest, ties to even), still in float32. bfloat16 is
    rounded by hand: Triton's interpreter converts float32 to bfloat16 by truncation, and the
    tests run the kernel there; on a GPU this is what the conversion does anyway."""
    if out_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(out_ty).to(tl.float32)


@triton.jit
def cache_rows(
    table_row: tl.tensor,  # a sequence's (or shared prefix's) row of block ids
    keys: tl.tensor,  # key positions in that sequence
    mask: tl.tensor,  # the keys to look up; the others read block 0
    kv_head: int,
    stride_cb: int,
    stride_co: int,
    stride_ch: int,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
) -> tl.tensor:
    """Where each key's row of one KV head starts in a paged cache [num_blocks, block_size,
    Hkv, D]: its block through the block table, its offset in the block (int64 elements)."""
    block = tl.load(table_row + keys // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    return block * stride_cb + (keys % BLOCK_SIZE) * stride_co + kv_head * stride_ch


@triton.jit
def attend_paged_keys(
    q: tl.tensor,  # [ROWS, D_PAD] in DOT_DTYPE: the rows that read these keys
    k_cache_ptr: tl.tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr: tl.tensor,  # same layout and strides as k_cache
    table_row: tl.tensor,  # the sequence's (or shared prefix's) row of block ids
    kv_head: int,
    key_start: int,  # the keys [key_start, key_end) of that row, BLOCK_N at a time
    key_end: int,
    first_key: tl.tensor,  # [ROWS]: the first key each row sees; read only when MASK_FIRST
    last_key: tl.tensor,  # [ROWS]: the last key each row sees; read only when MASK_LAST
    qk_scale: float,  # softmax scale * log2(e)
    softcap: float,  # soft cap * log2(e); read only when USE_SOFTCAP
    stride_cb: int,
    stride_co: int,
    stride_ch: int,
    offs_d: tl.tensor,  # [D_PAD] arange
    d_valid: tl.tensor,  # [D_PAD] offs_d < HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,
    MASK_FIRST: tl.constexpr,
    MASK_LAST: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """The paged K/V loop every attention kernel runs (decode, its shared-prefix pass,
    prefill): each key's cache row gathered through the block table, scored against q, masked
    where a row does not see it, and folded into an online softmax begun here, whose float32
    state comes back (m_i [ROWS] its max in the log2 domain, floored at a finite -1e30 so that
    exp2(m_old - m_new) stays a number before a row's first visible key; l_i [ROWS] its sum;
    acc [ROWS, D_PAD] its output). A row that sees no key of a tile keeps its state."""
    m_i = tl.full([q.shape[0]], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    acc = tl.zeros([q.shape[0], q.shape[1]], dtype=tl.float32)
    for start in range(key_start, key_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # key positions
        n_valid = offs_n < key_end
        row = cache_rows(
            table_row, offs_n, n_valid, kv_head, stride_cb, stride_co, stride_ch, BLOCK_SIZE
        )
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        k = k.to(DOT_DTYPE)

        # [ROWS, BLOCK_N] scores in the log2 domain
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFTCAP:  # before the mask: the cap would turn -inf into a finite -softcap
            s = soft_cap(s, softcap)
        visible = n_valid[None, :]
        if MASK_LAST:  # causality (or a padded row: last_key -1)
            visible = visible & (offs_n[None, :] <= last_key[:, None])
        if MASK_FIRST:  # a later row's window starts later: exact per key, any alignment
            visible = visible & (offs_n[None, :] >= first_key[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = v.to(DOT_DTYPE)
        pv = tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)  # [ROWS, D_PAD]
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc
