"""Shared-prefix ("cascade") attention for the torch path on the CPU.

When every sequence of a batch of short queries (decodes, suffixes after a cached prompt)
starts with the same KV blocks (a shared system prompt, few-shot examples), gathering those
blocks once per sequence is most of the attention cost. Here all query rows of the batch attend
to the shared prefix together in one call that reads the prefix in place, each sequence attends
to its own later keys in one padded call, and the two partial results are merged exactly through
their log-sum-exps.

Both calls go to torch's CPU flash-attention kernel, the one behind
F.scaled_dot_product_attention on the CPU, through the aten op that also returns the log-sum-exp.

Which sequences share which blocks is one concept for every backend: count_shared_blocks and
find_prefix_groups (several groups a step) are what the Triton decode path
(runner/backends/triton/shared_prefix.py) plans from as well.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Below this many shared tokens the split costs more than the gather it saves.
MIN_SHARED_TOKENS = 64


class SharedPrefix(NamedTuple):
    blocks: torch.Tensor  # [P] int64: block ids every sequence starts with
    suffix_blocks: torch.Tensor  # [S * Ns] int64: each sequence's blocks after the prefix
    # [S, 1, L, Ns * B] additive mask in the query dtype: 0 where padded query row l may see
    # suffix key k, -inf where not (the flash kernel takes no boolean masks).
    suffix_bias: torch.Tensor
    # The prefix blocks as a range of the pool when their ids are consecutive (the usual case:
    # one prompt's blocks come off the free list together), so they are read in place.
    block_range: slice | None = None


def cascade_supported(device: torch.device) -> bool:
    """The split needs torch's CPU flash kernel with its log-sum-exp (an aten op of torch 2.3
    and later); elsewhere the plan gathers the whole context instead."""
    return device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
    )


def count_shared_blocks(
    tables: torch.Tensor,
    first_query_pos: list[int],
    block_size: int,
    min_tokens: int = MIN_SHARED_TOKENS,
) -> int:
    """How many leading blocks every row of `tables` [S, nb] has in common and that lie wholly
    before every sequence's first query; 0 when that is under `min_tokens` tokens."""
    num_seqs, num_blocks = tables.shape
    if num_seqs < 2 or num_blocks < 2:
        return 0
    same = (tables == tables[:1]).all(dim=0).to(torch.int64)  # [nb]
    shared = int(same.cumprod(0).sum())
    # Each query's own key stays in the suffix, so neither part of a softmax row is empty.
    shared = min(shared, min(first_query_pos) // block_size)
    return shared if shared * block_size >= min_tokens else 0


class PrefixGroup(NamedTuple):
    """Sequences of a step that start with the same `blocks` (pool ids), all of them wholly
    before each member's first query: the shared prefix one pass can read for all of them."""

    members: list[int]  # rows of the step's batch, ascending
    blocks: list[int]


def find_prefix_groups(
    tables: torch.Tensor,
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    min_tokens: int = MIN_SHARED_TOKENS,
) -> list[PrefixGroup]:
    """The step's prefix groups, from its block tables [S, max_blocks] (on the host): the
    sequences with a query (query_len > 0) are bucketed by their first block id (the radix tree
    gives a prompt that shares a prefix the same physical blocks), and each bucket of two or more
    shares the leading blocks its members all have in common (count_shared_blocks), when that is
    at least `min_tokens` tokens. A bucket whose common run is too short forms no group; the
    backends read those members' contexts whole, as any other sequence's."""
    buckets: dict[int, list[int]] = {}
    # One host list of first blocks: indexing the tensor row by row costs ~1 us a row, and this
    # runs every decode step (256 rows: ~0.8 ms against ~0.05 ms).
    firsts = tables[:, 0].tolist() if tables.shape[1] else [0] * len(context_lens)
    for s, (q_len, ctx, first) in enumerate(zip(query_lens, context_lens, firsts, strict=True)):
        if q_len and ctx - q_len >= block_size:  # a whole block before its first query
            buckets.setdefault(first, []).append(s)
    groups: list[PrefixGroup] = []
    for members in buckets.values():
        if len(members) < 2:
            continue
        nb = -(-min(context_lens[s] for s in members) // block_size)
        rows = tables[torch.tensor(members), :nb]
        first = [context_lens[s] - query_lens[s] for s in members]
        shared = count_shared_blocks(rows, first, block_size, min_tokens)
        if shared:
            groups.append(PrefixGroup(members, rows[0, :shared].tolist()))
    return groups


def shared_prefix(
    tables: torch.Tensor, shared: int, key_mask: torch.Tensor, block_size: int, dtype: torch.dtype
) -> SharedPrefix:
    """The plan for `tables` [S, nb] int64 whose first `shared` blocks are common; `key_mask`
    [S, 1, L, nb * B] bool says which keys each padded query row sees."""
    prefix = tables[0, :shared]
    first = int(prefix[0])
    consecutive = bool((prefix == torch.arange(first, first + shared)).all())
    visible = key_mask[..., shared * block_size :]
    bias = torch.zeros(visible.shape, dtype=dtype, device=key_mask.device)
    return SharedPrefix(
        blocks=prefix.to(key_mask.device),
        suffix_blocks=tables[:, shared:].reshape(-1).to(key_mask.device),
        suffix_bias=bias.masked_fill_(~visible, float("-inf")),
        block_range=slice(first, first + shared) if consecutive else None,
    )


def _prefix_kv(cache: torch.Tensor, plan: SharedPrefix, dtype: torch.dtype) -> torch.Tensor:
    """The shared prefix's keys or values as [1, Hkv, P * B, D] in `dtype`: a view when the
    blocks are a range of the pool of that dtype, else one copy."""
    _, _, hkv, d = cache.shape
    part = cache[plan.block_range] if plan.block_range else cache.index_select(0, plan.blocks)
    return part.reshape(-1, hkv, d).transpose(0, 1)[None].to(dtype)


def cascade_attention(
    q: torch.Tensor,
    q_padded: torch.Tensor,
    valid: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: SharedPrefix,
    scale: float,
) -> torch.Tensor:
    """q [R, Hq, D] the batch's real query rows; q_padded [S, L, Hq, D] the same rows padded
    to L per sequence, `valid` [S * L] marking the real ones in q's order (None: no padding).
    Caches [blocks, B, Hkv, D]. Returns [R, Hq, D], equal to attention over prefix + causally
    masked suffix keys."""
    num_seqs, rows, hq, d = q_padded.shape
    hkv = k_cache.shape[2]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # Prefix: every real row against one copy of the shared keys; none needs a mask.
    out_p, lse_p = flash(
        q.transpose(0, 1)[None],
        _prefix_kv(k_cache, plan, q.dtype),
        _prefix_kv(v_cache, plan, q.dtype),
        scale=scale,
    )  # [1, Hq, R, D], [1, Hq, R]
    # Suffix: each sequence against its own blocks after the prefix, causally masked.
    suffix = [
        cache.index_select(0, plan.suffix_blocks).view(num_seqs, -1, hkv, d).transpose(1, 2)
        for cache in (k_cache, v_cache)
    ]
    ks, vs = (part.to(q.dtype) for part in suffix)  # a float16 cache's values, widened
    if rows == 1:
        # Decodes: the G query heads of a KV head become G rows of it (one small product per KV
        # head instead of G; a third less time here), and the [S, 1, 1, K] mask broadcasts.
        q_rows = q_padded.view(num_seqs, hkv, hq // hkv, d)
        out_s, lse_s = flash(q_rows, ks, vs, attn_mask=plan.suffix_bias, scale=scale)
    else:
        out_s, lse_s = flash(
            q_padded.transpose(1, 2), ks, vs, attn_mask=plan.suffix_bias, scale=scale
        )  # [S, Hq, L, D], [S, Hq, L]
        out_s, lse_s = out_s.transpose(1, 2), lse_s.transpose(1, 2)
    out_s = out_s.reshape(num_seqs * rows, hq, d)
    lse_s = lse_s.reshape(num_seqs * rows, hq)
    if valid is not None:
        out_s, lse_s = out_s[valid], lse_s[valid]
    # The prefix's share of each row's softmax mass: e^lse_p / (e^lse_p + e^lse_s).
    weight = torch.sigmoid(lse_p[0].t() - lse_s)[..., None]  # [R, Hq, 1] float32
    merged = torch.lerp(out_s.float(), out_p[0].transpose(0, 1).float(), weight)
    return merged.to(q.dtype)
