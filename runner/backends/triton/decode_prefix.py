"""The prefix pass of the shared-prefix decode: a group's prefix read once for all its members.

One program takes one chunk of a group's members (shared_prefix.py), one KV head and one
partition of the prefix's keys, and scores every query head of that KV head for every member of
the chunk against those keys: its query tile is [members x GROUP, D] (GQA packed), so each key
row it loads serves all of them. It writes what the plain decode's partitions write (output
normalised by its own softmax sum, and the log2-sum-exp), into partition slots part_base + p of
each member's row, after the partitions of the member's own pass (decode.py); the reduce
(decode_reduce.py) merges both kinds exactly, as it merges any partitions.

With a sliding window each row masks the prefix keys before its own window start (its context
is read from the device): a key hidden from every row makes a row's partition empty, which
the reduce weighs 0 beside the member's own pass, never empty (it holds the new token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.backends.triton.common import paged_args, paged_constexprs, pow2_at_least
from runner.backends.triton.decode_reduce import attend_partition, partition_strides
from runner.backends.triton.shared_prefix import SharedPrefixPlan


@triton.jit
def _prefix_partition_kernel(
    q_ptr: tl.tensor,  # [S, Hq, D]
    k_cache_ptr: tl.tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr: tl.tensor,
    part_out_ptr: tl.tensor,  # [S, Hq, P, D] float32
    part_lse_ptr: tl.tensor,  # [S, Hq, P] float32
    context_lens_ptr: tl.tensor,  # [S] int32; read only when USE_WINDOW
    chunk_seqs_ptr: tl.tensor,  # [C, MEMBERS] int32, -1 past the chunk's last member
    chunk_tables_ptr: tl.tensor,  # [C, max_prefix_blocks] int32
    chunk_lens_ptr: tl.tensor,  # [C] int32 prefix tokens; 0: nothing to do
    qk_scale: float,
    stride_qt: int,
    stride_qh: int,
    stride_cb: int,
    stride_co: int,
    stride_ch: int,
    stride_ct: int,
    stride_os: int,
    stride_oh: int,
    stride_op: int,
    stride_ls: int,
    stride_lh: int,
    window: int,
    softcap: float,
    part_base: int,  # the first partition slot of the prefix pass (after the own passes')
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    MEMBERS: tl.constexpr,  # members a chunk holds at most
    ROWS: tl.constexpr,  # MEMBERS * GROUP rounded up to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    prefix_len = tl.load(chunk_lens_ptr + chunk)

    offs_r = tl.arange(0, ROWS)  # row r: member r // GROUP, query head r % GROUP of kv_head
    offs_d = tl.arange(0, D_PAD)
    in_chunk = offs_r < MEMBERS * GROUP
    seq = tl.load(chunk_seqs_ptr + chunk * MEMBERS + offs_r // GROUP, mask=in_chunk, other=-1)
    r_valid = seq >= 0
    seq = tl.where(r_valid, seq, 0).to(tl.int64)
    heads = kv_head * GROUP + offs_r % GROUP
    d_valid = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=r_valid[:, None] & d_valid[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [ROWS, D_PAD]
    first_key = offs_r  # unread without a window
    if USE_WINDOW:  # row r sees keys >= its own window start
        ctx = tl.load(context_lens_ptr + seq, mask=r_valid, other=0)
        first_key = ctx - window
    last_key = tl.where(r_valid, prefix_len, -1)  # a padded row sees no key

    # A partition past the prefix's end stores nothing (the reduce counts the member's prefix
    # partitions from its prefix length).
    attend_partition(
        q, k_cache_ptr, v_cache_ptr, chunk_tables_ptr + chunk.to(tl.int64) * stride_ct, kv_head,
        0, prefix_len, tl.program_id(2), first_key, last_key, qk_scale, softcap,
        part_out_ptr, part_lse_ptr, seq, heads, part_base, r_valid, offs_d, d_valid,
        stride_cb, stride_co, stride_ch, stride_os, stride_oh, stride_op, stride_ls, stride_lh,
        BLOCK_SIZE, BLOCK_N, PARTITION_SIZE, USE_WINDOW, True, USE_SOFTCAP, DOT_DTYPE,
        DOT_PRECISION, True,
    )  # fmt: skip


def prefix_partitions(max_prefix_len: int, partition_size: int) -> int:
    """Partition slots the prefix pass needs for prefixes up to `max_prefix_len` tokens."""
    return max(1, triton.cdiv(max_prefix_len, partition_size))


def prefix_pass(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    plan: SharedPrefixPlan,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    part_base: int,
    scale: float,
    partition_size: int,
    block_n: int,
    window: int | None,
    softcap_log2: float,
    use_softcap: bool,
) -> None:
    """Score every chunk's members against their prefix into partitions part_base.. of
    part_out [S, Hq, P, D] / part_lse [S, Hq, P] (float32), as decode_attention set them up."""
    num_chunks, members = plan.chunk_seqs.shape
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    grid = (num_chunks, num_kv_heads, prefix_partitions(plan.max_prefix_len, partition_size))
    _prefix_partition_kernel[grid](
        q,
        k_cache,
        v_cache,
        part_out,
        part_lse,
        context_lens,
        plan.chunk_seqs,
        plan.chunk_tables,
        plan.chunk_prefix_lens,
        *paged_args(q, k_cache, scale),
        plan.chunk_tables.stride(0),
        *partition_strides(part_out, part_lse),
        window or 0,
        softcap_log2,
        part_base,
        MEMBERS=members,
        ROWS=pow2_at_least(members * group),
        PARTITION_SIZE=partition_size,
        BLOCK_N=block_n,
        num_warps=8 if members * group > 64 else 4,
        **paged_constexprs(k_cache, group, window, use_softcap),
    )
