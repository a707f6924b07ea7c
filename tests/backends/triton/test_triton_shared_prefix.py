"""Shared-prefix (cascade) decode in Triton against a naive torch reference: each group's prefix
read once by the prefix pass, each sequence's own keys by its own partitions, merged by the
reduce. Under TRITON_INTERPRET=1 on the CPU (tests/conftest.py); on a GPU the same tests run on
CUDA. Shapes are tiny: the interpreter runs every program in Python."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from runner.attention.backend import AttentionCall
from runner.attention.metadata import AttentionMetadata
from runner.backends.torch.cascade import PrefixGroup, find_prefix_groups
from runner.backends.triton.attention import triton_paged_attention
from runner.backends.triton.cascade_cost import ALWAYS, NEVER
from runner.backends.triton.decode import decode_attention
from runner.backends.triton.shared_prefix import (
    build_shared_prefix_plan,
    decode_kv_bytes,
    plan_decode_step,
)
from tests.backends.triton.triton_cases import DEVICES

BLOCK = 4


@dataclass
class Step:
    q: torch.Tensor  # [S, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # [S, max_blocks] int32 (host)
    context_lens: list[int]


def make_step(
    groups: list[tuple[int, list[int]]],
    alone: list[int],
    padding: int,
    hq: int,
    hkv: int,
    dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Step:
    """groups: (prefix blocks, each member's own tokens after it, the new one included);
    `alone`: contexts of sequences that share nothing; `padding`: rows as a CUDA graph pads a
    batch (context 1, a table of block 0). Blocks are scattered over a pool of noise."""
    gen = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = []
    ctxs: list[int] = []
    need = sum(p + sum(math.ceil(n / BLOCK) for n in own) for p, own in groups)
    need += sum(math.ceil(c / BLOCK) for c in alone) + 2
    perm = torch.randperm(need, generator=gen).tolist()
    taken = 1  # block perm[0] stays for padding rows

    def take(n: int) -> list[int]:
        nonlocal taken
        taken += n
        return perm[taken - n : taken]

    for prefix, own in groups:
        shared = take(prefix)
        for n in own:
            rows.append(shared + take(math.ceil(n / BLOCK)))
            ctxs.append(prefix * BLOCK + n)
    for c in alone:
        rows.append(take(math.ceil(c / BLOCK)))
        ctxs.append(c)
    for _ in range(padding):
        rows.append([perm[0]])
        ctxs.append(1)
    width = max(len(r) for r in rows) + 1
    tables = torch.zeros(len(rows), width, dtype=torch.int32)
    for s, r in enumerate(rows):
        tables[s, : len(r)] = torch.tensor(r, dtype=torch.int32)
    shape = (need, BLOCK, hkv, dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(rows), hq, dim, generator=gen).to(dtype)
    return Step(q, k_cache, v_cache, tables, ctxs)


def reference(step: Step, scale: float, window: int | None) -> torch.Tensor:
    """Naive float32 decode attention of each row over its last min(C, W) keys."""
    _, _, hkv, dim = step.k_cache.shape
    group = step.q.shape[1] // hkv
    out = torch.empty(step.q.shape, dtype=torch.float32)
    for s, ctx in enumerate(step.context_lens):
        blocks = step.tables[s, : math.ceil(ctx / BLOCK)].long()
        k = step.k_cache[blocks].reshape(-1, hkv, dim)[:ctx].float().repeat_interleave(group, 1)
        v = step.v_cache[blocks].reshape(-1, hkv, dim)[:ctx].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", step.q[s].float(), k) * scale
        if window is not None:
            scores[:, : max(ctx - window, 0)] = float("-inf")
        out[s] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out


def run(
    step: Step,
    device: str,
    members: int,
    window: int | None = None,
    softcap: float | None = None,
    capacity: tuple[int, int] | None = None,
) -> torch.Tensor:
    groups = find_prefix_groups(step.tables, step.context_lens, [1] * len(step.tables), BLOCK, 1)
    plan = build_shared_prefix_plan(
        groups, len(step.context_lens), BLOCK, members, device, capacity
    )
    out: torch.Tensor = decode_attention(
        step.q.to(device),
        step.k_cache.to(device),
        step.v_cache.to(device),
        torch.tensor(step.context_lens, dtype=torch.int32, device=device),
        step.tables.to(device),
        step.q.shape[-1] ** -0.5,
        max(step.context_lens),
        partition_size=16,
        block_n=16,
        window=window,
        softcap=softcap,
        shared_prefix=plan,
    )
    return out.cpu()


# (groups, alone, padding): groups of 2 and 5 sharing 3 and 6 blocks, partial own blocks, a
# sequence that shares nothing, padding rows; one group over many chunks; a group of 1.
CASES = [
    ([(3, [1, 6]), (6, [3, 4, 9, 1, 2])], [7], 2),
    ([(8, [2, 5, 1, 7, 3, 3, 4])], [], 0),
    ([(5, [3])], [9, 2], 1),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (3, 1), (2, 2)])
def test_shared_prefix_decode_matches_reference(
    device: str, case: tuple[list[tuple[int, list[int]]], list[int], int], hq: int, hkv: int
) -> None:
    groups, alone, padding = case
    step = make_step(groups, alone, padding, hq, hkv, 16, torch.float32)
    found = find_prefix_groups(step.tables, step.context_lens, [1] * len(step.tables), BLOCK, 1)
    assert sorted(len(g.members) for g in found) == sorted(len(o) for _, o in groups if len(o) > 1)
    out = run(step, device, members=2)  # chunks of 2: a group of 5 reads its prefix 3 times
    ref = reference(step, step.q.shape[-1] ** -0.5, None)
    real = len(step.context_lens) - padding
    torch.testing.assert_close(out[:real], ref[:real], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(out).all()  # padding rows too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 5, 13, 30, 200])
def test_shared_prefix_decode_with_a_window(device: str, window: int) -> None:
    """A window may hide part of a prefix, all of it, or nothing, member by member."""
    step = make_step([(4, [1, 6, 11]), (3, [2, 2])], [5], 1, 4, 2, 16, torch.float32, seed=3)
    out = run(step, device, members=2, window=window)
    ref = reference(step, step.q.shape[-1] ** -0.5, window)
    torch.testing.assert_close(out[:-1], ref[:-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_shared_prefix_decode_bf16_and_graph_capacity(device: str) -> None:
    """bf16 caches, and a plan padded to a graph's fixed shape (empty chunks, wider tables)."""
    step = make_step([(6, [2, 7, 1])], [3], 1, 4, 2, 16, torch.bfloat16, seed=5)
    out = run(step, device, members=64, capacity=(4, 12))
    ref = reference(step, step.q.shape[-1] ** -0.5, None)
    torch.testing.assert_close(out[:-1].float(), ref[:-1], atol=3e-2, rtol=3e-2)


def test_graph_plan_takes_any_later_plan() -> None:
    """copy_into writes a step's plan into fixed-shape tensors; their unused chunks empty."""
    step = make_step([(3, [1, 6]), (6, [3, 4, 9])], [7], 2, 4, 2, 16, torch.float32)
    groups = find_prefix_groups(step.tables, step.context_lens, [1] * 8, BLOCK, 1)
    static = build_shared_prefix_plan(groups, 8, BLOCK, 2, "cpu", capacity=(6, 10))
    fewer = build_shared_prefix_plan(groups[:1], 8, BLOCK, 2, "cpu")
    fewer.copy_into(static)
    assert static.chunk_prefix_lens.tolist() == [12, 0, 0, 0, 0, 0]
    assert static.seq_prefix_lens.tolist() == [12, 12, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="does not fit"):
        static.copy_into(fewer)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_plans_the_step_by_the_cost_model(device: str) -> None:
    """triton_paged_attention's decode: ALWAYS and NEVER give the same output; NEVER builds
    no plan; the plan is made once and kept on the step's metadata for the next layer."""
    step = make_step([(5, [2, 3, 1])], [4], 0, 4, 2, 16, torch.float32, seed=7)
    num = len(step.context_lens)
    outs = []
    for cost in (ALWAYS, NEVER):
        meta = AttentionMetadata.build(
            [1] * num,
            step.context_lens,
            [[b for b in row.tolist()] for row in step.tables],
            BLOCK,
            device,
        )
        # The new tokens are already in the caches: write them back to where they are.
        slots = meta.slot_mapping.cpu()
        k = step.k_cache.view(-1, 2, 16)[slots]
        v = step.v_cache.view(-1, 2, 16)[slots]
        args = (step.q.to(device), k.to(device), v.to(device))
        caches = (step.k_cache.clone().to(device), step.v_cache.clone().to(device))
        call = AttentionCall(*args, *caches, meta, 0.25)
        out = triton_paged_attention(call, partition_size=16, cascade=cost)
        plan = meta._shared_prefix[1]
        assert (plan is None) == (cost is NEVER)
        if plan is not None:
            assert [g.members for g in plan.groups] == [[0, 1, 2]]
        outs.append(out.cpu())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[0], reference(step, 0.25, None), atol=1e-4, rtol=1e-4)


def test_kv_bytes_read_both_ways_exactly() -> None:
    """A group of 5 (chunks of 2: the prefix read 3 times), prefix 8 blocks of 4 = 32 tokens;
    suffixes 1..5 tokens; one sequence alone with 10 tokens; 6 bytes a token, 2 layers."""
    ctxs = [33, 34, 35, 36, 37, 10]
    groups = [PrefixGroup([0, 1, 2, 3, 4], list(range(8)))]
    plan = build_shared_prefix_plan(groups, 6, BLOCK, 2, "cpu")
    assert plan.chunks_per_group == [3]
    got = decode_kv_bytes(ctxs, plan, kv_bytes_per_token=6, num_layers=2)
    assert got.plain == (33 + 34 + 35 + 36 + 37 + 10) * 6 * 2
    assert got.shared == (3 * 32 + (1 + 2 + 3 + 4 + 5) + 10) * 6 * 2
    assert decode_kv_bytes(ctxs, None, 6, 2) == (got.plain, got.plain)
    # A window of 4: plain reads min(C, 4) each; the own pass from max(32, C - 4).
    windowed = decode_kv_bytes(ctxs, plan, 6, 2, window=4)
    assert windowed.plain == 6 * 4 * 6 * 2
    assert windowed.shared == (3 * 32 + (1 + 2 + 3 + 4 + 4) + 4) * 6 * 2


def test_plan_decode_step_keeps_only_what_the_cost_model_accepts() -> None:
    step = make_step([(5, [2, 3, 1]), (2, [1, 1])], [4], 0, 4, 2, 16, torch.float32)
    args = (step.tables, step.context_lens, BLOCK, 4, 2, 16, torch.float32, "cpu")
    assert plan_decode_step(*args, thresholds=NEVER) is None
    assert plan_decode_step(*args) is None  # the default: far too few bytes to save here
    plan = plan_decode_step(*args, thresholds=ALWAYS)
    assert plan is not None
    assert sorted(g.members for g in plan.groups) == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize("device", DEVICES)
def test_one_fixed_shape_plan_serves_every_step(device: str) -> None:
    """As a CUDA graph replays it: one decode call over static tensors (a plan padded to a
    capacity, fixed batch, the grid set by host bounds), later steps' plans copied into them
    between replays, no host value changed. On CUDA the call is a captured graph."""
    steps = [
        make_step([(3, [1, 6]), (6, [3, 4, 9, 1, 2])], [7], 1, 4, 2, 16, torch.float32, seed=11),
        make_step([(7, [2, 2, 5, 3, 1, 4, 2, 3])], [], 1, 4, 2, 16, torch.float32, seed=12),
        make_step([], [5, 9, 4, 2, 6, 3, 8, 7], 1, 4, 2, 16, torch.float32, seed=13),  # no group
    ]
    rows, blocks, width = 9, max(s.k_cache.shape[0] for s in steps), 12
    static_q = torch.zeros(rows, 4, 16, device=device)
    static_k = torch.zeros(blocks, BLOCK, 2, 16, device=device)
    static_v = torch.zeros_like(static_k)
    static_ctx = torch.ones(rows, dtype=torch.int32, device=device)
    static_tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
    static_plan = build_shared_prefix_plan([], rows, BLOCK, 2, device, capacity=(6, 10))
    max_ctx = width * BLOCK

    def call() -> torch.Tensor:
        out: torch.Tensor = decode_attention(
            static_q, static_k, static_v, static_ctx, static_tables, 0.25, max_ctx,
            partition_size=16, block_n=16, shared_prefix=static_plan,
        )  # fmt: skip
        return out

    graph = None
    if device == "cuda":
        call()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = call()
    for step in steps:
        n = len(step.context_lens)
        static_q[:n].copy_(step.q)
        static_k[: step.k_cache.shape[0]].copy_(step.k_cache)
        static_v[: step.v_cache.shape[0]].copy_(step.v_cache)
        static_ctx[:n].copy_(torch.tensor(step.context_lens, dtype=torch.int32))
        static_tables[:n, : step.tables.shape[1]].copy_(step.tables)
        groups = find_prefix_groups(step.tables, step.context_lens, [1] * n, BLOCK, 1)
        build_shared_prefix_plan(groups, n, BLOCK, 2, device).copy_into(static_plan)
        if graph is not None:
            graph.replay()
            out = static_out.clone()
        else:
            out = call()
        ref = reference(step, 0.25, None)
        torch.testing.assert_close(out[: n - 1].cpu(), ref[: n - 1], atol=1e-4, rtol=1e-4)
