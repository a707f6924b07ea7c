"""Batch-invariant paged attention for deterministic mode on CUDA (docs/DETERMINISM.md).

The default Triton path sums a row's attention in an order its neighbours choose: a prompt's
rows go through the prefill kernel in tiles of queries and keys, a decode through split-K
partitions sized by the step (decode.py, decode_reduce.py), and decodes sharing a prefix read
it once in another order (shared_prefix.py). So the same token differs, in its last bits,
between a prompt's row, a decode, a cached prefix's next chunk and a batch of 16 others.

Here every query row is computed alone and in one order, whatever the step holds: the keys
0 .. p of a row at position p fall into splits of SPLIT keys from key 0 (a multiple of every
KV block size up to SPLIT, so a split never starts inside a block); a program per (row, query
head, split) walks its split's keys BLOCK_N at a time with an online softmax, and a second
kernel merges a row's splits in index order. Which splits a row has, and where its chunks
start, depend on p (and the window) only; a key after p, or before the window, is masked with
its load (0, never read from the cache) and its score -inf, the same in a prompt, where later
keys exist, as in a decode, where they do not. No tile holds another row, so no product of
another row's values takes part; the prefill, the decode and a cached prefix's chunk run the
same two kernels with the same constants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.attention.backend import AttentionBackend, AttentionCall, Capabilities
from runner.attention.metadata import AttentionMetadata
from runner.backends.triton.attention import store_kv
from runner.backends.triton.common import (
    cache_rows,
    check_cache_pair,
    check_window,
    last_dim_contiguous,
    log2_softcap,
    paged_args,
    pow2_at_least,
    soft_cap,
)

SPLIT = 256  # keys a split holds: a multiple of every block size the engine takes up to 256
BLOCK_N = 16  # keys a program scores at a time within its split
PARTIALS_BYTES = 256 << 20  # the most a launch's per-split partials take


@triton.jit
def _split_kernel(
    q_ptr: tl.tensor,  # [T, Hq, D]
    k_cache_ptr: tl.tensor,  # [blocks, B, Hkv, D]
    v_cache_ptr: tl.tensor,
    seq_of_ptr: tl.tensor,  # [T] int32: each row's sequence
    query_start_ptr: tl.tensor,  # [S + 1] int32
    context_lens_ptr: tl.tensor,  # [S] int32
    block_tables_ptr: tl.tensor,  # [S, max_blocks] int32
    part_acc_ptr: tl.tensor,  # [T, Hq, NUM_SPLITS, D] float32
    part_ml_ptr: tl.tensor,  # [T, Hq, NUM_SPLITS, 2] float32: (max, sum) in base 2
    scale_log2: float,  # scale * log2(e)
    stride_qt: int,
    stride_qh: int,
    stride_cb: int,
    stride_co: int,
    stride_ch: int,
    stride_bt: int,
    window: int,
    softcap: float,  # soft cap * log2(e), read only with USE_SOFTCAP
    NUM_SPLITS: int,  # reserved by the launch (the step's longest context), not the row's own
    row0: int,  # the launch's first row: the partials hold rows row0 .. row0 + grid rows - 1
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's block size
    SPLIT_KEYS: tl.constexpr,
    BN: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
) -> None:
    local = tl.program_id(0).to(tl.int64)
    row = row0 + local
    head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_of_ptr + row).to(tl.int64)
    start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - start
    pos = tl.load(context_lens_ptr + seq) - query_len + (row - start)  # this row's position
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    split_lo = split * SPLIT_KEYS
    split_hi = tl.minimum(split_lo + SPLIT_KEYS, pos + 1)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    out = (local * tl.num_programs(1) + head) * NUM_SPLITS + split
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + offs_d, mask=d_mask, other=0.0)
    q = q.to(tl.float32)
    kv_head = head // GROUP
    offs_n = tl.arange(0, BN)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((D_PAD,), tl.float32)
    # Chunks of BN at multiples of BN, from the split's first key or the chunk that holds the
    # window's first: the same chunks for this row in any step, each with a key it sees. A
    # split with none of its keys (past the row, before its window) runs no chunk and leaves
    # (-inf, 0, 0), which the merge skips.
    first = tl.maximum(split_lo, (lo // BN) * BN)
    for n0 in range(first, split_hi, BN):
        keys = n0 + offs_n
        seen = (keys <= pos) & (keys >= lo)
        rows = cache_rows(
            block_tables_ptr + seq * stride_bt, keys, seen, kv_head, stride_cb, stride_co,
            stride_ch, BLOCK_SIZE,
        )  # fmt: skip
        at = rows[:, None] + offs_d[None, :]
        kv_mask = seen[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * k, axis=1) * scale_log2  # [BN], base 2
        if USE_SOFTCAP:
            s = soft_cap(s, softcap)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp2(m - m_new)
        p = tl.where(seen, tl.exp2(s - m_new), 0.0)
        v = tl.load(v_cache_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(part_ml_ptr + out * 2, m)
    tl.store(part_ml_ptr + out * 2 + 1, total)
    tl.store(part_acc_ptr + out * D_PAD + offs_d, acc)


@triton.jit
def _merge_kernel(
    part_acc_ptr: tl.tensor,  # [T, Hq, NUM_SPLITS, D_PAD]
    part_ml_ptr: tl.tensor,  # [T, Hq, NUM_SPLITS, 2]
    out_ptr: tl.tensor,  # [T, Hq, D], q's dtype
    stride_ot: int,
    stride_oh: int,
    NUM_SPLITS: int,
    row0: int,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
) -> None:
    """A row's splits merged in index order 0 .. NUM_SPLITS - 1: first their maximum (exact in
    any order), then the rescaled sums one split after the other. An empty split adds nothing:
    it is skipped, not added as 0 (which could turn a -0 into +0)."""
    local = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (local * tl.num_programs(1) + head) * NUM_SPLITS
    offs_d = tl.arange(0, D_PAD)
    top = tl.full((), float("-inf"), tl.float32)
    for i in range(NUM_SPLITS):
        top = tl.maximum(top, tl.load(part_ml_ptr + (base + i) * 2))
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((D_PAD,), tl.float32)
    for i in range(NUM_SPLITS):
        m_i = tl.load(part_ml_ptr + (base + i) * 2)
        if m_i > float("-inf"):
            weight = tl.exp2(m_i - top)
            total += tl.load(part_ml_ptr + (base + i) * 2 + 1) * weight
            acc += tl.load(part_acc_ptr + (base + i) * D_PAD + offs_d) * weight
    out = acc / total
    dst = out_ptr + (row0 + local) * stride_ot + head * stride_oh + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def batch_invariant_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    split_keys: int = SPLIT,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the caches (the new K/V already stored), each row by
    itself in the module docstring's order; [T, Hq, D] in q's dtype. The number of splits a
    launch reserves follows the step's longest context (max_context_len); a row's own splits,
    and so its bits, follow its position only."""
    check_window(window)
    check_cache_pair(k_cache, v_cache)
    q = last_dim_contiguous(q)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    if split_keys % BLOCK_N or (split_keys % block_size and block_size % split_keys):
        raise ValueError(
            f"splits of {split_keys} keys must be a multiple of {BLOCK_N} and align with the "
            f"block size {block_size}"
        )
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    seqs = torch.arange(meta.num_seqs, device=q.device, dtype=torch.int32)
    seq_of = torch.repeat_interleave(seqs, query_lens, output_size=num_tokens)
    splits = max(1, triton.cdiv(meta.max_context_len, split_keys))
    d_pad = pow2_at_least(head_dim, floor=1)
    # Rows in launches of at most PARTIALS_BYTES of partials (a long context's splits times a
    # whole prompt's rows would not fit); a row's result does not depend on its launch.
    per_row = num_heads * splits * (d_pad + 2) * 4
    rows = max(1, min(num_tokens, PARTIALS_BYTES // per_row))
    part_acc = torch.empty(rows, num_heads, splits, d_pad, device=q.device)
    part_ml = torch.empty(rows, num_heads, splits, 2, device=q.device)

    def launch(row0: int, n: int) -> None:
        _split_kernel[(n, num_heads, splits)](
            q,
            k_cache,
            v_cache,
            seq_of,
            meta.query_start_loc,
            meta.context_lens,
            meta.block_tables,
            part_acc,
            part_ml,
            *paged_args(q, k_cache, scale),
            meta.block_tables.stride(0),
            window or 0,
            log2_softcap(softcap),
            splits,
            row0,
            GROUP=num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            BLOCK_SIZE=block_size,
            SPLIT_KEYS=split_keys,
            BN=BLOCK_N,
            USE_WINDOW=window is not None,
            USE_SOFTCAP=softcap is not None,
        )
        _merge_kernel[(n, num_heads)](
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            row0,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
        )

    for row0 in range(0, num_tokens, rows):
        launch(row0, min(rows, num_tokens - row0))
    return out


def batch_invariant_paged_attention(call: AttentionCall, split_keys: int = SPLIT) -> torch.Tensor:
    """Paged attention's contract (runner/attention/backend.py AttentionCall): store the new
    K/V at their slots, then attend each row alone. Never the shared-prefix path: it sums a
    prefix in another order."""
    store_kv(call.k, call.v, call.k_cache, call.v_cache, call.meta.slot_mapping)
    return batch_invariant_attention(
        call.q, call.k_cache, call.v_cache, call.meta, call.scale,
        window=call.window, softcap=call.softcap, split_keys=split_keys,
    )  # fmt: skip


def batch_invariant_triton_backend() -> AttentionBackend:
    """Deterministic mode's attention on CUDA (or in Triton's interpreter): deterministic and
    nothing else, so neither the decode graphs (which capture the default kernels and the
    shared-prefix plan) nor the fused elementwise path of the default Triton backend are taken
    for it."""
    return AttentionBackend(
        "triton-deterministic",
        batch_invariant_paged_attention,
        Capabilities(deterministic=True, triton_products=True),
    )
