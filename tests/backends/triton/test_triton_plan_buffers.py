"""A decode graph's shared-prefix plan buffers (runner/backends/triton/shared_prefix.py:
PlanBuffers): one step's plan filled in, then another's with other groups into the same
buffers, each decode equal to the plain kernel's; and planning reads only host tables."""

from __future__ import annotations

import pytest
import torch

from runner.attention.backend import AttentionCall
from runner.attention.metadata import AttentionMetadata
from runner.backends.torch.cascade import PrefixGroup
from runner.backends.triton.attention import planned_shared_prefix, triton_paged_attention
from runner.backends.triton.cascade_cost import ALWAYS, NEVER
from runner.backends.triton.shared_prefix import (
    PlanBuffers,
    SharedPrefixPlan,
    build_shared_prefix_plan,
    members_per_chunk,
    pack_plan,
    plan_decode_step,
)
from tests.backends.triton.triton_cases import DEVICES

BLOCK, HQ, HKV, DIM, POOL = 4, 4, 2, 16, 40


def step_meta(groups: list[tuple[list[int], list[int]]], device: str) -> AttentionMetadata:
    """A decode step: each group (its shared prefix blocks, each member's own token count
    after them) and the rows' tables built from distinct blocks of the pool."""
    free = iter(range(1, POOL))
    tables: list[list[int]] = []
    ctxs: list[int] = []
    for prefix, owns in groups:
        for own in owns:
            tables.append(prefix + [next(free) for _ in range(-(-own // BLOCK))])
            ctxs.append(len(prefix) * BLOCK + own)
    return AttentionMetadata.build([1] * len(ctxs), ctxs, tables, BLOCK, device)


def host_plan(meta: AttentionMetadata) -> SharedPrefixPlan | None:
    """The step's shared-prefix plan from its host tables, whatever it costs (ALWAYS)."""
    return plan_decode_step(
        torch.from_numpy(meta.block_tables_host),
        meta.context_lens_host,
        BLOCK,
        HQ,
        HKV,
        DIM,
        torch.float32,
        "cpu",
        ALWAYS,
    )


def attend(
    meta: AttentionMetadata, caches: tuple[torch.Tensor, torch.Tensor], seed: int, **kw: object
) -> torch.Tensor:
    """One decode layer over a copy of the caches; the new tokens' K/V are those already there."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(meta.num_seqs, HQ, DIM, generator=gen).to(caches[0].device)
    slots = meta.slot_mapping
    k = caches[0].view(-1, HKV, DIM)[slots]
    v = caches[1].view(-1, HKV, DIM)[slots]
    k_cache, v_cache = caches[0].clone(), caches[1].clone()
    out: torch.Tensor = triton_paged_attention(
        AttentionCall(q, k, v, k_cache, v_cache, meta, 0.25),
        partition_size=16,
        **kw,  # type: ignore[arg-type]
    )
    return out.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_plan_buffers_refilled_for_another_step_equal_the_plain_kernel(device: str) -> None:
    """Step A (two groups: two chunks) then step B (one other group and a row alone: one
    chunk) through the same buffers: each equals the plain kernel (float32), and B's fill
    empties the chunk A left behind."""
    gen = torch.Generator().manual_seed(3)
    shape = (POOL, BLOCK, HKV, DIM)
    caches = (torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen))
    caches = (caches[0], caches[1].to(device))
    rows, members = 8, members_per_chunk(HQ // HKV, torch.float32)
    buffers = PlanBuffers(rows, members, 6, 10, BLOCK, device)
    steps = [
        [([30, 31, 32], [1, 6, 3]), ([33, 34, 35, 36, 37, 38], [3, 4])],  # two chunks
        [([35, 30], [2, 5]), ([], [7])],  # one group of 2 (a chunk), one row alone
    ]
    for seed, groups in enumerate(steps):
        meta = step_meta(groups, device)
        host = host_plan(meta)
        assert host is not None and buffers.fits(host)
        plan = buffers.fill(host)
        used, width = host.chunk_tables.shape
        assert torch.equal(plan.seq_prefix_lens[: meta.num_seqs].cpu(), host.seq_prefix_lens)
        assert torch.equal(plan.chunk_tables[:used, :width].cpu(), host.chunk_tables)
        assert torch.equal(plan.chunk_seqs[:used].cpu(), host.chunk_seqs)
        assert plan.chunk_prefix_lens[used:].eq(0).all()  # step A's extra chunk is empty now
        assert plan.seq_prefix_lens[meta.num_seqs :].eq(0).all()
        got = attend(meta, caches, seed, shared_prefix=plan)
        plain_meta = step_meta(groups, device)
        want = attend(plain_meta, caches, seed, cascade=NEVER)
        assert planned_shared_prefix(plain_meta) is None
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_plan_buffers_refuse_a_plan_that_does_not_fit() -> None:
    meta = step_meta([([30, 31, 32], [1, 6, 3, 2, 5])], "cpu")
    host = host_plan(meta)
    assert host is not None  # a prefix of 3 blocks: wider than 2
    small = PlanBuffers(8, members_per_chunk(HQ // HKV, torch.float32), 1, 2, BLOCK, "cpu")
    assert not small.fits(host)
    with pytest.raises(ValueError, match="does not fit"):
        small.fill(host)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_plans_from_host_tables_only(device: str) -> None:
    """The decode's plan comes from meta.block_tables_host: without it no plan is made (the
    device tables are never read back), with it the groups are found."""
    gen = torch.Generator().manual_seed(5)
    shape = (POOL, BLOCK, HKV, DIM)
    caches = (torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen))
    caches = (caches[0], caches[1].to(device))
    groups = [([30, 31, 32], [1, 6, 3])]
    with_host = step_meta(groups, device)
    without = step_meta(groups, device)
    without.block_tables_host = None
    a = attend(with_host, caches, 0, cascade=ALWAYS)
    b = attend(without, caches, 0, cascade=ALWAYS)
    plan = planned_shared_prefix(with_host)
    assert plan is not None and [g.members for g in plan.groups] == [[0, 1, 2]]
    assert planned_shared_prefix(without) is None
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_an_eager_plan_goes_over_as_one_buffer() -> None:
    """An eager step's plan is packed into one buffer (on CUDA pinned, sent in one
    non-blocking copy, as a graph's plan): each tensor keeps its values and shape, as views
    of that one buffer, aligned as fresh allocations."""
    groups = [PrefixGroup([0, 2, 3], [5, 6, 7]), PrefixGroup([1, 4], [9])]
    plan = build_shared_prefix_plan(groups, 6, BLOCK, 2, "cpu")
    packed = pack_plan(plan, torch.device("cpu"))
    names = ("seq_prefix_lens", "chunk_prefix_lens", "chunk_seqs", "chunk_tables")
    for name in names:
        assert torch.equal(getattr(packed, name), getattr(plan, name)), name
    tensors = [getattr(packed, name) for name in names]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    base = tensors[0].data_ptr()
    assert all((t.data_ptr() - base) % (4 * PlanBuffers.ALIGN) == 0 for t in tensors)
    assert (packed.groups, packed.prefix_lens) == (plan.groups, plan.prefix_lens)
