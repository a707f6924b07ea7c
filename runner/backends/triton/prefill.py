"""Triton prefill attention over a paged KV cache (flat varlen batch, causal with a prefix).

Each sequence s contributes query_len L = query_start_loc[s+1] - query_start_loc[s] new tokens
and has context_len C keys in the cache, *including* those L (store_kv already wrote them). New
token i sits at position C - L + i and attends to key positions <= C - L + i, so a cached prefix
(prefix cache hit or an earlier chunk of a chunked prefill) is read through the block table.
With a sliding window W it sees only keys > C - L + i - W, its last W tokens. With a soft cap c
(Gemma 2) each score s becomes c * tanh(s / c) before that mask and the softmax.

One program computes a [BLOCK_M, D] tile of queries of one sequence for one query head with an
online softmax (flash attention) in float32, walking the keys BLOCK_N at a time and gathering
every key's cache row through the block table, so BLOCK_N is independent of the cache block size.
A tile's keys run from the window start of its first query to the causal end of its last one;
keys in that span hidden from some of its queries (the two triangles) are masked per key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.backends.triton.common import (
    attend_paged_keys,
    default_tile,
    paged_args,
    paged_constexprs,
    paged_shapes,
)


@triton.jit
def _prefill_kernel(
    q_ptr: tl.tensor,  # [T, Hq, D]
    k_cache_ptr: tl.tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr: tl.tensor,  # same layout and strides as k_cache
    out_ptr: tl.tensor,  # [T, Hq, D]
    query_start_loc_ptr: tl.tensor,  # [S + 1] int32
    context_lens_ptr: tl.tensor,  # [S] int32
    block_tables_ptr: tl.tensor,  # [S, max_blocks] int32
    qk_scale: float,  # softmax scale * log2(e)
    stride_qt: int,
    stride_qh: int,
    stride_cb: int,
    stride_co: int,
    stride_ch: int,
    stride_bt: int,
    stride_ot: int,
    stride_oh: int,
    window: int,  # sliding window in keys; read only when USE_WINDOW
    softcap: float,  # soft cap * log2(e) (log2_softcap); read only when USE_SOFTCAP
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head (GQA)
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two >= 16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,  # False: the whole causal context, at no extra cost
    USE_SOFTCAP: tl.constexpr,  # False: raw scores, at no extra cost
    DOT_DTYPE: tl.constexpr,  # tl.dot operand dtype (see dot_config)
    DOT_PRECISION: tl.constexpr,
) -> None:
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = tl.load(context_lens_ptr + seq)
    first_pos = ctx_len - q_len  # position of the sequence's first new token

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index inside the sequence
    offs_d = tl.arange(0, D_PAD)
    m_valid = offs_m < q_len
    d_valid = offs_d < HEAD_DIM
    q_pos = first_pos + offs_m  # [BLOCK_M] absolute positions

    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, D_PAD]
    q = q.to(DOT_DTYPE)

    # Causality: the tile's last query sees keys < first_pos + (tile + 1) * BLOCK_M; a tile past
    # the sequence's end (grid is sized for the longest query) sees nothing and stores nothing.
    kv_end = tl.minimum(ctx_len, first_pos + (tile + 1) * BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)
    # Window: the tile's first query (the earliest window start) sees keys >= its position - W + 1;
    # the loop starts there, so keys before every query's window are never loaded.
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(first_pos + tile * BLOCK_M - window + 1, 0)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Each query sees keys up to its own position, and within a window from its window start
    # (a valid query always sees itself, so its final l_i > 0).
    m_i, l_i, acc = attend_paged_keys(
        q, k_cache_ptr, v_cache_ptr, table_row, kv_head, kv_start, kv_end,
        q_pos - window + 1, q_pos, qk_scale, softcap, stride_cb, stride_co, stride_ch, offs_d,
        d_valid, BLOCK_SIZE, BLOCK_N, USE_WINDOW, True, USE_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
    )  # fmt: skip

    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # padded rows: never stored, but avoid 0/0
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over their cached context; with a sliding
    `window` W >= 1 the token at position p sees only keys p - W < j <= p. A `softcap` c > 0
    turns each score s = (q . k) * scale into c * tanh(s / c) before the mask and softmax.

    q [T, Hq, D]; k_cache / v_cache [num_blocks, block_size, Hkv, D] already holding the new
    tokens' K/V; query_start_loc [S+1] int32; context_lens [S] int32 (including the new tokens);
    block_tables [S, max_blocks] int32. `max_query_len` (a host int) sizes the grid; it is read
    from the tensor, with a device sync, when not given. Returns [T, Hq, D] in q's dtype.
    """
    shapes = paged_shapes(q, k_cache, v_cache, window, softcap)
    q, num_tokens = shapes.q, q.shape[0]
    num_q_heads, num_kv_heads = shapes.num_q_heads, shapes.num_kv_heads
    out = torch.empty_like(q)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    tile = default_tile(k_cache.dtype)
    block_m = block_m or tile
    block_n = block_n or tile
    for size in (block_m, block_n):  # tl.arange needs powers of two, tl.dot tiles >= 16
        if size < 16 or size & (size - 1):
            raise ValueError(f"block_m / block_n must be powers of two >= 16, got {size}")
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_q_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        context_lens,
        block_tables,
        *paged_args(q, k_cache, scale),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        window or 0,  # ignored without a window (USE_WINDOW=False)
        shapes.softcap_log2,  # ignored without a cap (USE_SOFTCAP=False)
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **paged_constexprs(k_cache, num_q_heads // num_kv_heads, window, softcap is not None),
    )
    return out
