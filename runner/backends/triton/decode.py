"""Triton decode attention over a paged KV cache, split along the context (flash-decoding).

Decode has one query per sequence, so a grid of (sequences x KV heads) alone leaves most of a
GPU idle for small batches with long contexts. The keys each query sees are therefore cut into
partitions of `partition_size` keys, one program each; every program writes its partial result
(output normalised by its own softmax sum, plus the log2-sum-exp of its scores) and a second,
tiny kernel (runner/backends/triton/decode_reduce.py) combines the partitions. With a single
partition the first kernel writes the final output directly and the reduce is skipped.

Sliding window W: the query at position C - 1 sees keys C - W .. C - 1 only, so the partitions
start at the window start max(C - W, 0) instead of 0. Keys before it are never loaded, no
partition lies wholly before it, and the grid needs cdiv(min(C, W), partition_size) partitions.

Soft cap c (Gemma 2): each score s becomes c * tanh(s / c) before the softmax; the partitions'
log-sum-exps are then of capped scores, so the reduce combines them unchanged.

A program handles all GROUP query heads that share one KV head, so K/V rows are loaded once per
group (GQA); the group is padded to 16 rows because tl.dot needs tiles of at least 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.backends.triton.common import (
    LOG2E,
    PagedShapes,
    default_tile,
    paged_args,
    paged_constexprs,
    paged_shapes,
    pow2_at_least,
)
from runner.backends.triton.decode_prefix import prefix_partitions, prefix_pass
from runner.backends.triton.decode_reduce import (
    attend_partition,
    combine_partitions,
    own_keys_start,
    partition_strides,
)
from runner.backends.triton.shared_prefix import SharedPrefixPlan

__all__ = ["DEFAULT_PARTITION_SIZE", "LOG2E", "decode_attention"]
DEFAULT_PARTITION_SIZE = 512  # keys per partition; a multiple of every tile size used


@triton.jit
def _decode_partition_kernel(
    q_ptr: tl.tensor,  # [S, Hq, D]: one query per sequence
    k_cache_ptr: tl.tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr: tl.tensor,  # same layout and strides as k_cache
    part_out_ptr: tl.tensor,  # [S, Hq, P, D] (float32), or the final [S, Hq, D] output when P == 1
    part_lse_ptr: tl.tensor,  # [S, Hq, P] float32 log2-sum-exp; unused when not WRITE_LSE
    context_lens_ptr: tl.tensor,  # [S] int32
    block_tables_ptr: tl.tensor,  # [S, max_blocks] int32
    prefix_lens_ptr: tl.tensor,  # [S] int32 shared tokens read by the prefix pass; USE_PREFIX
    qk_scale: float,  # softmax scale * log2(e)
    stride_qt: int,
    stride_qh: int,
    stride_cb: int,
    stride_co: int,
    stride_ch: int,
    stride_bt: int,
    stride_os: int,
    stride_oh: int,
    stride_op: int,
    stride_ls: int,
    stride_lh: int,
    window: int,  # sliding window in keys; read only when USE_WINDOW
    softcap: float,  # soft cap * log2(e) (log2_softcap); read only when USE_SOFTCAP
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    USE_WINDOW: tl.constexpr,  # False: the whole context, at no extra cost
    USE_SOFTCAP: tl.constexpr,  # False: raw scores, at no extra cost
    USE_PREFIX: tl.constexpr,  # False: no shared-prefix pass, every key read here
    DOT_DTYPE: tl.constexpr,  # tl.dot operand dtype (see dot_config)
    DOT_PRECISION: tl.constexpr,
) -> None:
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)
    # Partitions tile the visible keys [win_start, ctx_len) from the window start, so every key
    # a program loads is visible (no per-key window mask) and each partition of this sequence
    # that the reduce reads holds at least one key.
    # The shared prefix's keys are the prefix pass's (decode_prefix.py).
    win_start = own_keys_start(ctx_len, window, prefix_lens_ptr + seq, USE_WINDOW, USE_PREFIX)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + offs_g  # query heads of this group
    g_valid = offs_g < GROUP
    d_valid = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [GROUP_PAD, D_PAD]
    q = q.to(DOT_DTYPE)

    # Every key of the partition is at or after win_start: visible, no per-key mask. Partitions
    # past the end of a short sequence's keys write nothing (the reduce reads only the
    # partitions that start before ctx_len).
    attend_partition(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head,
        win_start, ctx_len, tl.program_id(2), ctx_len, ctx_len, qk_scale, softcap,
        part_out_ptr, part_lse_ptr, seq.to(tl.int64), heads, 0, g_valid, offs_d, d_valid,
        stride_cb, stride_co, stride_ch, stride_os, stride_oh, stride_op, stride_ls, stride_lh,
        BLOCK_SIZE, BLOCK_N, PARTITION_SIZE, False, False, USE_SOFTCAP, DOT_DTYPE,
        DOT_PRECISION, WRITE_LSE,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    *,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    shared_prefix: SharedPrefixPlan | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context: all of it, or with a
    sliding `window` W >= 1 its last W keys (the new token's own included). A `softcap` c > 0
    turns each score s = (q . k) * scale into c * tanh(s / c) before the softmax.

    q [S, Hq, D] (token s belongs to sequence s); k_cache / v_cache [num_blocks, block_size,
    Hkv, D] already holding the new token; context_lens [S] int32 including it; block_tables
    [S, max_blocks] int32. `max_context_len` (host int, an upper bound of context_lens) sets
    the number of partitions; it is read from the tensor, with a device sync, when not given.
    `partition_size` must be a power-of-two multiple of 16. Returns [S, Hq, D] in q's dtype.

    With a `shared_prefix` plan (shared_prefix.py), each group's prefix is read once for all
    its members by the prefix pass (decode_prefix.py), each sequence's own partitions start
    after its prefix, and the reduce merges both: the same result, fewer bytes read. The plan
    changes no grid that depends on the step (its tensors may be a graph's static ones).
    """
    shapes = paged_shapes(q, k_cache, v_cache, window, softcap)
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    q = shapes.q
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    block_n = _key_tile(k_cache.dtype, block_n, partition_size)
    own_parts, num_parts = _partition_counts(max_context_len, window, partition_size, shared_prefix)
    single = num_parts == 1
    part_out, part_lse = _partials(out, num_parts)
    _own_partitions(
        shapes, k_cache, v_cache, context_lens, block_tables, part_out, part_lse, scale,
        partition_size, block_n, window, softcap is not None, shared_prefix,
    )  # fmt: skip
    if single:
        return out
    if shared_prefix is not None:
        prefix_pass(
            q, k_cache, v_cache, context_lens, shared_prefix, part_out, part_lse, own_parts,
            scale, partition_size, block_n, window, shapes.softcap_log2, softcap is not None,
        )  # fmt: skip
    prefix = None if shared_prefix is None else (shared_prefix.seq_prefix_lens, own_parts)
    combine_partitions(part_out, part_lse, out, context_lens, partition_size, window, prefix)
    return out


def _key_tile(cache_dtype: torch.dtype, block_n: int | None, partition_size: int) -> int:
    """The keys a program scores at a time: `block_n`, or the dtype's default tile, at most a
    partition; a power of two >= 16 (the interpreter takes any; the compiler not)."""
    block_n = min(block_n or default_tile(cache_dtype), partition_size)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    return block_n


def _partition_counts(
    max_context_len: int,
    window: int | None,
    partition_size: int,
    shared_prefix: SharedPrefixPlan | None,
) -> tuple[int, int]:
    """(the sequences' own partitions, all partitions): the prefix pass's come after theirs. A
    query sees at most min(C, W) keys; partitions start at its window start (see above)."""
    max_keys = max_context_len if window is None else min(max_context_len, window)
    own_parts = max(1, triton.cdiv(max_keys, partition_size))
    if shared_prefix is None:
        return own_parts, own_parts
    return own_parts, own_parts + prefix_partitions(shared_prefix.max_prefix_len, partition_size)


def _partials(out: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the partitions go: part_out [S, Hq, P, D] and part_lse [S, Hq, P] float32; for
    one partition the kernel writes the final output, viewed as [S, Hq, P=1, D]."""
    if num_parts == 1:
        return out.unsqueeze(2), out
    part_out = out.new_empty((*out.shape[:2], num_parts, out.shape[2]), dtype=torch.float32)
    return part_out, out.new_empty((*out.shape[:2], num_parts), dtype=torch.float32)


def _own_partitions(
    shapes: PagedShapes,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    scale: float,
    partition_size: int,
    block_n: int,
    window: int | None,
    use_softcap: bool,
    shared_prefix: SharedPrefixPlan | None,
) -> None:
    """Launch the partition kernel over every sequence's own keys into part_out [S, Hq, P, D]
    and part_lse [S, Hq, P] (one partition: part_out is the output and no lse is written)."""
    q, group = shapes.q, shapes.num_q_heads // shapes.num_kv_heads
    num_parts = part_out.shape[2]
    _decode_partition_kernel[(q.shape[0], shapes.num_kv_heads, num_parts)](
        q,
        k_cache,
        v_cache,
        part_out,
        part_lse,
        context_lens,
        block_tables,
        context_lens if shared_prefix is None else shared_prefix.seq_prefix_lens,
        *paged_args(q, k_cache, scale),
        block_tables.stride(0),
        *partition_strides(part_out, part_lse),
        window or 0,  # ignored without a window (USE_WINDOW=False)
        shapes.softcap_log2,  # ignored without a cap (USE_SOFTCAP=False)
        GROUP_PAD=pow2_at_least(group),
        PARTITION_SIZE=partition_size,
        BLOCK_N=block_n,
        WRITE_LSE=num_parts > 1,
        USE_PREFIX=shared_prefix is not None,
        **paged_constexprs(k_cache, group, window, use_softcap),
    )
