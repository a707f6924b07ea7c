"""Shared by the CPU attention kernels' tests (window, soft cap): random paged caches and steps,
seeded, and the dense float64 reference they are checked against."""

from __future__ import annotations

import random
from typing import NamedTuple

import torch

from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.kernel import CpuKernels
from runner.backends.cpu.loader import load_cpu_kernels

Seq = tuple[int, int]  # (query length, context length): the queries are its last positions


def loaded() -> CpuKernels:
    kernels = load_cpu_kernels()
    assert kernels is not None
    return kernels


def dense_reference(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [blocks, B, Hkv, D]
    v_cache: torch.Tensor,
    tables: list[list[int]],
    seqs: list[Seq],
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """[T, Hq, D] float64: query i of sequence s (rows in order) at position p = C - L + i over
    keys j with p - window < j <= p, scores c * tanh(q . k * scale / c) with a soft cap c (Gemma
    2's; test_cpu_softcap.py), all in float64."""
    _, block_size, hkv, d = k_cache.shape
    group = q.shape[1] // hkv
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for table, (q_len, ctx) in zip(tables, seqs, strict=True):
        blocks = torch.tensor(table[: -(-ctx // block_size)], dtype=torch.int64)
        # [C, Hq, D]: token t is row t % B of block table[t // B]; query head h reads h // G
        keys = k_cache[blocks].reshape(-1, hkv, d)[:ctx].double().repeat_interleave(group, 1)
        values = v_cache[blocks].reshape(-1, hkv, d)[:ctx].double().repeat_interleave(group, 1)
        pos = torch.arange(ctx - q_len, ctx)[:, None]  # [L, 1]
        key = torch.arange(ctx)[None]  # [1, C]
        visible = key <= pos
        if window is not None:
            visible &= key > pos - window
        rows = q[start : start + q_len].double()
        scores = torch.einsum("lhd,chd->hlc", rows, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + q_len] = torch.einsum("hlc,chd->lhd", probs, values)
        start += q_len
    return out


def random_tables(
    seqs: list[Seq], block_size: int, shared_blocks: int, rng: random.Random
) -> tuple[list[list[int]], int]:
    """Scattered block tables whose first `shared_blocks` blocks are the same for every
    sequence, and the pool size they need."""
    own = [-(-ctx // block_size) - shared_blocks for _, ctx in seqs]
    num_blocks = 1 + shared_blocks + sum(own)
    free = list(range(1 + shared_blocks, num_blocks))
    rng.shuffle(free)
    shared = list(range(1, 1 + shared_blocks))
    return [shared + [free.pop() for _ in range(n)] for n in own], num_blocks


class StepInputs(NamedTuple):
    q: torch.Tensor  # [T, hq, d]
    k: torch.Tensor  # [T, hkv, d], the step's new keys
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, hkv, d]
    v_cache: torch.Tensor
    tables: list[list[int]]
    meta: AttentionMetadata


def random_inputs(
    seqs: list[Seq],
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    cache_dtype: torch.dtype = torch.float32,
    shared_blocks: int = 0,
    seed: int = 0,
    q_gain: float = 1.0,
) -> StepInputs:
    """A random cache and step of unit normals (queries `q_gain` times that), seeded."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = random_tables(seqs, block_size, shared_blocks, rng)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(cache_dtype)
    tokens = sum(q_len for q_len, _ in seqs)
    q = torch.randn(tokens, hq, d, generator=gen) * q_gain
    k, v = (torch.randn(tokens, hkv, d, generator=gen) for _ in range(2))
    meta = AttentionMetadata.build(
        [q_len for q_len, _ in seqs], [ctx for _, ctx in seqs], tables, block_size
    )
    return StepInputs(q, k, v, k_cache, v_cache, tables, meta)
