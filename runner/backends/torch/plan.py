"""The per-step plan of the torch attention path: which sequences run alone and which run as
one padded group (and whether that group reads a shared prefix once:
runner/backends/torch/cascade.py).

Built once per step from the AttentionMetadata and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runner.backends.torch.cascade import (
    SharedPrefix,
    cascade_supported,
    count_shared_blocks,
    shared_prefix,
)
from runner.backends.torch.context_parts import ContextParts, plan_context_parts

if TYPE_CHECKING:
    from runner.attention.metadata import AttentionMetadata

# Sequences whose query is at most this long are batched into one padded SDPA; longer
# ones run alone (padding them to the longest query would waste work).
GROUP_MAX_QUERY_LEN = 16
# Queries up to this long join the group when all its sequences share a cached prefix: the
# prefix is then scored for all rows in one call, without padding, so longer suffixes gain too.
CASCADE_MAX_QUERY_LEN = 64
# At most this many long-context decodes leave a padded group to run alone (each costs a call),
# and only those reading at least MIN_OUTLIER_KEYS keys (below that, padding is cheaper).
MAX_CONTEXT_OUTLIERS = 4
MIN_OUTLIER_KEYS = 256


@dataclass
class Single:
    """One long query run alone."""

    start: int
    end: int
    blocks: torch.Tensor | None  # [nb] int64 block ids; None: no cached prefix, use k/v
    context_len: int
    mask: torch.Tensor | None  # [L, C] additive, in the query dtype: 0 = attend, -inf = not
    # Set on the CPU for a cached context: read in parts, its long runs of consecutive blocks
    # in place and the rest in one gather (runner/backends/torch/context_parts.py).
    parts: ContextParts | None = None


@dataclass
class Group:
    """Short queries run as one padded batch of S sequences, each padded to L queries."""

    num_seqs: int
    max_query_len: int
    num_keys: int  # nb * B
    blocks: torch.Tensor  # [S * nb] int64
    q_rows: torch.Tensor | slice  # [S * L] rows of q (padding repeats a valid row)
    out_rows: torch.Tensor | slice | None  # rows of out for the valid queries
    valid: torch.Tensor | None  # [S * L] bool, None when nothing is padded
    mask: torch.Tensor  # [S, 1, L, nb * B] additive, in the query dtype: 0 = attend, -inf = not
    shared: SharedPrefix | None = None  # set when all rows share leading blocks


@dataclass
class Decodes:
    """The step's decodes (one query each), for a decode kernel that reads their blocks in
    place: their rows of q, block tables [S, max_blocks] int32 and context lengths [S] int32."""

    rows: torch.Tensor | slice
    tables: torch.Tensor
    contexts: torch.Tensor


@dataclass
class Plan:
    block_size: int
    singles: list[Single]
    group: Group | None
    decodes: Decodes | None = None
    decodes_apart: bool = False  # built for a decode kernel: every decode is in `decodes`


def as_index(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    """A slice when rows are consecutive (a view instead of a gather), else a tensor."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=device)


def build_plan(
    meta: AttentionMetadata,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    window: int | None = None,
    decodes_apart: bool = False,
) -> Plan:
    """The step's plan; with a sliding `window`, every mask also hides the keys at or before
    p - window from the query at p, and nothing is read in place (a shared prefix is scored
    whole, which a window may cut). With `decodes_apart`, the decodes are left to a decode
    kernel (Plan.decodes) and the rest planned as without them."""
    starts: list[int] = []
    start = 0
    for q_len in meta.query_lens:
        starts.append(start)
        start += q_len
    apart = [s for s, q_len in enumerate(meta.query_lens) if q_len == 1] if decodes_apart else []
    lens = [0 if decodes_apart and q_len == 1 else q_len for q_len in meta.query_lens]
    short = [s for s, q_len in enumerate(lens) if 0 < q_len <= CASCADE_MAX_QUERY_LEN]
    split = cascade_supported(device) and window is None
    shared = _shared_blocks(meta, short, block_size) if split else 0
    grouped = short if shared else [s for s in short if meta.query_lens[s] <= GROUP_MAX_QUERY_LEN]
    # Keys each member pads to: its whole context, or in a cascade what follows the prefix.
    keys = [ctx - shared * block_size for ctx in meta.context_lens_host]
    grouped = _without_outlying_contexts(grouped, keys)
    if split and len(grouped) == 1:
        grouped = []  # alone, it pads to nothing: it reads its context in parts, as a single
    group = (
        _build_group(meta, grouped, starts, block_size, device, dtype, shared, window)
        if grouped
        else None
    )
    in_group = set(grouped)
    singles = [
        _single_plan(meta, s, starts[s], block_size, device, dtype, split, window)
        for s, q_len in enumerate(lens)
        if q_len and s not in in_group
    ]
    decodes = _decodes(meta, apart, starts, device) if apart else None
    return Plan(block_size, singles, group, decodes, decodes_apart)


def _decodes(
    meta: AttentionMetadata, members: list[int], starts: list[int], device: torch.device
) -> Decodes:
    idx = torch.tensor(members, dtype=torch.int64, device=meta.block_tables.device)
    return Decodes(
        as_index([starts[s] for s in members], device),
        meta.block_tables.index_select(0, idx).to(torch.int32).contiguous(),
        meta.context_lens.index_select(0, idx).to(torch.int32).contiguous(),
    )


def _without_outlying_contexts(members: list[int], keys: list[int]) -> list[int]:
    """The group pads every member to the most keys any of them reads, so one long
    conversation among short ones would have them all gather and score its length. The longest
    members leave (to run alone, reading only their own keys) while padding would more than
    double the work and the outlier is long enough for that to outweigh a call of its own."""
    kept = sorted(members, key=lambda s: keys[s])
    alone = 0
    while len(kept) > 1 and alone < MAX_CONTEXT_OUTLIERS and keys[kept[-1]] >= MIN_OUTLIER_KEYS:
        if keys[kept[-1]] * len(kept) <= 2 * sum(keys[s] for s in kept):
            break
        kept.pop()
        alone += 1
    return sorted(kept)


def _shared_blocks(meta: AttentionMetadata, members: list[int], block_size: int) -> int:
    """Leading blocks all `members` share before their first queries (0 if too few)."""
    if len(members) < 2:
        return 0
    nb = -(-min(meta.context_lens_host[s] for s in members) // block_size)
    idx = torch.tensor(members, dtype=torch.int64, device=meta.block_tables.device)
    tables = meta.block_tables.index_select(0, idx)[:, :nb].cpu()
    first = [meta.context_lens_host[s] - meta.query_lens[s] for s in members]
    return count_shared_blocks(tables, first, block_size)


def _single_plan(
    meta: AttentionMetadata,
    s: int,
    start: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    split: bool,
    window: int | None,
) -> Single:
    """Sequence s runs alone: plain causal SDPA on its new k/v, or over its gathered blocks
    with the causal mask shifted by its cached prefix, or on the CPU in parts (see
    Single.parts)."""
    q_len, ctx = meta.query_lens[s], meta.context_lens_host[s]
    pos_q = torch.arange(ctx - q_len, ctx, device=device)  # [L] query positions
    if ctx == q_len:  # no cached prefix: the new k/v, causal (and windowed: a mask)
        mask = None if window is None else _additive(visible_keys(ctx, pos_q, window), dtype)
        return Single(start, start + q_len, None, ctx, mask)
    nb = -(-ctx // block_size)
    blocks = meta.block_tables[s, :nb].to(torch.int64)
    if split:
        parts = plan_context_parts(blocks, ctx, q_len, block_size, dtype, device)
        return Single(start, start + q_len, None, ctx, None, parts)
    mask = _additive(visible_keys(ctx, pos_q, window), dtype)  # [L, C]
    return Single(start, start + q_len, blocks, ctx, mask)


def visible_keys(num_keys: int, pos_q: torch.Tensor, window: int | None) -> torch.Tensor:
    """[..., num_keys] bool: key j is visible to the query at position p (pos_q [...]) when
    j <= p and, with a sliding window, j > p - window."""
    keys = torch.arange(num_keys, device=pos_q.device)
    visible = keys <= pos_q[..., None]
    if window is not None:
        visible &= keys > pos_q[..., None] - window
    return visible


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as an additive one (0 = attend, -inf = not): SDPA would convert a
    boolean mask in every layer."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def _build_group(
    meta: AttentionMetadata,
    members: list[int],
    starts: list[int],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    shared: int,
    window: int | None,
) -> Group:
    """Sequences `members` as one batch padded to the longest query, with the shared-prefix
    plan when they all start with the same `shared` blocks (0: they do not)."""
    lens = [meta.query_lens[s] for s in members]
    ctxs = [meta.context_lens_host[s] for s in members]
    n, max_l = len(members), max(lens)
    nb = -(-max(ctxs) // block_size)
    idx = torch.tensor(members, dtype=torch.int64, device=meta.block_tables.device)
    blocks = meta.block_tables.index_select(0, idx)[:, :nb].reshape(-1).to(device, torch.int64)
    q_rows: list[int] = []  # padded query i of seq s reads row start + min(i, L - 1)
    q_pos: list[int] = []  # its position, so its mask row is a real causal row
    valid: list[bool] = []
    for s, q_len, ctx in zip(members, lens, ctxs, strict=True):
        for i in range(max_l):
            j = min(i, q_len - 1)
            q_rows.append(starts[s] + j)
            q_pos.append(ctx - q_len + j)
            valid.append(i < q_len)
    pos = torch.tensor(q_pos, dtype=torch.int64, device=device).view(n, 1, max_l)
    # [S, 1, L, K]; pads beyond a context sit after its last query
    visible = visible_keys(nb * block_size, pos, window)
    padded = not all(valid)
    out_rows = [r for r, ok in zip(q_rows, valid, strict=True) if ok]
    return Group(
        num_seqs=n,
        max_query_len=max_l,
        num_keys=nb * block_size,
        blocks=blocks,
        q_rows=as_index(q_rows, device) if padded else as_index(out_rows, device),
        out_rows=as_index(out_rows, device),
        valid=torch.tensor(valid, device=device) if padded else None,
        mask=_additive(visible, dtype),
        shared=(
            shared_prefix(blocks.view(n, nb), shared, visible, block_size, dtype)
            if shared
            else None
        ),
    )
