"""tiled_decode.c against prefill_attention.c: a decode's row equals bit for bit the prompt row
at the same position computed by the prefill tile, alone or in a prompt of any length, with or
without a prefix shared by every decode (scored for all of them together first), a sliding
window and a soft cap. decode_attention.c, the default decode kernel, sums in another order:
the negative control."""

from __future__ import annotations

import pytest
import torch

from runner.backends.cpu.kernel import CpuKernels
from runner.backends.cpu.loader import load_cpu_kernels

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU's C kernels (AVX-512)")

HQ, HKV, D, BLOCK = 6, 2, 32, 8
SHARED_BLOCKS = 9  # 72 keys: not a multiple of 16, so the shared pass stops at 64


def kernels() -> CpuKernels:
    assert KERNELS is not None
    return KERNELS


def caches(blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks, BLOCK, HKV, D)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def tables(contexts: list[int], width: int) -> torch.Tensor:
    """Every sequence starts with blocks 0 .. SHARED_BLOCKS - 1, then blocks of its own."""
    rows, next_block = [], SHARED_BLOCKS
    for context in contexts:
        need = -(-context // BLOCK)
        own = list(range(next_block, next_block + need - SHARED_BLOCKS))
        next_block += len(own)
        row = list(range(SHARED_BLOCKS)) + own
        rows.append(row + [0] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.int32)


def prefill_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    context: int,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The whole context as one prompt: [context, Hq, D] through the prefill tile."""
    out = torch.empty_like(q)
    kernels().prefill_attention(
        q, k, v, table[None], torch.tensor([0]), torch.tensor([context]),
        torch.tensor([context]), out, 0.125, window, softcap,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (40, None), (None, 3.0)])
def test_a_decode_row_equals_the_prefill_tiles_row(
    window: int | None, softcap: float | None
) -> None:
    contexts = [75, 90, 101, 76, 120, 99, 83, 88]  # every one past the shared 72 keys
    width = -(-max(contexts) // BLOCK)
    table = tables(contexts, width)
    k, v = caches(int(table.max()) + 1, 0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randn(c, HQ, D, generator=gen) for c in contexts]
    expected = [
        prefill_rows(p, k, v, table[i], c, window, softcap)[-1]
        for i, (p, c) in enumerate(zip(prompts, contexts, strict=True))
    ]
    last = torch.stack([p[-1] for p in prompts])
    lens = torch.tensor(contexts, dtype=torch.int32)
    for shared in (0, SHARED_BLOCKS):  # alone, and the prefix scored for all rows first
        tiled = kernels().decode_attention(
            last, k, v, table, lens, 0.125, shared, window, softcap, tiled=True
        )
        for i in range(len(contexts)):
            assert torch.equal(tiled[i], expected[i]), f"sequence {i}, shared blocks {shared}"
    plain = kernels().decode_attention(last, k, v, table, lens, 0.125, 0, window, softcap)
    assert not torch.equal(plain, torch.stack(expected))  # the default kernel's other order
