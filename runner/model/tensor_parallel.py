"""Tensor parallelism, Megatron-style, over a torch.distributed group.

Each rank holds a share of every layer: the q/k/v projection by whole KV-head groups (column
parallel), the output projection's matching columns (row parallel, then an all-reduce), the
MLP's gate and up rows and down columns (the same), and a slice of the vocabulary for the
embedding and the LM head. Head counts that do not divide by the ranks split unevenly, by whole
KV-head groups: the default model's 3 KV heads over 2 ranks go 2 and 1. Where the ranks
outnumber the KV heads, each KV head is replicated on the ranks that share its query heads, as
vLLM does. Rank 0 always takes the largest share, so a pool sized on rank 0 fits every rank.
The cutting itself is runner/model/sharding.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runner.model.layers import RMSNorm
from runner.model.shared_memory_reduce import SharedMemoryReduce


class Work(Protocol):
    def wait(self) -> bool: ...


class Collectives(Protocol):
    """What a torch.distributed backend (ProcessGroupGloo, ProcessGroupNCCL) offers, built
    straight from a store: never torch.distributed's default group, so that two engines can
    live in one process."""

    def allreduce(self, tensors: list[torch.Tensor]) -> Work: ...

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Work: ...

    def gather(
        self,
        outputs: Sequence[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        options: dist.GatherOptions,
    ) -> Work: ...

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work: ...


@dataclass(frozen=True)
class HeadShare:
    """One rank's heads: query heads [q_start, q_end), KV heads [kv_start, kv_end).
    `owns_kv`: the first of the ranks that share these KV heads (it alone counts them in a sum
    over all KV heads, OLMo 2's key norm)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    owns_kv: bool


def even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items go to `parts` parts as evenly as they
    can, the earlier parts taking one more."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def head_share(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShare:
    """The heads rank `rank` of `size` holds; ValueError where some rank would hold none."""
    if num_heads < size:
        raise ValueError(
            f"tensor_parallel_size={size} is more than the model's {num_heads} attention heads: "
            "each rank needs at least one"
        )
    per_group = num_heads // num_kv_heads
    if num_kv_heads >= size:  # whole KV-head groups, split as evenly as they go
        kv_start, kv_end = even_split(num_kv_heads, size, rank)
        return HeadShare(kv_start * per_group, kv_end * per_group, kv_start, kv_end, True)
    # Fewer KV heads than ranks: consecutive ranks share one KV head, replicated on each, and
    # split its group's query heads.
    kv = rank * num_kv_heads // size
    sharing = [r for r in range(size) if r * num_kv_heads // size == kv]
    if per_group < len(sharing):
        raise ValueError(
            f"tensor_parallel_size={size}: {len(sharing)} ranks would share a KV head that has "
            f"{per_group} query heads; choose a size that divides the heads more evenly"
        )
    q_start, q_end = even_split(per_group, len(sharing), sharing.index(rank))
    base = kv * per_group
    return HeadShare(base + q_start, base + q_end, kv, kv + 1, rank == sharing[0])


@dataclass(eq=False)
class TensorParallel:
    """This process's place in the group, and the collectives the sharded layers call.
    `deterministic`: sums in rank order (an all-gather, then adds in a fixed order), so a row's
    bits never depend on how the transport chunks the tensor, which follows the batch's size."""

    rank: int
    size: int
    group: Collectives
    deterministic: bool = False
    # Ranks of one machine's CPU: sums and gathers through shared memory, where they fit; the
    # group carries the rest.
    local: SharedMemoryReduce | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (the same shape on each), on every rank."""
        x = x.contiguous()
        if self.local is not None and self.local.fits(x):
            return self.local.all_reduce(x)
        if not self.deterministic or self.size == 2:  # two operands: a + b == b + a, bit for bit
            self.group.allreduce([x]).wait()
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        total = parts[0]
        for part in parts[1:]:
            total = total.add_(part)
        return total

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0: the ranks' [N, widths[r]] column blocks side by side, [N, sum(widths)];
        other ranks: None. Padded to the widest block on the wire (collectives take one
        shape)."""
        widest = max(widths)
        if x.shape[1] < widest:
            x = F.pad(x, (0, widest - x.shape[1]))
        x = x.contiguous()
        if self.local is not None and self.local.fits(x):
            parts = self.local.gather(x)
            if parts is None:
                return None
            return torch.cat([b[:, :w] for b, w in zip(parts, widths, strict=True)], dim=1)
        blocks: list[list[torch.Tensor]] = []
        if self.rank == 0:
            blocks.append([torch.empty_like(x) for _ in range(self.size)])
        options = dist.GatherOptions()
        options.rootRank = 0
        self.group.gather(blocks, [x], options).wait()
        if self.rank != 0:
            return None
        return torch.cat([b[:, :w] for b, w in zip(blocks[0], widths, strict=True)], dim=1)


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows of tokens [start, end): a token outside them looks up zeros, and the
    ranks' rows add up to the whole embedding."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, tp: TensorParallel) -> None:
        super().__init__(end - start, weight.shape[1], device="meta", dtype=weight.dtype)
        self.weight = nn.Parameter(weight[start:end].clone(), requires_grad=False)
        self.start, self.end = start, end
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        inside = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(inside, input_ids - self.start, 0)
        rows = F.embedding(local, self.weight) * inside.unsqueeze(1).to(self.weight.dtype)
        return self.tp.all_reduce(rows)


class SplitRMSNorm(RMSNorm):
    """An RMSNorm over a whole projection's width (OLMo 2's q and k norms) of which this rank
    holds a slice: the squares summed over every rank's slice, then this slice scaled as
    RMSNorm scales it in float32. `counts`: whether this rank's slice enters the sum (a KV
    head replicated on several ranks is counted once)."""

    def __init__(
        self, norm: RMSNorm, start: int, end: int, full_width: int, counts: bool, tp: TensorParallel
    ) -> None:
        super().__init__(end - start, norm.eps, True, norm.offset)
        self.weight = nn.Parameter(norm.weight[start:end].clone(), requires_grad=False)
        self.full_width = full_width
        self.counts = counts
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if not self.counts:
            squares = torch.zeros_like(squares)
        mean = self.tp.all_reduce(squares) / self.full_width
        xf = xf * torch.rsqrt(mean + self.eps)
        scale = self.weight.float() + self.offset
        return (scale * xf).to(x.dtype)
