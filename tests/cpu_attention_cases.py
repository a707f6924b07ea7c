"""Shared by the attention tests (the feature x backend matrix, the CPU and Triton kernels'
own): random paged caches and steps, seeded, the dense float64 reference they are checked
against, and one step through a backend of runner/backends/registry.py."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from runner.attention.backend import AttentionCall
from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.kernel import CpuKernels
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.registry import attention_backend
from runner.backends.torch.paged import write_kv

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
    2's; tests/attention/test_feature_matrix.py), all in float64."""
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


class PreparedStep(NamedTuple):
    inputs: StepInputs  # on the device (the keys no query sees NaN, if hidden)
    reference: Callable[[float | None], torch.Tensor]  # the dense reference for any soft cap
    meta: AttentionMetadata  # on the device


class BackendStep(NamedTuple):
    out: torch.Tensor  # [T, Hq, D] on the CPU, in the backend's dtype
    reference: Callable[[float | None], torch.Tensor]
    meta: AttentionMetadata
    inputs: StepInputs


def device_of(backend: str) -> str:
    """Where a backend's tensors live: Triton's on CUDA when there is one (else Triton's
    interpreter runs on the CPU), every other backend's on the CPU."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def hide_unseen(x: StepInputs, seqs: list[Seq], window: int | None, shared_blocks: int) -> None:
    """Fill with NaN the cached keys and values that no query of their sequence can see
    (before its first query's window) in the blocks it holds alone: a backend that read them
    instead of skipping them would return NaN. Mutates the caches."""
    block_size = x.k_cache.shape[1]
    for table, (q_len, ctx) in zip(x.tables, seqs, strict=True):
        hidden = 0 if window is None else max(ctx - q_len - window + 1, 0)
        for pos in range(shared_blocks * block_size, hidden):
            for cache in (x.k_cache, x.v_cache):
                cache[table[pos // block_size], pos % block_size] = float("nan")


def prepared_step(
    seqs: list[Seq],
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    window: int | None,
    *,
    scale: float,
    q_gain: float = 1.0,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    shared_blocks: int = 0,
    seed: int = 0,
    hide: bool = True,
    device: str = "cpu",
) -> PreparedStep:
    """A random step (queries `q_gain` times a unit normal, of `dtype`; caches of
    `cache_dtype`, default `dtype`) on `device`, and the dense reference at `scale` over the
    caches with the step's K/V written as stored. `hide`: the keys no query sees are NaN in
    the step's caches (hide_unseen), never in the reference's."""
    cache_dtype = cache_dtype or dtype
    x = random_inputs(seqs, block_size, hq, hkv, d, cache_dtype, shared_blocks, seed, q_gain)
    q, k, v = (t.to(dtype) for t in (x.q, x.k, x.v))
    clean_k, clean_v = x.k_cache.clone(), x.v_cache.clone()
    write_kv(k, v, clean_k, clean_v, x.meta.slot_mapping)
    if hide:
        hide_unseen(x, seqs, window, shared_blocks)
    meta = x.meta
    if device != "cpu":
        lens = [q_len for q_len, _ in seqs], [ctx for _, ctx in seqs]
        meta = AttentionMetadata.build(*lens, x.tables, block_size, device)
    on = StepInputs(*(t.to(device) for t in (q, k, v, x.k_cache, x.v_cache)), x.tables, meta)

    def reference(cap: float | None) -> torch.Tensor:
        return dense_reference(q, clean_k, clean_v, x.tables, seqs, scale, window, cap)

    return PreparedStep(on, reference, meta)


def backend_step(
    backend: str,
    seqs: list[Seq],
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    window: int | None,
    softcap: float | None,
    *,
    scale: float | None = None,
    **options: Any,
) -> BackendStep:
    """A prepared step (prepared_step's options; `scale` default d ** -0.5) on the backend's
    device, through `backend`'s attend. Triton's kernels skip the keys before a window (the
    unseen ones are NaN for them unless `hide` says otherwise); the torch path and the C
    kernels may read and mask some (their shared passes read whole blocks)."""
    scale = d**-0.5 if scale is None else scale
    options.setdefault("hide", backend == "triton")
    step = prepared_step(
        seqs, block_size, hq, hkv, d, window, scale=scale, device=device_of(backend), **options
    )
    x, attend = step.inputs, attention_backend(backend).attend
    out = attend(AttentionCall(x.q, x.k, x.v, x.k_cache, x.v_cache, x.meta, scale, window, softcap))
    return BackendStep(out.cpu(), step.reference, step.meta, x)
