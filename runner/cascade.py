"""Shared-prefix ("cascade") attention for the torch path.

When every sequence of a batch of short queries (decodes, suffixes after a cached prompt)
starts with the same KV blocks (a shared system prompt, few-shot examples), gathering those
blocks once per sequence is most of the attention cost on the CPU. Here the shared blocks are
read once and scored by all queries together in one product, each sequence's own suffix blocks
are scored apart, and one softmax over both parts' scores makes the result exact.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Below this many shared tokens the split costs more than the gather it saves.
MIN_SHARED_TOKENS = 64


class SharedPrefix(NamedTuple):
    blocks: torch.Tensor  # [P] int64: block ids every sequence starts with
    suffix_blocks: torch.Tensor  # [S * Ns] int64: each sequence's blocks after the prefix
    suffix_mask: torch.Tensor  # [S, 1, L, Ns * B] bool: query row l may see suffix key k
    # The prefix blocks as a range of the pool when their ids are consecutive (the usual case:
    # one prompt's blocks come off the free list together), so they are read in place.
    block_range: slice | None = None


def find_shared_prefix(
    tables: torch.Tensor,
    first_query_pos: list[int],
    key_mask: torch.Tensor,
    block_size: int,
) -> SharedPrefix | None:
    """`tables` [S, nb] int64 block tables of a padded batch, `first_query_pos` the position of
    each sequence's first query, `key_mask` [S, 1, L, nb * B] which keys each (padded) query row
    sees. Returns the plan when all rows share at least MIN_SHARED_TOKENS leading tokens'
    blocks that lie wholly before every query (so no query needs a mask over them)."""
    num_seqs, num_blocks = tables.shape
    if num_seqs < 2 or num_blocks < 2:
        return None
    same = (tables == tables[:1]).all(dim=0).to(torch.int64)  # [nb]
    shared = int(same.cumprod(0).sum())
    # Each query's own key stays in the suffix, so neither part of a softmax row is empty.
    shared = min(shared, min(first_query_pos) // block_size)
    if shared * block_size < MIN_SHARED_TOKENS:
        return None
    prefix = tables[0, :shared]
    first = int(prefix[0])
    consecutive = bool((prefix == torch.arange(first, first + shared)).all())
    return SharedPrefix(
        blocks=prefix.to(key_mask.device),
        suffix_blocks=tables[:, shared:].reshape(-1).to(key_mask.device),
        suffix_mask=key_mask[..., shared * block_size :],
        block_range=slice(first, first + shared) if consecutive else None,
    )


def _prefix_kv(cache: torch.Tensor, plan: SharedPrefix) -> torch.Tensor:
    """The shared prefix's keys or values as [P * B, Hkv, D], a view when the blocks are a
    range of the pool, else one gathered copy."""
    _, _, hkv, d = cache.shape
    part = cache[plan.block_range] if plan.block_range else cache.index_select(0, plan.blocks)
    return part.reshape(-1, hkv, d)


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: SharedPrefix,
    scale: float,
) -> torch.Tensor:
    """q [S, L, Hq, D] (L query rows per sequence, padded); caches [blocks, B, Hkv, D].
    Returns [S, L, Hq, D], equal to attention over prefix + causally masked suffix keys.

    Both parts' scores go through one softmax over [prefix | suffix] keys; the weighted
    values of the two parts are then summed, which is exactly attention over all keys."""
    num_seqs, rows, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    # Query head h uses KV head h // G: [S, L, Hkv, G, D], pre-scaled (fewer products).
    q5 = (q.float() * scale).view(num_seqs, rows, hkv, group, d)
    # Prefix: every query row of a KV head against one copy of the shared keys.
    kp = _prefix_kv(k_cache, plan).float()  # [P, Hkv, D]
    vp = _prefix_kv(v_cache, plan).float()
    num_prefix = kp.shape[0]
    qp = q5.permute(2, 0, 1, 3, 4).reshape(hkv, -1, d)  # [Hkv, S*L*G, D]
    scores_p = torch.bmm(qp, kp.permute(1, 2, 0))  # [Hkv, S*L*G, P]
    scores_p = scores_p.view(hkv, num_seqs, rows * group, num_prefix).transpose(0, 1)
    # Suffix: each sequence against its own blocks after the prefix, causally masked.
    ks = k_cache.index_select(0, plan.suffix_blocks).view(num_seqs, -1, hkv, d).float()
    vs = v_cache.index_select(0, plan.suffix_blocks).view(num_seqs, -1, hkv, d).float()
    qs = q5.permute(0, 2, 1, 3, 4).reshape(num_seqs, hkv, rows * group, d)
    scores_s = torch.matmul(qs, ks.permute(0, 2, 3, 1))  # [S, Hkv, L*G, Ks]
    num_suffix = scores_s.shape[-1]
    mask = plan.suffix_mask.view(num_seqs, 1, rows, 1, num_suffix)
    scores_s.view(num_seqs, hkv, rows, group, num_suffix).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(torch.cat((scores_p, scores_s), dim=-1), dim=-1)  # [S,Hkv,L*G,P+Ks]
    probs_p, probs_s = probs.split([num_prefix, num_suffix], dim=-1)
    out_p = torch.bmm(
        probs_p.transpose(0, 1).reshape(hkv, -1, num_prefix), vp.transpose(0, 1)
    )  # [Hkv, S*L*G, D]
    out = torch.matmul(probs_s, vs.transpose(1, 2))  # [S, Hkv, L*G, D]
    out += out_p.view(hkv, num_seqs, rows * group, d).transpose(0, 1)
    out = out.view(num_seqs, hkv, rows, group, d).permute(0, 2, 1, 3, 4)  # [S, L, Hkv, G, D]
    return out.reshape(num_seqs, rows, hq, d).to(q.dtype)
