"""Triton paged-attention kernels against a naive torch reference.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports Triton); with CUDA the same tests run on GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from runner.attention.backend import AttentionCall
from runner.attention.metadata import AttentionMetadata
from runner.backends.triton.attention import (
    decode_attention,
    prefill_attention,
    store_kv,
    triton_paged_attention,
)
from tests.backends.triton.triton_cases import DEVICES, TOL


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] new keys
    v: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], prefix already written
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> Batch:
    """seqs: (cached prefix length, new tokens) per sequence. Blocks are scattered at random
    over a pool with spare blocks; every unused cache row holds noise, so reading a wrong row or
    an unmasked key shows up in the output."""
    gen = torch.Generator().manual_seed(seed)
    ctx = [p + n for p, n in seqs]
    blocks_per_seq = [math.ceil(c / block_size) for c in ctx]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(blocks_per_seq) + 1, dtype=torch.int32)  # 0-padded
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    slots, taken = [], 0
    for s, ((prefix, _new), c) in enumerate(zip(seqs, ctx, strict=True)):
        table = perm[taken : taken + blocks_per_seq[s]]
        taken += blocks_per_seq[s]
        tables[s, : len(table)] = torch.tensor(table, dtype=torch.int32)
        flat = [table[pos // block_size] * block_size + pos % block_size for pos in range(c)]
        slots += flat[prefix:]
    num_tokens = sum(n for _, n in seqs)
    kv_shape = (num_tokens, num_kv_heads, head_dim)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(kv_shape, generator=gen).to(dtype)
    v = torch.randn(kv_shape, generator=gen).to(dtype)
    query_lens = [n for _, n in seqs]
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=qsl.to(device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_lens=query_lens,
        context_lens_host=ctx,
        max_query_len=max(query_lens),
        max_context_len=max(ctx),
        decode_only=all(n == 1 for n in query_lens),
    )
    to = lambda t: t.to(device)  # noqa: E731
    return Batch(to(q), to(k), to(v), to(k_cache), to(v_cache), meta)


def snapshot(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches, for the reference, before a Triton call writes into them."""
    return batch.k_cache.clone(), batch.v_cache.clone()


def reference_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches after a plain torch scatter of k / v [T, Hkv, D] at their slots."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    b, bs, h, d = k_cache.shape
    keep = slots >= 0
    k_cache.view(b * bs, h, d)[slots[keep]] = k[keep]
    v_cache.view(b * bs, h, d)[slots[keep]] = v[keep]
    return k_cache, v_cache


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Naive float32 attention: gather each sequence's keys through its block table, expand KV
    heads for GQA, mask causally with the prefix offset. Returns [T, Hq, D] float32."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for s, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host, strict=True)):
        blocks = meta.block_tables[s, : math.ceil(ctx / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qs = q[start : start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [Hq, L, C]
        q_pos = ctx - q_len + torch.arange(q_len, device=q.device)
        hidden = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]  # [L, C]
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def check_attention(
    batch: Batch, out: torch.Tensor, before: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """out and the caches of batch, updated by a Triton call, against the torch reference run
    from `before`: copies of the caches taken before that call."""
    ref_k, ref_v = reference_store(batch.k, batch.v, *before, batch.meta.slot_mapping)
    assert torch.equal(batch.k_cache, ref_k) and torch.equal(batch.v_cache, ref_v)
    scale = batch.q.shape[-1] ** -0.5
    ref = reference_attention(batch.q, ref_k, ref_v, batch.meta, scale)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    tol = TOL[batch.q.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
def test_store_kv_writes_slots_and_skips_negative(
    device: str, dtype: torch.dtype, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, heads, dim, tokens = 6, 3, 24, 9  # non-power-of-two heads and dim: padded tiles
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype).to(device)
    # k / v as strided views of a fused projection [T, 2 * Hkv, D], like a qkv split.
    kv = torch.randn(tokens, 2 * heads, dim, generator=gen).to(dtype).to(device)
    k, v = kv[:, :heads], kv[:, heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5]] = -1  # padding tokens: must not be written anywhere
    slots = slots.to(device)
    ref_k, ref_v = reference_store(k, v, k_cache, v_cache, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# (cached prefix, new tokens): no prefix; a partial block; several blocks + a decode-like
# single token; long enough to need several query and key tiles.
PREFILL_SEQS = [(0, 19), (5, 3), (37, 1), (21, 40)]


def attend(batch: Batch, scale: float, **options: int) -> torch.Tensor:
    """triton_paged_attention over the batch (its new K/V stored first)."""
    b = batch
    call = AttentionCall(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, scale)
    out: torch.Tensor = triton_paged_attention(call, **options)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("tile", [None, 16])
def test_prefill_matches_reference(
    device: str, block_size: int, group: int, tile: int | None
) -> None:
    batch = make_batch(PREFILL_SEQS, block_size, 2 * group, 2, 32, torch.float32, device)
    before = snapshot(batch)
    meta = batch.meta
    assert not meta.decode_only
    if tile is None:  # the full entry point, default tiles
        out = attend(batch, 32**-0.5)
    else:  # small tiles: many query tiles per sequence and key tiles straddling cache blocks
        store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, meta.slot_mapping)
        out = prefill_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            meta.query_start_loc,
            meta.context_lens,
            meta.block_tables,
            32**-0.5,
            block_m=tile,
            block_n=tile,
        )
    check_attention(batch, out, before)


# contexts of 1, a partial block, several blocks, and one long enough for many partitions.
DECODE_SEQS = [(0, 1), (10, 1), (40, 1), (99, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("partition_size", [16, 32, 512])
def test_decode_matches_reference(
    device: str, block_size: int, group: int, partition_size: int
) -> None:
    """512 leaves one partition (no reduce); 16 and 32 split every context but the shortest
    into several partitions, a different number per sequence."""
    batch = make_batch(DECODE_SEQS, block_size, 2 * group, 2, 32, torch.float32, device)
    before = snapshot(batch)
    assert batch.meta.decode_only
    out = attend(batch, 32**-0.5, partition_size=partition_size)
    check_attention(batch, out, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decode", [False, True])
def test_half_precision_caches(device: str, dtype: torch.dtype, decode: bool) -> None:
    seqs = DECODE_SEQS if decode else PREFILL_SEQS
    batch = make_batch(seqs, 16, 4, 2, 64, dtype, device, seed=3)
    before = snapshot(batch)
    out = attend(batch, 64**-0.5, partition_size=32)
    check_attention(batch, out, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128, 48])  # SmolLM2, Qwen3, a padded one
@pytest.mark.parametrize("decode", [False, True])
def test_head_dims(device: str, head_dim: int, decode: bool) -> None:
    seqs = [(0, 1), (30, 1)] if decode else [(0, 9), (18, 5)]
    batch = make_batch(seqs, 8, 4, 1, head_dim, torch.float32, device, seed=4)
    before = snapshot(batch)
    out = attend(batch, head_dim**-0.5, partition_size=16)
    check_attention(batch, out, before)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_kernel_equals_prefill_kernel_on_single_tokens(device: str) -> None:
    """Both kernels answer a decode step; they must agree (the split path included)."""
    batch = make_batch(DECODE_SEQS, 16, 8, 2, 32, torch.float32, device, seed=5)
    meta = batch.meta
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, meta.slot_mapping)
    args = (batch.q, batch.k_cache, batch.v_cache)
    by_decode = decode_attention(
        *args, meta.context_lens, meta.block_tables, 0.2, partition_size=16
    )
    by_prefill = prefill_attention(
        *args, meta.query_start_loc, meta.context_lens, meta.block_tables, 0.2
    )
    torch.testing.assert_close(by_decode, by_prefill, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_tiles_the_compiler_rejects_are_refused(device: str) -> None:
    """tl.dot needs tiles of at least 16 on a GPU; the interpreter would take them, so the
    wrappers refuse them up front, on every device alike."""
    batch = make_batch(DECODE_SEQS, 16, 4, 2, 32, torch.float32, device, seed=6)
    meta = batch.meta
    args = (batch.q, batch.k_cache, batch.v_cache)
    with pytest.raises(ValueError, match="block_n"):
        decode_attention(*args, meta.context_lens, meta.block_tables, 0.2, block_n=8)
    with pytest.raises(ValueError, match="partition_size"):
        decode_attention(*args, meta.context_lens, meta.block_tables, 0.2, partition_size=24)
    with pytest.raises(ValueError, match="block_m"):
        prefill_attention(
            *args, meta.query_start_loc, meta.context_lens, meta.block_tables, 0.2, block_m=8
        )
