"""Reused segments placed and blended: the model's side of reuse beyond the prefix.

A segment cached on its own holds the K/V of its tokens computed alone, at positions 0 .. n - 1.
Placed at position `start` of another prompt it needs two things:

* its keys re-rotated (`place`): RoPE turns each key pair by position * theta, and rotations
  compose, so turning a cached key by `start` * theta gives the key at its new position, exact
  up to rounding (done in float32). Layers without RoPE keep their keys; a partial rotary head
  turns its leading dims only; each layer type turns by its own frequencies.
* the attention to what now precedes it (`blend`), which no cached value holds: selective
  recompute (CacheBlend's idea). Layers 0 .. `select_layer` run for every token of the region,
  writing fresh K/V; at `select_layer` each reused token's fresh values are compared with its
  placed cached ones, and the `ratio` of the reused tokens that moved most, with every token
  that has no cached K/V, go on through the later layers as single rows (a row of position p
  attends to the region's K/V up to p, fresh where it was recomputed, cached elsewhere). The
  others keep their cached K/V in those layers. The hidden states are dropped: the prompt's
  last token, after the region, is computed by the ordinary prefill that follows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from runner.attention.backend import AttentionBackend
from runner.attention.metadata import AttentionMetadata
from runner.kv_pool.store import KVStore
from runner.model.decoder import CausalLM, RopeRows
from runner.model.decoder_layers import Attention
from runner.model.layers import apply_rope, rope_inv_freq

# The layer whose value deviation picks the tokens to recompute: the first whose K/V depend on
# the context (a layer-0 key depends on its token and position alone).
SELECT_LAYER = 1


@dataclass(frozen=True)
class Placement:
    """Cached K/V moved into a prompt's slots: source slot, destination slot and how far each
    token moved (destination position less source position), one entry per token."""

    src_slots: torch.Tensor  # [N] int64
    dst_slots: torch.Tensor  # [N] int64
    shift: torch.Tensor  # [N] int64


@dataclass(frozen=True)
class BlendRegion:
    """The prompt positions [start, start + len(tokens)) whose K/V a blend writes.

    `reused` marks the positions whose placed cached K/V may stay; `segments` are the
    region-relative [lo, hi) runs of reused tokens, each picked from on its own."""

    start: int
    tokens: list[int]
    reused: list[bool]
    segments: list[tuple[int, int]]
    block_table: list[int]


class Cached(NamedTuple):
    """A segment whose first `num_tokens` tokens' K/V, computed alone, are in `blocks`; it
    sits at position `start` of the prompt."""

    start: int
    num_tokens: int
    blocks: Sequence[int]


def layout(
    token_ids: Sequence[int],
    start: int,
    end: int,
    cached: Sequence[Cached],
    block_table: Sequence[int],
    block_size: int,
) -> tuple[Placement, BlendRegion]:
    """Where the cached segments' K/V go in a prompt's blocks, and the region [start, end) a
    blend then writes (the segments in order, all inside it)."""
    bs, table = block_size, list(block_table)
    src, dst, shift, reused = [], [], [], [False] * (end - start)
    spans = []
    for segment in cached:
        for j in range(segment.num_tokens):
            p = segment.start + j
            src.append(segment.blocks[j // bs] * bs + j % bs)
            dst.append(table[p // bs] * bs + p % bs)
            shift.append(segment.start)
            reused[p - start] = True
        spans.append((segment.start - start, segment.start - start + segment.num_tokens))
    as_long = (torch.tensor(x, dtype=torch.int64) for x in (src, dst, shift))
    region = BlendRegion(start, list(token_ids[start:end]), reused, spans, table)
    return Placement(*as_long), region


def compute_chunk(
    model: CausalLM,
    kv: KVStore,
    attention: AttentionBackend,
    token_ids: list[int],
    start: int,
    block_table: list[int],
) -> torch.Tensor:
    """Positions [start, start + len(token_ids)) of one prompt whose earlier K/V are in its
    blocks already: their K/V written, their hidden states after the final norm returned (a
    segment computed alone, or a prompt's part around a blend)."""
    n, device = len(token_ids), kv.device
    meta = AttentionMetadata.build([n], [start + n], [block_table], kv.block_size, device)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    positions = torch.arange(start, start + n, dtype=torch.int64, device=device)
    out: torch.Tensor = model(ids, positions, meta, kv, attention)
    return out


def place(model: CausalLM, kv: KVStore, placement: Placement) -> None:
    """Copy cached K/V into their destination slots across every layer, keys turned by their
    shift. Mutates the destination slots only (the caller owns them)."""
    src, dst, shift = placement.src_slots, placement.dst_slots, placement.shift
    if src.numel() == 0:
        return
    turns = _turns(model, shift.to(kv.device))
    src, dst = src.to(kv.device), dst.to(kv.device)
    for i, layer in enumerate(model.layers):
        attn: Attention = layer.self_attn  # type: ignore[assignment]
        k_cache, v_cache = kv.layer(i)
        keys = k_cache.view(-1, kv.num_kv_heads, kv.head_dim)
        values = v_cache.view(-1, kv.num_kv_heads, kv.head_dim)
        k = keys.index_select(0, src)
        if attn.use_rope:
            cos, sin = turns[attn.rope_type]
            k = apply_rope(k.float(), cos, sin).to(keys.dtype)
        keys.index_copy_(0, dst, k)
        values.index_copy_(0, dst, values.index_select(0, src))


def _turns(
    model: CausalLM, shift: torch.Tensor
) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """float32 (cos, sin) rows in rope_cos_sin's layout for turning keys by `shift` positions,
    per layer type: pure rotations (no attention scale: the cached keys carry theirs)."""
    turns = {}
    for kind in set(model.layer_rope_types):
        inv_freq, _ = rope_inv_freq(model.config, model.head_dim, kind)
        angle = shift.double()[:, None].cpu() * inv_freq.double()[None, :]  # [N, R/2]
        cos, sin = angle.cos().float(), angle.sin().float()
        device = shift.device
        turns[kind] = (
            torch.cat((cos, cos), dim=-1).to(device),
            torch.cat((-sin, sin), dim=-1).to(device),
        )
    return turns


def blend(
    model: CausalLM,
    kv: KVStore,
    attention: AttentionBackend,
    region: BlendRegion,
    ratio: float,
    select_layer: int = SELECT_LAYER,
) -> int:
    """Write the region's K/V in every layer, recomputing the tokens that need it (see the
    module). The reused positions must already hold their placed cached K/V. Returns how many
    reused tokens were recomputed past `select_layer`. Mutates the region's slots only."""
    device, bs = kv.device, kv.block_size
    n = len(region.tokens)
    positions = torch.arange(region.start, region.start + n, dtype=torch.int64)
    reused = torch.tensor(region.reused, dtype=torch.bool)
    table = torch.tensor(region.block_table, dtype=torch.int64)
    slots = table[positions // bs] * bs + positions % bs
    h = model.embed(torch.tensor(region.tokens, dtype=torch.int64, device=device))
    if ratio <= 0:  # only the tokens without cached K/V, through every layer
        forced = torch.nonzero(~reused).flatten()
        if forced.numel():
            rows = _rows(model, kv, positions[forced], region.block_table)
            h = h.index_select(0, forced.to(device))
            _run(model, kv, attention, h, rows, range(model.num_layers))
        return 0
    whole = _rows(model, kv, positions, region.block_table, contiguous=True)
    h = _run(model, kv, attention, h, whole, range(select_layer))
    _, v_cache = kv.layer(select_layer)
    before = _slot_values(v_cache, slots, kv)
    h = _run(model, kv, attention, h, whole, range(select_layer, select_layer + 1))
    moved = (_slot_values(v_cache, slots, kv) - before).pow(2).sum(-1)
    if model.tp is not None:  # over every rank's heads, so that all ranks pick the same tokens
        moved = model.tp.all_reduce(moved if model.counts_kv else torch.zeros_like(moved))
    keep = _most_moved(moved.cpu(), region.segments, ratio) | ~reused
    active = torch.nonzero(keep).flatten()
    rows = _rows(model, kv, positions[active], region.block_table)
    deeper = range(select_layer + 1, model.num_layers)
    _run(model, kv, attention, h.index_select(0, active.to(device)), rows, deeper)
    return int((keep & reused).sum())


@dataclass(frozen=True)
class Rows:
    """Tokens of one prompt run through some layers: their metadata and RoPE rows."""

    meta: AttentionMetadata
    cos: torch.Tensor
    sin: torch.Tensor
    by_type: RopeRows


def _rows(
    model: CausalLM,
    kv: KVStore,
    positions: torch.Tensor,
    table: list[int],
    contiguous: bool = False,
) -> Rows:
    """Rows at these positions of a prompt with this block table: one chunk of consecutive
    positions (`contiguous`), or any positions, each a row that sees the prompt up to it."""
    device, bs = kv.device, kv.block_size
    if contiguous:
        n, start = positions.numel(), int(positions[0])
        meta = AttentionMetadata.build([n], [start + n], [table], bs, device)
    else:
        meta = _single_rows(positions, table, bs, device)
    cos, sin, by_type = model.rope_rows(positions.to(device))
    return Rows(meta, cos, sin, by_type)


def _run(
    model: CausalLM,
    kv: KVStore,
    attention: AttentionBackend,
    h: torch.Tensor,
    rows: Rows,
    span: range,
) -> torch.Tensor:
    return model.run_layers(h, rows.cos, rows.sin, rows.by_type, rows.meta, kv, attention, span)


def _slot_values(v_cache: torch.Tensor, slots: torch.Tensor, kv: KVStore) -> torch.Tensor:
    """The values at these slots, float32 [N, Hkv * D]. Values, not keys, pick the tokens to
    recompute: on the blend bench's passages, choosing by how far the values moved gave a
    lower KL divergence from full prefill than by the keys or both (0.072 nats against 0.083
    and 0.082 at ratio 0.15, docs/SEGMENTS.md)."""
    s = slots.to(v_cache.device)
    return v_cache.view(-1, kv.num_kv_heads * kv.head_dim).index_select(0, s).float()


def _most_moved(moved: torch.Tensor, segments: list[tuple[int, int]], ratio: float) -> torch.Tensor:
    """[N] bool: of the segments' tokens together, the ceil(ratio * their count) whose values
    moved most (ties to the earlier token, so the pick never depends on the sort's internals).
    Picked across segments, not per segment: a segment placed where its context changed most
    gets more of the recompute (on the blend bench, 0.063 nats of KL against 0.072 per segment
    at ratio 0.15, and 0.046 against 0.056 at 0.3)."""
    keep = torch.zeros(moved.shape[0], dtype=torch.bool)
    candidates = [j for lo, hi in segments for j in range(lo, hi)]
    count = min(len(candidates), math.ceil(ratio * len(candidates)))
    order = sorted(candidates, key=lambda j: (-float(moved[j]), j))
    keep[order[:count]] = True
    return keep


def _single_rows(
    positions: torch.Tensor, block_table: list[int], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Metadata for tokens computed one row each: the row of position p sees positions 0 .. p
    of the prompt through its block table (any set of positions, in one call)."""
    count = positions.numel()
    contexts = (positions + 1).tolist()
    return AttentionMetadata.build([1] * count, contexts, [block_table] * count, block_size, device)
