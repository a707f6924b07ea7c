"""Sliding-window attention in the Triton kernels against a dense float32 reference.

A query at position p sees keys p - W < j <= p. The reference reads each sequence's keys through
its block table and applies that mask to a full softmax; the kernels must agree for windows
shorter than a block, not aligned to blocks or tiles, longer than the context, and of 1. Keys
that no query of a sequence can see are filled with NaN: a kernel that loads them (instead of
skipping them) turns its output into NaN, so these tests check that work is skipped, not masked.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from runner.attention.metadata import AttentionMetadata
from runner.backends.triton.attention import (
    decode_attention,
    prefill_attention,
    store_kv,
    triton_paged_attention,
)
from runner.backends.triton.common import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1"
)
HEAD_DIM, KV_HEADS = 32, 2
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] new keys, not yet in the caches
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    group: int,
    window: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """seqs: (cached prefix, new tokens). Blocks are scattered over a pool with spare blocks of
    noise; cached keys before the earliest window start of their sequence hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    contexts = [p + n for p, n in seqs]
    counts = [math.ceil(c / block_size) for c in contexts]
    num_blocks = sum(counts) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[sum(counts[:s]) : sum(counts[: s + 1])] for s in range(len(seqs))]
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    for (prefix, _), table in zip(seqs, tables, strict=True):
        hidden = 0 if window is None else max(prefix - window + 1, 0)  # first query: p = prefix
        for pos in range(hidden):  # no query of this sequence may read these
            k_cache[table[pos // block_size], pos % block_size] = float("nan")
            v_cache[table[pos // block_size], pos % block_size] = float("nan")
    num_tokens = sum(n for _, n in seqs)
    q = torch.randn(num_tokens, KV_HEADS * group, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    meta = AttentionMetadata.build([n for _, n in seqs], contexts, tables, block_size, DEVICE)
    to = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return Case(to(q), to(k), to(v), to(k_cache), to(v_cache), meta)


def reference(
    case: Case, scale: float, window: int | None, softcap: float | None = None
) -> torch.Tensor:
    """Dense float64 attention from the case's caches plus its new K/V, scattered by plain
    indexing; with a soft cap c (Gemma 2's: test_triton_softcap.py) each score s becomes
    c * tanh(s / c) before the mask. Returns [T, Hq, D] on the CPU."""
    meta = case.meta
    k_cache, v_cache = case.k_cache.cpu().double(), case.v_cache.cpu().double()
    blocks, block_size = k_cache.shape[:2]
    slots = meta.slot_mapping.long().cpu()
    k_cache.view(blocks * block_size, KV_HEADS, HEAD_DIM)[slots] = case.k.cpu().double()
    v_cache.view(blocks * block_size, KV_HEADS, HEAD_DIM)[slots] = case.v.cpu().double()
    group = case.q.shape[1] // KV_HEADS
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    start = 0
    for s, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host, strict=True)):
        pos = torch.arange(ctx)
        table = meta.block_tables[s].long().cpu()
        keys = k_cache[table[pos // block_size], pos % block_size]  # [C, Hkv, D]
        values = v_cache[table[pos // block_size], pos % block_size]
        q_pos = ctx - q_len + torch.arange(q_len)  # [L]
        seen = pos[None, :] <= q_pos[:, None]  # [L, C]
        if window is not None:
            seen &= pos[None, :] > q_pos[:, None] - window
        # 0 * NaN is NaN: use only the keys some query sees, as a kernel must.
        cols = seen.any(0)
        for h in range(case.q.shape[1]):
            kv = h // group
            qs = case.q[start : start + q_len, h].cpu().double()  # [L, D]
            scores = (qs @ keys[cols, kv].T) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            weights = scores.masked_fill(~seen[:, cols], float("-inf")).softmax(-1)
            out[start : start + q_len, h] = weights @ values[cols, kv]
        start += q_len
    return out


def run_and_check(
    case: Case,
    window: int | None,
    scale: float = HEAD_DIM**-0.5,
    softcap: float | None = None,
    **kwargs: int,
) -> None:
    expected = reference(case, scale, window, softcap)
    args = (case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, scale)
    out = triton_paged_attention(*args, window=window, softcap=softcap, **kwargs)
    assert not out.isnan().any(), "a key outside every window was read"
    tol = TOL[case.q.dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


SHAPES = [(4, 1), (8, 2), (16, 4)]  # (block size, query heads per KV head)
# Below a block of 4, a block of 16; unaligned; = the longest context; past it; 1.
WINDOWS = [3, 13, 100, 1000, 1]

# Contexts of 1, a partial block, several blocks and 100 keys (7 partitions of 16).
DECODE_SEQS = [(0, 1), (6, 1), (36, 1), (99, 1)]


@pytest.mark.parametrize(("block_size", "group"), SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("partition_size", [16, 512])
def test_decode_window(block_size: int, group: int, window: int, partition_size: int) -> None:
    """16 splits the long contexts and puts their window start deep into a later partition
    of the whole context; 512 keeps one partition, so the kernel writes the output itself."""
    case = make_case(DECODE_SEQS, block_size, group, window, seed=window + block_size)
    assert case.meta.decode_only
    run_and_check(case, window, partition_size=partition_size)


@pytest.mark.parametrize("window", [17, 33, 40])
def test_decode_window_across_partition_edges(window: int) -> None:
    """Windows one key past a partition, two partitions plus one, and unaligned, over contexts
    that differ in partition count and window start; the grid is sized by the window."""
    seqs = [(70, 1), (16, 1), (32, 1), (48, 1), (2, 1)]
    run_and_check(make_case(seqs, 8, 2, window, seed=window), window, partition_size=16)


# No prefix; a partial block; decode rows among prefills; many query tiles over a prefix.
MIXED_SEQS = [(0, 19), (5, 3), (37, 1), (21, 40)]


@pytest.mark.parametrize(("block_size", "group"), SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_window(block_size: int, group: int, window: int) -> None:
    case = make_case(MIXED_SEQS, block_size, group, window, seed=window * 7 + block_size)
    assert not case.meta.decode_only
    run_and_check(case, window)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 30])
def test_prefill_window_small_tiles(window: int) -> None:
    """Tiles of 16 queries and keys: the key loop of a later tile starts mid-block and mid-tile,
    and its queries' windows start at different keys."""
    case = make_case(MIXED_SEQS, 4, 2, window, seed=window)
    meta, scale = case.meta, HEAD_DIM**-0.5
    expected = reference(case, scale, window)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, meta.slot_mapping)
    args = (case.q, case.k_cache, case.v_cache, meta.query_start_loc, meta.context_lens)
    out = prefill_attention(*args, meta.block_tables, scale, block_m=16, block_n=16, window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("decode", [False, True])
def test_no_window_is_the_whole_context(decode: bool) -> None:
    case = make_case(DECODE_SEQS if decode else MIXED_SEQS, 8, 2, None, seed=11)
    run_and_check(case, None, partition_size=16)


@pytest.mark.parametrize("window", [1, 7, 45])
def test_decode_kernel_equals_prefill_kernel(window: int) -> None:
    """Both kernels can answer a decode step; with a window they must still agree."""
    case = make_case(DECODE_SEQS, 16, 4, window, seed=3)
    meta, scale = case.meta, 0.2
    store_kv(case.k, case.v, case.k_cache, case.v_cache, meta.slot_mapping)
    args = (case.q, case.k_cache, case.v_cache)
    by_decode = decode_attention(
        *args, meta.context_lens, meta.block_tables, scale, partition_size=16, window=window
    )
    by_prefill = prefill_attention(
        *args, meta.query_start_loc, meta.context_lens, meta.block_tables, scale, window=window
    )
    torch.testing.assert_close(by_decode, by_prefill, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decode", [False, True])
def test_bfloat16_window(decode: bool) -> None:
    case = make_case(DECODE_SEQS if decode else MIXED_SEQS, 16, 2, 21, seed=5, dtype=torch.bfloat16)
    run_and_check(case, 21, partition_size=16)


def test_window_below_one_is_refused() -> None:
    case = make_case(MIXED_SEQS, 8, 1, None, seed=0)
    meta = case.meta
    args = (case.q, case.k_cache, case.v_cache)
    with pytest.raises(ValueError, match="window"):
        triton_paged_attention(*args[:1], case.k, case.v, *args[1:], meta, 0.2, window=0)
    with pytest.raises(ValueError, match="window"):
        decode_attention(*args, meta.context_lens, meta.block_tables, 0.2, window=0)
    with pytest.raises(ValueError, match="window"):
        prefill_attention(
            *args, meta.query_start_loc, meta.context_lens, meta.block_tables, 0.2, window=-3
        )
