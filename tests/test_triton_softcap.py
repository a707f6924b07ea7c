"""Attention-logit soft capping (Gemma 2) in the Triton kernels against a dense float64 reference.

With a cap c each score s = (q . k) * scale becomes c * tanh(s / c), then the causal (and sliding
window) mask applies and the softmax follows, as in transformers' Gemma 2 eager attention. The
scales here put raw scores around 10-100, so the cap changes the result far beyond the tolerance
(checked). The kernels hold scores in base 2; the reference works in natural units throughout.
Keys that no query of a sequence can see (before every window) hold NaN, as in
tests/test_triton_window.py: a kernel that read them would return NaN.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():  # must precede the @triton.jit definitions imported below
    os.environ.setdefault("TRITON_INTERPRET", "1")

from runner.attention import AttentionMetadata  # noqa: E402
from runner.triton_attention import (  # noqa: E402
    decode_attention,
    prefill_attention,
    store_kv,
    triton_paged_attention,
)
from runner.triton_common import interpreting  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1"
)
HEAD_DIM, KV_HEADS = 32, 2
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# q . k of unit normals has a standard deviation of sqrt(32) ~ 5.7: these scales give raw scores
# of ~10-100, where a cap of 5 or 50 bites hard.
SCALE = {5.0: 2.0, 50.0: 8.0}
SHAPES = [(4, 1), (8, 2), (16, 4)]  # (block size, query heads per KV head)
# Contexts of 1, a partial block, several blocks and 100 keys (7 partitions of 16).
DECODE_SEQS = [(0, 1), (6, 1), (36, 1), (99, 1)]
# No prefix; a partial block; a decode row among prefills; two query tiles over a prefix.
MIXED_SEQS = [(0, 19), (5, 3), (37, 1), (21, 40)]


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] new keys, not yet in the caches
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    seqs: list[tuple[int, int]]  # (cached prefix, new tokens)
    tables: list[list[int]]
    meta: AttentionMetadata


def make_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    group: int,
    seed: int,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """Blocks scattered over a pool with spare blocks of noise; cached keys before the earliest
    window start of their sequence hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil((p + n) / block_size) for p, n in seqs]
    perm = torch.randperm(sum(counts) + 2, generator=gen).tolist()
    tables = [perm[sum(counts[:s]) : sum(counts[: s + 1])] for s in range(len(seqs))]
    shape = (len(perm), block_size, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    for (prefix, _), table in zip(seqs, tables, strict=True):
        for pos in range(0 if window is None else max(prefix - window + 1, 0)):
            k_cache[table[pos // block_size], pos % block_size] = float("nan")
            v_cache[table[pos // block_size], pos % block_size] = float("nan")
    num_tokens = sum(n for _, n in seqs)
    q = torch.randn(num_tokens, KV_HEADS * group, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    contexts = [p + n for p, n in seqs]
    meta = AttentionMetadata.build([n for _, n in seqs], contexts, tables, block_size, DEVICE)
    to = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return Case(to(q), to(k), to(v), to(k_cache), to(v_cache), seqs, tables, meta)


def reference(case: Case, scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """Dense float64 attention: each sequence's cached keys read through its block table, its
    new keys appended, capped scores, then the mask p - W < j <= p, then softmax. [T, Hq, D]"""
    block_size = case.k_cache.shape[1]
    group = case.q.shape[1] // KV_HEADS
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    start = 0
    for (prefix, new), table in zip(case.seqs, case.tables, strict=True):
        rows = [(table[j // block_size], j % block_size) for j in range(prefix)]
        cached_k = torch.stack([case.k_cache[b, o] for b, o in rows]) if rows else None
        cached_v = torch.stack([case.v_cache[b, o] for b, o in rows]) if rows else None
        keys, values = case.k[start : start + new], case.v[start : start + new]
        if cached_k is not None and cached_v is not None:
            keys, values = torch.cat([cached_k, keys]), torch.cat([cached_v, values])
        keys, values = keys.cpu().double(), values.cpu().double()  # [C, Hkv, D]
        q_pos = torch.arange(prefix, prefix + new)[:, None]  # [L, 1]
        k_pos = torch.arange(prefix + new)[None, :]  # [1, C]
        seen = k_pos <= q_pos
        if window is not None:
            seen &= k_pos > q_pos - window
        cols = seen.any(0)  # 0 * NaN is NaN: use only keys some query sees, as a kernel must
        for h in range(case.q.shape[1]):
            qs = case.q[start : start + new, h].cpu().double()  # [L, D]
            scores = qs @ keys[cols, h // group].T * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            scores = scores.masked_fill(~seen[:, cols], float("-inf"))
            out[start : start + new, h] = scores.softmax(-1) @ values[cols, h // group]
        start += new
    return out


def run_and_check(
    case: Case,
    scale: float,
    softcap: float | None,
    window: int | None = None,
    partition_size: int | None = None,
) -> None:
    expected = reference(case, scale, softcap, window)
    args = (case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, scale)
    out = triton_paged_attention(
        *args, window=window, softcap=softcap, partition_size=partition_size
    )
    assert not out.isnan().any(), "a key outside every window was read"
    tol = TOL[case.q.dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(("block_size", "group"), SHAPES)
@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("window", [None, 13])
def test_decode_softcap(block_size: int, group: int, softcap: float, window: int | None) -> None:
    """Partitions of 16 keys: the long contexts are split, so the reduce combines the capped
    partitions' log-sum-exps; partial key tiles check that padding is masked after the cap."""
    case = make_case(DECODE_SEQS, block_size, group, seed=block_size + int(softcap), window=window)
    assert case.meta.decode_only
    run_and_check(case, SCALE[softcap], softcap, window, partition_size=16)


@pytest.mark.parametrize(("block_size", "group"), SHAPES)
@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("window", [None, 13])
def test_prefill_softcap(block_size: int, group: int, softcap: float, window: int | None) -> None:
    """Cached prefixes, a decode row among prefills, and queries whose causal diagonal cuts a
    key tile: the masked keys must stay out after the cap (tanh(-inf) would be -1)."""
    seed = 3 * block_size + int(softcap)
    case = make_case(MIXED_SEQS, block_size, group, seed=seed, window=window)
    assert not case.meta.decode_only
    run_and_check(case, SCALE[softcap], softcap, window)


@pytest.mark.parametrize("decode", [False, True])
def test_cap_changes_the_result(decode: bool) -> None:
    """The scales above make the cap matter: capped and plain references are far apart."""
    case = make_case(DECODE_SEQS if decode else MIXED_SEQS, 8, 2, seed=1)
    for softcap, scale in SCALE.items():
        gap = reference(case, scale, softcap, None) - reference(case, scale, None, None)
        assert gap.abs().max() > 100 * TOL[torch.float32]


@pytest.mark.parametrize("decode", [False, True])
def test_no_softcap_is_plain_attention(decode: bool) -> None:
    case = make_case(DECODE_SEQS if decode else MIXED_SEQS, 8, 2, seed=7)
    run_and_check(case, 0.3, None, partition_size=16)


@pytest.mark.parametrize("decode", [False, True])
def test_bfloat16_softcap(decode: bool) -> None:
    seqs = DECODE_SEQS if decode else MIXED_SEQS
    case = make_case(seqs, 16, 2, seed=5, window=21, dtype=torch.bfloat16)
    run_and_check(case, SCALE[50.0], 50.0, 21, partition_size=16)


def test_small_tiles_with_window() -> None:
    """Tiles of 16 queries and keys: later tiles start their key loop mid-block and mid-tile."""
    case = make_case(MIXED_SEQS, 4, 2, seed=9, window=17)
    meta, scale = case.meta, SCALE[5.0]
    expected = reference(case, scale, 5.0, 17)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, meta.slot_mapping)
    args = (case.q, case.k_cache, case.v_cache, meta.query_start_loc, meta.context_lens)
    out = prefill_attention(
        *args, meta.block_tables, scale, block_m=16, block_n=16, window=17, softcap=5.0
    )
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)


def test_decode_kernel_equals_prefill_kernel() -> None:
    case = make_case(DECODE_SEQS, 16, 4, seed=3)
    meta, scale = case.meta, SCALE[50.0]
    store_kv(case.k, case.v, case.k_cache, case.v_cache, meta.slot_mapping)
    args = (case.q, case.k_cache, case.v_cache)
    by_decode = decode_attention(
        *args, meta.context_lens, meta.block_tables, scale, partition_size=16, softcap=50.0
    )
    by_prefill = prefill_attention(
        *args, meta.query_start_loc, meta.context_lens, meta.block_tables, scale, softcap=50.0
    )
    torch.testing.assert_close(by_decode, by_prefill, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [0.0, -5.0, float("inf"), float("nan")])
def test_softcap_must_be_positive_and_finite(softcap: float) -> None:
    case = make_case(MIXED_SEQS, 8, 1, seed=0)
    meta = case.meta
    before = case.k_cache.clone()
    with pytest.raises(ValueError, match="soft cap"):
        triton_paged_attention(
            case.q, case.k, case.v, case.k_cache, case.v_cache, meta, 0.2, softcap=softcap
        )
    assert torch.equal(case.k_cache.nan_to_num(), before.nan_to_num()), "refused, yet stored"
    args = (case.q, case.k_cache, case.v_cache)
    with pytest.raises(ValueError, match="soft cap"):
        decode_attention(*args, meta.context_lens, meta.block_tables, 0.2, softcap=softcap)
    with pytest.raises(ValueError, match="soft cap"):
        prefill_attention(
            *args, meta.query_start_loc, meta.context_lens, meta.block_tables, 0.2, softcap=softcap
        )
