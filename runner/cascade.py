"""Shared-prefix ("cascade") decode attention for the torch path.

When every sequence of a decode batch starts with the same KV blocks (a shared system prompt,
few-shot examples), gathering those blocks once per sequence is most of the attention cost on
the CPU. Here the shared blocks are read once and scored by all queries together in one
product, each sequence's own suffix blocks are scored apart, and one softmax over both parts'
scores makes the result exact.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Below this many shared tokens the split costs more than the gather it saves.
MIN_SHARED_TOKENS = 64


class SharedPrefix(NamedTuple):
    blocks: torch.Tensor  # [P] int64: block ids every sequence starts with
    suffix_blocks: torch.Tensor  # [S * Ns] int64: each sequence's blocks after the prefix
    suffix_mask: torch.Tensor  # [S, 1, 1, Ns * B] bool: suffix keys inside the context
    # The prefix blocks as a range of the pool when their ids are consecutive (the usual case:
    # one prompt's blocks come off the free list together), so they are read in place.
    block_range: slice | None = None


def find_shared_prefix(
    tables: torch.Tensor, context_lens: list[int], block_size: int, device: torch.device
) -> SharedPrefix | None:
    """`tables` [S, nb] int64 block tables of a decode batch. Returns the plan when all rows
    share at least MIN_SHARED_TOKENS leading tokens' blocks, strictly inside every context."""
    num_seqs, num_blocks = tables.shape
    if num_seqs < 2 or num_blocks < 2:
        return None
    same = (tables == tables[:1]).all(dim=0).to(torch.int64)  # [nb]
    shared = int(same.cumprod(0).sum())
    # Keep at least one key per sequence in the suffix, so neither softmax part is empty.
    shared = min(shared, (min(context_lens) - 1) // block_size)
    if shared * block_size < MIN_SHARED_TOKENS:
        return None
    suffix = tables[:, shared:]
    keys = shared * block_size + torch.arange(suffix.shape[1] * block_size, device=device)
    ctx = torch.tensor(context_lens, device=device).view(-1, 1, 1, 1)
    prefix = tables[0, :shared]
    first = int(prefix[0])
    consecutive = bool((prefix == torch.arange(first, first + shared)).all())
    return SharedPrefix(
        blocks=prefix.to(device),
        suffix_blocks=suffix.reshape(-1).to(device),
        suffix_mask=keys.view(1, 1, 1, -1) < ctx,
        block_range=slice(first, first + shared) if consecutive else None,
    )


def _prefix_kv(cache: torch.Tensor, plan: SharedPrefix) -> torch.Tensor:
    """The shared prefix's keys or values as [P * B, Hkv, D], a view when the blocks are a
    range of the pool, else one gathered copy."""
    _, _, hkv, d = cache.shape
    part = cache[plan.block_range] if plan.block_range else cache.index_select(0, plan.blocks)
    return part.reshape(-1, hkv, d)


def cascade_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: SharedPrefix,
    scale: float,
) -> torch.Tensor:
    """q [S, Hkv, G, D] (G query heads per KV head); caches [blocks, B, Hkv, D].
    Returns [S, Hkv, G, D], equal to attention over prefix + suffix keys.

    Both parts' scores go through one softmax over [prefix | suffix] keys; the weighted
    values of the two parts are then summed, which is exactly attention over all keys."""
    num_seqs, hkv, group, d = q.shape
    qf = q.float() * scale
    # Prefix: all S*G queries of a KV head against one copy of the shared keys.
    kp = _prefix_kv(k_cache, plan).float()  # [P, Hkv, D]
    vp = _prefix_kv(v_cache, plan).float()
    num_prefix = kp.shape[0]
    qp = qf.permute(1, 0, 2, 3).reshape(hkv, num_seqs * group, d)  # [Hkv, S*G, D]
    scores_p = torch.bmm(qp, kp.permute(1, 2, 0))  # [Hkv, S*G, P]
    scores_p = scores_p.view(hkv, num_seqs, group, num_prefix).transpose(0, 1)  # [S,Hkv,G,P]
    # Suffix: each sequence against its own blocks after the prefix.
    ks = k_cache.index_select(0, plan.suffix_blocks).view(num_seqs, -1, hkv, d).float()
    vs = v_cache.index_select(0, plan.suffix_blocks).view(num_seqs, -1, hkv, d).float()
    scores_s = torch.matmul(qf, ks.permute(0, 2, 3, 1))  # [S, Hkv, G, Ks]
    scores_s.masked_fill_(~plan.suffix_mask, float("-inf"))
    probs = torch.softmax(torch.cat((scores_p, scores_s), dim=-1), dim=-1)
    probs_p, probs_s = probs.split([num_prefix, scores_s.shape[-1]], dim=-1)
    out_p = torch.bmm(
        probs_p.transpose(0, 1).reshape(hkv, num_seqs * group, num_prefix), vp.transpose(0, 1)
    )  # [Hkv, S*G, D]
    out = torch.matmul(probs_s, vs.transpose(1, 2))  # [S, Hkv, G, D]
    out += out_p.view(hkv, num_seqs, group, d).transpose(0, 1)
    return out.to(q.dtype)
