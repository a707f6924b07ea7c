"""The partitions of the split-K decode (runner/backends/triton/decode.py): how one is attended
and written, and the second pass that combines them.

The partition kernels (the sequences' own, and the shared-prefix pass of decode_prefix.py) cut
what one decode query attends to (its whole context, or its last `window` keys) into partitions
of PARTITION_SIZE keys starting at the window start, and write for each partition its output
normalised by its own softmax sum plus the log2-sum-exp of its scores (attend_partition). The
reduce kernel merges them into the softmax over all the keys, one program per (sequence, query
head), reading how many partitions its sequence has from the device context_lens so that a fixed
grid (CUDA graphs) serves every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.backends.triton.common import attend_paged_keys, pow2_at_least


@triton.jit
def own_keys_start(
    ctx_len: tl.tensor,
    window: int,  # read only when USE_WINDOW
    prefix_len_ptr: tl.tensor,  # the sequence's shared-prefix length; read only when USE_PREFIX
    USE_WINDOW: tl.constexpr,
    USE_PREFIX: tl.constexpr,
) -> tl.tensor:
    """The first key of a sequence's own partitions, which tile [start, ctx_len): its window
    start, or past that the end of its shared prefix (whose keys the prefix pass reads)."""
    start = 0
    if USE_WINDOW:
        start = tl.maximum(ctx_len - window, 0)
    if USE_PREFIX:
        start = tl.maximum(start, tl.load(prefix_len_ptr))
    return start


@triton.jit
def store_partition(
    part_out_ptr: tl.tensor,  # [S, Hq, P, D]
    part_lse_ptr: tl.tensor,  # [S, Hq, P] float32; unused when not WRITE_LSE
    seq: tl.tensor,  # the rows' sequences (int64)
    heads: tl.tensor,  # [ROWS] their query heads
    slot: int,  # the partition slot written
    acc: tl.tensor,  # [ROWS, D_PAD] float32: the online softmax's output
    m_i: tl.tensor,  # [ROWS] its max
    l_i: tl.tensor,  # [ROWS] its sum (0: the row saw no key)
    has_keys: tl.tensor,  # whether the partition holds any key: else nothing is stored
    out_mask: tl.tensor,  # [ROWS, D_PAD] which elements are real
    row_mask: tl.tensor,  # [ROWS] which rows are real
    offs_d: tl.tensor,
    stride_os: int,
    stride_oh: int,
    stride_op: int,
    stride_ls: int,
    stride_lh: int,
    WRITE_LSE: tl.constexpr,
) -> None:
    """One partition as the reduce reads it: the output normalised by its own softmax sum and
    the log2-sum-exp of its scores (a row that saw no key: output 0, log-sum-exp -1e30, which
    the reduce weighs 0). where() rather than `mask & scalar`: the interpreter turns
    `tensor & scalar-bool` into an int array that tl.store rejects."""
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / safe_l[:, None]
    out_rows = seq * stride_os + heads * stride_oh + slot * stride_op
    tl.store(
        part_out_ptr + out_rows[:, None] + offs_d[None, :],
        out.to(part_out_ptr.dtype.element_ty),
        mask=tl.where(has_keys, out_mask, False),
    )
    if WRITE_LSE:
        lse = m_i + tl.log2(safe_l)
        lse_ptr = part_lse_ptr + seq * stride_ls + heads * stride_lh + slot
        tl.store(lse_ptr, lse, mask=tl.where(has_keys, row_mask, False))


@triton.jit
def attend_partition(
    q: tl.tensor,  # [ROWS, D_PAD] in DOT_DTYPE: the rows that read these keys
    k_cache_ptr: tl.tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr: tl.tensor,  # same layout and strides as k_cache
    table_row: tl.tensor,  # the block ids of the keys' row (a sequence's, or a shared prefix's)
    kv_head: int,
    key_base: int,  # the partitioned keys are [key_base, key_limit) of that row
    key_limit: tl.tensor,
    part: int,  # this partition: the PARTITION_SIZE keys from key_base + part * PARTITION_SIZE
    first_key: tl.tensor,  # [ROWS] as attend_paged_keys reads them
    last_key: tl.tensor,
    qk_scale: float,
    softcap: float,
    part_out_ptr: tl.tensor,  # [S, Hq, P, D]
    part_lse_ptr: tl.tensor,  # [S, Hq, P] float32; unused when not WRITE_LSE
    seq: tl.tensor,  # the rows' sequences (int64)
    heads: tl.tensor,  # [ROWS] their query heads
    slot_base: int,  # the partition is written to slot slot_base + part
    row_mask: tl.tensor,  # [ROWS] which rows are real
    offs_d: tl.tensor,  # [D_PAD] arange
    d_valid: tl.tensor,  # [D_PAD] offs_d < HEAD_DIM
    stride_cb: int,
    stride_co: int,
    stride_ch: int,
    stride_os: int,
    stride_oh: int,
    stride_op: int,
    stride_ls: int,
    stride_lh: int,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    MASK_FIRST: tl.constexpr,
    MASK_LAST: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WRITE_LSE: tl.constexpr,
) -> None:
    """One partition of a split decode, as every partition kernel runs it: its keys attended
    through the block table (attend_paged_keys) and the result stored as the reduce reads it
    (store_partition). A partition that starts at or past key_limit stores nothing."""
    part_start = key_base + part * PARTITION_SIZE
    part_end = tl.minimum(key_limit, part_start + PARTITION_SIZE)  # <= part_start: no key
    m_i, l_i, acc = attend_paged_keys(
        q, k_cache_ptr, v_cache_ptr, table_row, kv_head, part_start, part_end, first_key,
        last_key, qk_scale, softcap, stride_cb, stride_co, stride_ch, offs_d, d_valid,
        BLOCK_SIZE, BLOCK_N, MASK_FIRST, MASK_LAST, USE_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
    )  # fmt: skip
    store_partition(
        part_out_ptr, part_lse_ptr, seq, heads, slot_base + part, acc, m_i, l_i,
        part_start < key_limit, row_mask[:, None] & d_valid[None, :], row_mask, offs_d,
        stride_os, stride_oh, stride_op, stride_ls, stride_lh, WRITE_LSE,
    )  # fmt: skip


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr: tl.tensor,  # [S, Hq, P, D] float32, each partition normalised by its own sum
    part_lse_ptr: tl.tensor,  # [S, Hq, P] float32 log2-sum-exp of each partition's scores
    out_ptr: tl.tensor,  # [S, Hq, D]
    context_lens_ptr: tl.tensor,  # [S] int32
    prefix_lens_ptr: tl.tensor,  # [S] int32 shared tokens of the prefix pass; USE_PREFIX
    stride_ps: int,
    stride_ph: int,
    stride_pp: int,
    stride_ls: int,
    stride_lh: int,
    stride_os: int,
    stride_oh: int,
    window: int,  # sliding window in keys; read only when USE_WINDOW
    prefix_base: int,  # partitions prefix_base.. hold the prefix pass's results; USE_PREFIX
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    P_PAD: tl.constexpr,  # number of partitions rounded up to a power of two
    USE_WINDOW: tl.constexpr,
    USE_PREFIX: tl.constexpr,  # a shared-prefix pass wrote partitions from prefix_base on
) -> None:
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)
    # The partitions tile [win_start, ctx_len), each of them non-empty; only these were written
    # for this sequence (the grid is sized for the longest one), so no partition without a key
    # ever enters the max or the sum below.
    # The own pass starts after a shared prefix, which has partitions apart.
    win_start = own_keys_start(ctx_len, window, prefix_lens_ptr + seq, USE_WINDOW, USE_PREFIX)
    num_parts = tl.cdiv(ctx_len - win_start, PARTITION_SIZE)

    offs_p = tl.arange(0, P_PAD)
    offs_d = tl.arange(0, D_PAD)
    p_valid = offs_p < num_parts
    if USE_PREFIX:
        prefix_parts = tl.cdiv(tl.load(prefix_lens_ptr + seq), PARTITION_SIZE)
        p_valid = p_valid | ((offs_p >= prefix_base) & (offs_p < prefix_base + prefix_parts))
    d_valid = offs_d < HEAD_DIM
    lse_row = part_lse_ptr + seq.to(tl.int64) * stride_ls + head * stride_lh
    lse = tl.load(lse_row + offs_p, mask=p_valid, other=float("-inf"))  # [P_PAD]
    # Partition j holds o_j = sum_j(e^s v) / l_j and lse_j = log2(l_j) (max included), so the
    # full softmax is sum_j w_j o_j / sum_j w_j with w_j = 2^(lse_j - max lse).
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    weight = tl.where(p_valid, weight, 0.0)
    part_row = part_out_ptr + seq.to(tl.int64) * stride_ps + head * stride_ph
    parts = tl.load(
        part_row + offs_p[:, None] * stride_pp + offs_d[None, :],
        mask=p_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [P_PAD, D_PAD]
    total = tl.sum(weight, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(weight[:, None] * parts, axis=0) / total
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


def partition_strides(part_out: torch.Tensor, part_lse: torch.Tensor) -> tuple[int, ...]:
    """The strides the partition kernels take for part_out [S, Hq, P, D] (sequence, head,
    partition) and part_lse [S, Hq, P] (sequence, head), both contiguous in their last dim."""
    return (*part_out.stride()[:3], *part_lse.stride()[:2])


def combine_partitions(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    context_lens: torch.Tensor,
    partition_size: int,
    window: int | None,
    prefix: tuple[torch.Tensor, int] | None = None,
) -> None:
    """Merge part_out [S, Hq, P, D] float32 / part_lse [S, Hq, P] float32, as the partition
    kernel wrote them for the same `partition_size` and `window`, into out [S, Hq, D]. With
    `prefix` (each sequence's shared-prefix length [S] int32, the first prefix partition), the
    own partitions start after the prefix and the prefix pass's follow from that slot."""
    num_seqs, num_q_heads, num_parts, head_dim = part_out.shape
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        part_out,
        part_lse,
        out,
        context_lens,
        context_lens if prefix is None else prefix[0],
        *partition_strides(part_out, part_lse),
        out.stride(0),
        out.stride(1),
        window or 0,  # ignored without a window (USE_WINDOW=False)
        0 if prefix is None else prefix[1],
        HEAD_DIM=head_dim,
        D_PAD=pow2_at_least(head_dim),
        PARTITION_SIZE=partition_size,
        P_PAD=triton.next_power_of_2(num_parts),
        USE_WINDOW=window is not None,
        USE_PREFIX=prefix is not None,
    )
