"""Shared-prefix (cascade) decode attention equals plain attention over the gathered context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner.cascade import MIN_SHARED_TOKENS, cascade_attention, find_shared_prefix


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    ctxs: list[int],
    scale: float,
) -> torch.Tensor:
    """q [S, Hkv, G, D]: each sequence attends to its first ctx keys, gathered block by block."""
    out = []
    for s, ctx in enumerate(ctxs):
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        k = k_cache[tables[s]].reshape(-1, hkv, d)[:ctx].transpose(0, 1)  # [Hkv, C, D]
        v = v_cache[tables[s]].reshape(-1, hkv, d)[:ctx].transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[s], k, v, scale=scale))  # [Hkv, G, D]
    return torch.stack(out)


def decode_mask(tables: torch.Tensor, ctxs: list[int], block_size: int = 16) -> torch.Tensor:
    """[S, 1, 1, nb * B] keys each sequence's one decode query sees (its whole context)."""
    keys = torch.arange(tables.shape[1] * block_size).view(1, 1, 1, -1)
    return keys < torch.tensor(ctxs).view(-1, 1, 1, 1)


@pytest.mark.parametrize("block_size,group,shared_blocks", [(16, 3, 5), (8, 1, 9), (4, 4, 20)])
def test_cascade_matches_plain_attention(block_size: int, group: int, shared_blocks: int) -> None:
    gen = torch.Generator().manual_seed(block_size + group)
    num_blocks, hkv, d = 80, 2, 32
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    prefix = perm[:shared_blocks]
    ctxs = [shared_blocks * block_size + extra for extra in (1, 7, block_size, 2 * block_size + 3)]
    rest = iter(perm[shared_blocks:].tolist())
    max_blocks = max(-(-c // block_size) for c in ctxs)
    tables = torch.stack(
        [
            torch.cat(
                [prefix, torch.tensor([next(rest) for _ in range(max_blocks - shared_blocks)])]
            )
            for _ in ctxs
        ]
    )
    plan = find_shared_prefix(
        tables, [c - 1 for c in ctxs], decode_mask(tables, ctxs, block_size), block_size
    )
    assert plan is not None and plan.blocks.numel() == shared_blocks
    q = torch.randn(len(ctxs), hkv, group, d, generator=gen)
    # One query row per sequence: [S, 1, Hq, D] with query head h on KV head h // G.
    got = cascade_attention(
        q.reshape(len(ctxs), 1, hkv * group, d), k_cache, v_cache, plan, scale=d**-0.5
    ).view(len(ctxs), hkv, group, d)
    torch.testing.assert_close(
        got, reference(q, k_cache, v_cache, tables, ctxs, d**-0.5), atol=1e-5, rtol=1e-5
    )


def test_no_plan_without_a_long_shared_prefix() -> None:
    tables = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 10, 11]])
    few = (MIN_SHARED_TOKENS // 16) - 1
    assert (
        find_shared_prefix(tables, [95, 95], decode_mask(tables, [96, 96]), 16) is None or few >= 3
    )
    distinct = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 2, 3, 4, 5, 6]])
    assert find_shared_prefix(distinct, [95, 95], decode_mask(distinct, [96, 96]), 16) is None
    # A prefix as long as a whole context leaves that sequence no suffix key: capped.
    same = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    plan = find_shared_prefix(same, [95, 95], decode_mask(same, [96, 96]), 16)
    assert plan is not None and plan.blocks.numel() == 5
