"""Shared-prefix ("cascade") decode attention for the torch path.

When every sequence of a decode batch starts with the same KV blocks (a shared system prompt,
few-shot examples), gathering those blocks once per sequence is most of the attention cost on
the CPU. Here the shared blocks are read once and attended by all queries together, each
sequence's own suffix blocks are attended apart, and the two partial softmaxes are merged
exactly through their log-sum-exp.
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
    return SharedPrefix(
        blocks=tables[0, :shared].to(device),
        suffix_blocks=suffix.reshape(-1).to(device),
        suffix_mask=keys.view(1, 1, 1, -1) < ctx,
    )


def _partial(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted values and log-sum-exp of `scores` [..., K] over `v` [..., K, D]."""
    peak = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    return (weights @ v) / total, peak + torch.log(total)


def cascade_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: SharedPrefix,
    scale: float,
) -> torch.Tensor:
    """q [S, Hkv, G, D] (G query heads per KV head); caches [blocks, B, Hkv, D].
    Returns [S, Hkv, G, D], equal to attention over prefix + suffix keys."""
    num_seqs, hkv, group, d = q.shape
    qf = q.float()
    # Prefix: all S*G queries of a KV head against one copy of the shared keys.
    kp = k_cache.index_select(0, plan.blocks).view(-1, hkv, d).transpose(0, 1).float()  # [Hkv,P,D]
    vp = v_cache.index_select(0, plan.blocks).view(-1, hkv, d).transpose(0, 1).float()
    qp = qf.permute(1, 0, 2, 3).reshape(hkv, num_seqs * group, d)  # [Hkv, S*G, D]
    out_p, lse_p = _partial((qp @ kp.transpose(1, 2)) * scale, vp)  # [Hkv, S*G, D], [.., 1]
    out_p = out_p.view(hkv, num_seqs, group, d).transpose(0, 1)  # [S, Hkv, G, D]
    lse_p = lse_p.view(hkv, num_seqs, group, 1).transpose(0, 1)
    # Suffix: each sequence against its own blocks after the prefix.
    ks = k_cache.index_select(0, plan.suffix_blocks).view(num_seqs, -1, hkv, d)
    vs = v_cache.index_select(0, plan.suffix_blocks).view(num_seqs, -1, hkv, d)
    ks = ks.transpose(1, 2).float()  # [S, Hkv, Ks, D]
    vs = vs.transpose(1, 2).float()
    scores = (qf @ ks.transpose(-1, -2)) * scale  # [S, Hkv, G, Ks]
    scores = scores.masked_fill(~plan.suffix_mask, float("-inf"))
    out_s, lse_s = _partial(scores, vs)
    # Merge the two normalised parts by their share of the total softmax mass.
    lse = torch.logaddexp(lse_p, lse_s)
    merged = out_p * torch.exp(lse_p - lse) + out_s * torch.exp(lse_s - lse)
    return merged.to(q.dtype)
