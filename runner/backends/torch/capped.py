"""Attention with soft-capped scores (Gemma 2): the torch path's reference.

Each score s = (q . k) * scale becomes cap * tanh(s / cap) before the mask and the softmax, as
transformers' Gemma 2 computes it (divide, tanh, multiply, add the mask, softmax in float32).
SDPA has no such step, so this path scores explicitly: one sequence at a time, its keys
gathered through its block table, the G query heads of each KV head together (GQA without
repeating K/V). The C and Triton kernels take the cap in their own score loops.
"""

from __future__ import annotations

import torch

from runner.backends.torch.plan import visible_keys


def capped_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [blocks, B, Hkv, D], the step's new keys already written
    v_cache: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    scale: float,
    softcap: float,
    window: int | None,
) -> torch.Tensor:
    """[T, Hq, D]: query i of a sequence with query length L and context C (position
    p = C - L + i) attends to keys j <= p (and j > p - window) with capped scores."""
    num_tokens, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = q.new_empty((num_tokens, hq, d))
    start = 0
    for s, (q_len, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        if not q_len:
            continue
        blocks = block_tables[s, : -(-ctx // block_size)].to(torch.int64)
        keys = k_cache.index_select(0, blocks).flatten(0, 1)[:ctx].to(q.dtype)  # [C, Hkv, D]
        values = v_cache.index_select(0, blocks).flatten(0, 1)[:ctx].to(q.dtype)
        rows = q[start : start + q_len].view(q_len, hkv, group, d).permute(1, 2, 0, 3)
        scores = rows @ keys.permute(1, 2, 0)[:, None] * scale  # [Hkv, G, L, C]
        scores = torch.tanh(scores / softcap) * softcap
        positions = torch.arange(ctx - q_len, ctx, device=q.device)  # [L]
        scores = scores.masked_fill(~visible_keys(ctx, positions, window), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        heads = probs @ values.permute(1, 0, 2)[:, None]  # [Hkv, G, L, D]
        out[start : start + q_len] = heads.permute(2, 0, 1, 3).reshape(q_len, hq, d)
        start += q_len
    return out
