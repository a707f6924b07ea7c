"""Shared-prefix (cascade) attention equals plain attention over the gathered context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner.backends.torch.cascade import (
    MIN_SHARED_TOKENS,
    cascade_attention,
    count_shared_blocks,
    shared_prefix,
)


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
    shared = count_shared_blocks(tables, [c - 1 for c in ctxs], block_size)
    assert shared == shared_blocks
    mask = decode_mask(tables, ctxs, block_size)
    plan = shared_prefix(tables, shared, mask, block_size, torch.float32)
    q = torch.randn(len(ctxs), hkv, group, d, generator=gen)
    # One query row per sequence: [S, Hq, D] with query head h on KV head h // G.
    rows = q.reshape(len(ctxs), hkv * group, d)
    got = cascade_attention(rows, rows[:, None], None, k_cache, v_cache, plan, scale=d**-0.5).view(
        len(ctxs), hkv, group, d
    )
    torch.testing.assert_close(
        got, reference(q, k_cache, v_cache, tables, ctxs, d**-0.5), atol=1e-5, rtol=1e-5
    )


def test_no_plan_without_a_long_shared_prefix() -> None:
    assert MIN_SHARED_TOKENS > 3 * 16
    tables = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 10, 11]])
    assert count_shared_blocks(tables, [95, 95], 16) == 0  # 48 shared tokens: too few
    distinct = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 2, 3, 4, 5, 6]])
    assert count_shared_blocks(distinct, [95, 95], 16) == 0
    # A prefix as long as a whole context leaves that sequence no suffix key: capped.
    same = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    assert count_shared_blocks(same, [95, 95], 16) == 5
    assert count_shared_blocks(same, [95, 70], 16) == 4  # before the earliest first query
