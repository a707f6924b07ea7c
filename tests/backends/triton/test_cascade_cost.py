"""The cost model that decides when a decode group reads its shared prefix once: its decisions
on the bench's model shapes, and that they only ever widen with a longer prefix or a bigger
group (bench/gpu/cascade.py measures the kernel on a GPU to fit the thresholds)."""

from __future__ import annotations

import pytest
import torch

from runner.backends.triton.cascade_cost import (
    ALWAYS,
    DEFAULT_THRESHOLDS,
    NEVER,
    CascadeThresholds,
    saved_bytes,
    use_shared_prefix,
)
from runner.backends.triton.shared_prefix import members_per_chunk

# K and V of every KV head of one token in one layer, bf16: Qwen3-0.6B (8 x 128), SmolLM2 (3 x 64)
QWEN3 = 2 * 8 * 128 * 2
SMOLLM2 = 2 * 3 * 64 * 2


def decide(prefix: int, group: int, per_token: int, gqa: int, t: CascadeThresholds) -> bool:
    reads = -(-group // members_per_chunk(gqa, torch.bfloat16))
    return use_shared_prefix(prefix, group, reads, per_token, t)


def test_saved_bytes() -> None:
    assert saved_bytes(2048, 256, 4, QWEN3) == 252 * 2048 * 4096
    assert saved_bytes(100, 3, 3, QWEN3) == 0


@pytest.mark.parametrize(
    ("prefix", "group", "per_token", "gqa", "expected"),
    [
        (2048, 256, QWEN3, 2, True),  # the bench's workload: 2,048 shared tokens, 256 decodes
        (2048, 256, SMOLLM2, 3, True),
        (4096, 4, QWEN3, 2, True),  # 3 x 4,096 tokens x 4 KiB = 48 MiB saved a layer
        (2048, 8, SMOLLM2, 3, False),  # 10.5 MiB: under the launch's worth
        (256, 8, QWEN3, 2, False),  # 7 MiB
        (128, 256, QWEN3, 2, False),  # a short prefix: never
        (16, 256, QWEN3, 2, False),
        (4096, 3, QWEN3, 2, False),  # too few members
        (4096, 2, QWEN3, 2, False),
    ],
)
def test_default_decisions(
    prefix: int, group: int, per_token: int, gqa: int, expected: bool
) -> None:
    assert decide(prefix, group, per_token, gqa, DEFAULT_THRESHOLDS) is expected


def test_decisions_widen_with_prefix_and_group() -> None:
    """Over the range the rule covers (prefixes 16..4,096, groups 2..256): once a point is
    accepted, every longer prefix and bigger group is too; NEVER and ALWAYS are the bounds."""
    prefixes = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    groups = [2, 3, 4, 8, 16, 32, 64, 128, 256]
    for per_token, gqa in ((QWEN3, 2), (SMOLLM2, 3)):
        grid = [
            [decide(p, g, per_token, gqa, DEFAULT_THRESHOLDS) for g in groups] for p in prefixes
        ]
        for i, row in enumerate(grid):
            for j, accepted in enumerate(row):
                if accepted:
                    assert all(grid[i2][j2] for i2 in range(i, 9) for j2 in range(j, 9))
        assert not any(decide(p, g, per_token, gqa, NEVER) for p in prefixes for g in groups)
        assert all(decide(p, g, per_token, gqa, ALWAYS) for p in prefixes for g in groups)
        assert any(map(any, grid)) and not all(map(all, grid))
