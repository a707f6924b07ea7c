"""The Triton decode's shared-prefix plan: which decodes read which prefix once, as fixed-shape
device tensors, and the K/V bytes a step reads with and without it.

The groups come from the same grouping as the CPU path (runner/backends/torch/cascade.py:
find_prefix_groups); the cost model (cascade_cost.py) keeps a group only where reading its
prefix once is worth it. A group of n members is cut into chunks of `members_per_chunk`
sequences: one program of the prefix pass (decode_prefix.py) scores all the query heads of one
KV head for a whole chunk (GQA packed: members x heads query rows), so a chunk reads the prefix
once per KV head, and the group cdiv(n, members_per_chunk) times instead of n.

Every tensor has a fixed shape once `capacity` is given (chunks, prefix blocks), so that a
CUDA graph captured over one plan's tensors replays with any later plan copied into them
(`copy_into`): unused chunks have prefix length 0 and their programs return at once; a
sequence outside every group has prefix length 0 and reads its whole context in its own pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from runner.backends.torch.cascade import PrefixGroup, find_prefix_groups
from runner.backends.triton.cascade_cost import (
    DEFAULT_THRESHOLDS,
    CascadeThresholds,
    use_shared_prefix,
)

# Query rows one prefix-pass program scores (members x query heads of one KV head): a
# [ROWS, D] tile, as a flash-attention kernel's. More rows read the prefix fewer times.
PREFIX_ROWS = 128
PREFIX_ROWS_FP32 = 64  # fp32 tiles take twice the shared memory


def members_per_chunk(group_size: int, dtype: torch.dtype) -> int:
    """Members one program takes: as many as fill its query rows with all their heads."""
    rows = PREFIX_ROWS_FP32 if dtype == torch.float32 else PREFIX_ROWS
    return max(1, rows // group_size)


@dataclass
class SharedPrefixPlan:
    """A decode step's prefix groups as the kernels read them (all int32, on the device)."""

    seq_prefix_lens: torch.Tensor  # [S] shared tokens each sequence's own pass skips (0: none)
    chunk_seqs: torch.Tensor  # [C, M] batch rows of each chunk's members, -1 past the last
    chunk_tables: torch.Tensor  # [C, P] each chunk's prefix blocks (pool ids), 0-padded
    chunk_prefix_lens: torch.Tensor  # [C] tokens of each chunk's prefix; 0: an unused chunk
    max_prefix_len: int  # host bound of chunk_prefix_lens: the prefix pass's grid
    groups: list[PrefixGroup]  # host copy: what the plan was built from
    chunks_per_group: list[int]
    prefix_lens: list[int]  # host copy: tokens of each group's prefix

    @property
    def members_per_chunk(self) -> int:
        return int(self.chunk_seqs.shape[1])

    def copy_into(self, other: SharedPrefixPlan) -> None:
        """Write this plan into `other`'s tensors (a graph's static ones, as large or larger),
        queued on the stream without a host sync; other's unused chunks become empty."""
        c, p = self.chunk_tables.shape
        if c > other.chunk_tables.shape[0] or p > other.chunk_tables.shape[1]:
            raise ValueError(
                f"plan of {c} chunks x {p} blocks does not fit {tuple(other.chunk_tables.shape)}"
            )
        s = self.seq_prefix_lens.shape[0]
        other.seq_prefix_lens[:s].copy_(self.seq_prefix_lens, non_blocking=True)
        other.seq_prefix_lens[s:].zero_()
        other.chunk_prefix_lens.zero_()
        other.chunk_prefix_lens[:c].copy_(self.chunk_prefix_lens, non_blocking=True)
        other.chunk_seqs[:c].copy_(self.chunk_seqs, non_blocking=True)
        other.chunk_tables[:c, :p].copy_(self.chunk_tables, non_blocking=True)


class PlanBuffers:
    """A decode graph's fixed-shape plan: the four plan tensors as views of one flat int32
    device buffer, so that a step's plan (built on the host) goes over in one non-blocking copy
    from pinned memory before the replay. A pageable copy could wait for the step in flight
    (asynchronous scheduling, runner/engine/step/overlap.py); torch's pinned allocator keeps each
    step's staging buffer until its copy has run, so a later step never overwrites it early."""

    ALIGN = 64  # int32 elements (256 bytes) between the views: aligned as fresh allocations

    def __init__(
        self,
        num_seqs: int,
        members: int,
        chunks: int,
        blocks: int,
        block_size: int,
        device: torch.device | str,
    ) -> None:
        self.shape = (num_seqs, members, chunks, blocks)
        sizes = [num_seqs, chunks, chunks * members, chunks * blocks]
        self.offsets: list[int] = []
        total = 0
        for n in sizes:
            self.offsets.append(total)
            total += -(-n // self.ALIGN) * self.ALIGN
        self.device = torch.device(device)
        self.flat = torch.zeros(total, dtype=torch.int32, device=self.device)
        self.plan = self._views(self.flat, block_size)
        self.plan.chunk_seqs.fill_(-1)

    def _views(self, flat: torch.Tensor, block_size: int) -> SharedPrefixPlan:
        s, m, c, p = self.shape
        o = self.offsets
        return SharedPrefixPlan(
            seq_prefix_lens=flat[o[0] : o[0] + s],
            chunk_prefix_lens=flat[o[1] : o[1] + c],
            chunk_seqs=flat[o[2] : o[2] + c * m].view(c, m),
            chunk_tables=flat[o[3] : o[3] + c * p].view(c, p),
            max_prefix_len=p * block_size,  # the prefix pass's grid covers the widest prefix
            groups=[],
            chunks_per_group=[],
            prefix_lens=[],
        )

    def fits(self, plan: SharedPrefixPlan) -> bool:
        """Whether a host-built plan fits these buffers (rows, members, chunks, blocks)."""
        s, m, c, p = self.shape
        rows, width = plan.chunk_tables.shape
        return (
            plan.seq_prefix_lens.shape[0] <= s
            and plan.members_per_chunk == m
            and rows <= c
            and width <= p
        )

    def fill(self, plan: SharedPrefixPlan) -> SharedPrefixPlan:
        """Queue `plan` (CPU tensors, `fits`) into the device buffers; every row, chunk and
        block past it becomes empty (prefix length 0, no member). Returns the device plan, with
        `plan`'s host copies (groups, prefix lengths) for byte counts."""
        if not self.fits(plan):
            raise ValueError(f"plan {tuple(plan.chunk_tables.shape)} does not fit {self.shape}")
        pinned = self.device.type == "cuda"
        host = torch.zeros(self.flat.shape[0], dtype=torch.int32, pin_memory=pinned)
        view = self._views(host, 1)
        view.chunk_seqs.fill_(-1)
        rows, width = plan.chunk_tables.shape
        view.seq_prefix_lens[: plan.seq_prefix_lens.shape[0]] = plan.seq_prefix_lens
        view.chunk_prefix_lens[:rows] = plan.chunk_prefix_lens
        view.chunk_seqs[:rows] = plan.chunk_seqs
        view.chunk_tables[:rows, :width] = plan.chunk_tables
        self.flat.copy_(host, non_blocking=True)
        self.plan.groups = plan.groups
        self.plan.chunks_per_group = plan.chunks_per_group
        self.plan.prefix_lens = plan.prefix_lens
        return self.plan


def build_shared_prefix_plan(
    groups: list[PrefixGroup],
    num_seqs: int,
    block_size: int,
    members: int,
    device: torch.device | str,
    capacity: tuple[int, int] | None = None,
) -> SharedPrefixPlan:
    """The plan of `groups` over a batch of `num_seqs` decodes, `members` sequences a chunk;
    `capacity` (chunks, prefix blocks) pads it to a graph's fixed shape."""
    seq_lens = [0] * num_seqs
    chunks: list[tuple[list[int], list[int]]] = []
    per_group: list[int] = []
    for group in groups:
        for s in group.members:
            seq_lens[s] = len(group.blocks) * block_size
        cut = [group.members[i : i + members] for i in range(0, len(group.members), members)]
        chunks += [(rows, group.blocks) for rows in cut]
        per_group.append(len(cut))
    num_chunks = max(len(chunks), 1)
    width = max([len(blocks) for _, blocks in chunks] or [1])
    if capacity is not None:
        if capacity[0] < len(chunks) or capacity[1] < width:
            raise ValueError(f"{len(chunks)} chunks x {width} blocks exceed capacity {capacity}")
        num_chunks, width = capacity
    chunk_seqs = torch.full((num_chunks, members), -1, dtype=torch.int32)
    tables = torch.zeros((num_chunks, width), dtype=torch.int32)
    lens = torch.zeros(num_chunks, dtype=torch.int32)
    for c, (rows, blocks) in enumerate(chunks):
        chunk_seqs[c, : len(rows)] = torch.tensor(rows, dtype=torch.int32)
        tables[c, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        lens[c] = len(blocks) * block_size
    plan = SharedPrefixPlan(
        seq_prefix_lens=torch.tensor(seq_lens, dtype=torch.int32),
        chunk_seqs=chunk_seqs,
        chunk_tables=tables,
        chunk_prefix_lens=lens,
        max_prefix_len=width * block_size if capacity else int(lens.max()),
        groups=groups,
        chunks_per_group=per_group,
        prefix_lens=[len(g.blocks) * block_size for g in groups],
    )
    return upload_plan(plan, torch.device(device))


def upload_plan(plan: SharedPrefixPlan, device: torch.device) -> SharedPrefixPlan:
    """`plan` (CPU tensors) on `device`: on CUDA its four tensors packed into one pinned buffer
    and sent in one non-blocking copy, as a decode graph's plan goes over (PlanBuffers.fill);
    four pageable `.to(device)` copies would each wait for the step in flight. On the CPU, the
    plan as it is."""
    return plan if device.type == "cpu" else pack_plan(plan, device)


def pack_plan(plan: SharedPrefixPlan, device: torch.device) -> SharedPrefixPlan:
    """`plan`'s four tensors as views of one int32 buffer on `device`, filled on the host
    (pinned where `device` is CUDA) and sent in one non-blocking copy."""
    c, m = plan.chunk_seqs.shape
    p = plan.chunk_tables.shape[1]
    parts = [plan.seq_prefix_lens, plan.chunk_prefix_lens, plan.chunk_seqs, plan.chunk_tables]
    align = PlanBuffers.ALIGN
    offsets: list[int] = []
    total = 0
    for part in parts:
        offsets.append(total)
        total += -(-part.numel() // align) * align
    host = torch.zeros(total, dtype=torch.int32, pin_memory=device.type == "cuda")
    for part, at in zip(parts, offsets, strict=True):
        host[at : at + part.numel()] = part.reshape(-1)
    flat = host.to(device, non_blocking=True)  # the pinned allocator keeps `host` until done
    s = plan.seq_prefix_lens.shape[0]
    o = offsets
    return SharedPrefixPlan(
        seq_prefix_lens=flat[o[0] : o[0] + s],
        chunk_prefix_lens=flat[o[1] : o[1] + c],
        chunk_seqs=flat[o[2] : o[2] + c * m].view(c, m),
        chunk_tables=flat[o[3] : o[3] + c * p].view(c, p),
        max_prefix_len=plan.max_prefix_len,
        groups=plan.groups,
        chunks_per_group=plan.chunks_per_group,
        prefix_lens=plan.prefix_lens,
    )


def plan_decode_step(
    tables: torch.Tensor,
    context_lens: list[int],
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    thresholds: CascadeThresholds = DEFAULT_THRESHOLDS,
) -> SharedPrefixPlan | None:
    """The shared-prefix plan of a decode step (block tables [S, max_blocks] on the host,
    context lengths with the new token), keeping the groups the cost model accepts; None when
    it accepts none (the plain decode then runs, unchanged)."""
    if len(context_lens) < max(2, thresholds.min_group_size):
        return None
    min_tokens = max(thresholds.min_prefix_tokens, block_size)
    if max(context_lens) <= min_tokens:
        return None
    gqa = num_q_heads // num_kv_heads
    members = members_per_chunk(gqa, dtype)
    per_token = 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    found = find_prefix_groups(
        tables, context_lens, [1] * len(context_lens), block_size, min_tokens
    )
    kept = [
        g
        for g in found
        if use_shared_prefix(
            len(g.blocks) * block_size,
            len(g.members),
            -(-len(g.members) // members),
            per_token,
            thresholds,
        )
    ]
    if not kept:
        return None
    return build_shared_prefix_plan(kept, len(context_lens), block_size, members, device)


class KVBytes(NamedTuple):
    """K/V bytes a decode step reads from the cache, both ways."""

    plain: int  # every decode reads its whole (windowed) context
    shared: int  # each group's prefix once per chunk, every sequence its own suffix


def decode_kv_bytes(
    context_lens: list[int],
    plan: SharedPrefixPlan | None,
    kv_bytes_per_token: int,
    num_layers: int,
    window: int | None = None,
) -> KVBytes:
    """The K/V bytes a decode step of these context lengths loads in `num_layers` layers
    (`kv_bytes_per_token`: K and V of all KV heads of one token in one layer), as the kernels
    load them: the plain kernel each sequence's last min(C, W) keys; with the plan, the prefix
    pass every key of a chunk's prefix once per chunk (a window masks there, it does not skip),
    and each sequence's own pass its keys from max(prefix, C - W)."""
    plain = sum(c if window is None else min(c, window) for c in context_lens)
    scale = kv_bytes_per_token * num_layers
    if plan is None:
        return KVBytes(plain * scale, plain * scale)
    prefix_of = [0] * len(context_lens)  # from the host copies: no device read
    for group, tokens in zip(plan.groups, plan.prefix_lens, strict=True):
        for s in group.members:
            prefix_of[s] = tokens
    low = [
        p if window is None else max(p, c - window)
        for c, p in zip(context_lens, prefix_of, strict=True)
    ]
    own = sum(c - lo for c, lo in zip(context_lens, low, strict=True))
    prefix = sum(
        chunks * tokens
        for chunks, tokens in zip(plan.chunks_per_group, plan.prefix_lens, strict=True)
    )
    return KVBytes(plain * scale, (own + prefix) * scale)
