"""One sequence's attention over its context read in parts: the torch path on the CPU for a
sequence that runs alone (a long conversation's decode, a prompt's chunk after a cached prefix).

A long context's blocks are seldom one range of the pool: they were taken a block at a time
beside other requests, or loaded a few at a time from a tier, so gathering them (index_select)
copies the whole context in every layer, and an additive mask over all of it slows torch's
flash kernel down again (2-3x the time of reading it in place, measured on 3k-token contexts).
So the context is split:

* each run of at least MIN_RUN_TOKENS keys in consecutive pool blocks, wholly before the first
  query, is read in place (a view: nothing copied);
* every other block (short runs, and the blocks holding the queries) is gathered in one call;
  only the keys at or after the first query need a mask, and a decode's one query sees all of
  its context, so a decode needs none;
* the parts' results are merged exactly through their log-sum-exps (attention over a set of
  keys does not depend on their order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# A run shorter than this costs more as a call of its own than gathering it with the rest.
MIN_RUN_TOKENS = 256
# At most this many runs are read in place (each is a flash call); the rest is gathered.
MAX_RUNS = 8


class ContextParts(NamedTuple):
    runs: list[slice]  # ranges of the pool read in place, every key of them visible
    gathered: torch.Tensor  # [n] int64 block ids read in one gather: the rest of the context
    gathered_keys: int  # the gathered keys in use (its last block may be partly filled)
    # [1, 1, L, gathered_keys] additive (0 = attend, -inf = not); None: all are visible.
    mask: torch.Tensor | None


def plan_context_parts(
    blocks: torch.Tensor,
    context_len: int,
    query_len: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> ContextParts:
    """The parts of a context of `context_len` keys in `blocks` [nb] (int64 pool ids) whose last
    `query_len` are the new tokens' (the queries)."""
    before = (context_len - query_len) // block_size  # blocks wholly before the first query
    ids = blocks[:before].cpu()
    edges = [0, *(torch.nonzero(ids[1:] - ids[:-1] != 1).flatten() + 1).tolist(), before]
    min_run = -(-MIN_RUN_TOKENS // block_size)
    runs: list[slice] = []
    rest: list[torch.Tensor] = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        if hi - lo >= min_run and len(runs) < MAX_RUNS:
            first = int(ids[lo])
            runs.append(slice(first, first + hi - lo))
        elif hi > lo:
            rest.append(ids[lo:hi])
    tail = blocks[before : -(-context_len // block_size)].cpu()  # the queries' own blocks
    gathered = torch.cat([*rest, tail])
    rest_keys = (gathered.numel() - tail.numel()) * block_size
    gathered_keys = rest_keys + context_len - before * block_size
    mask = None
    if query_len > 1:  # causal among the tail's keys; the rest is before every query
        pos_q = torch.arange(context_len - query_len, context_len, device=device)[:, None]
        index = torch.arange(gathered_keys, device=device)
        pos_k = index - rest_keys + before * block_size  # a tail key's position in the context
        visible = (pos_k[None, :] <= pos_q) | (index < rest_keys)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask = mask.masked_fill_(~visible, float("-inf"))[None, None]
    return ContextParts(runs, gathered.to(device), gathered_keys, mask)


def context_parts_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    parts: ContextParts,
    scale: float,
) -> torch.Tensor:
    """q [L, Hq, D] one sequence's queries; caches [blocks, B, Hkv, D]. Returns [L, Hq, D]:
    attention over the keys `parts` names, through torch's CPU flash kernel."""
    num_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if num_q == 1:
        # A decode: the G query heads of a KV head become G rows of it (one product a KV head).
        rows = q.view(1, hkv, hq // hkv, d)
    else:
        rows = q.transpose(0, 1)[None]  # [1, Hq, L, D]
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    for run in parts.runs:
        k, v = (
            cache[run].reshape(-1, hkv, d).transpose(0, 1)[None].to(q.dtype)
            for cache in (k_cache, v_cache)
        )
        out, lse = flash(rows, k, v, scale=scale)
        outs.append(out)
        lses.append(lse)
    if parts.gathered_keys:
        k, v = (
            cache.index_select(0, parts.gathered).view(-1, hkv, d)[: parts.gathered_keys]
            for cache in (k_cache, v_cache)
        )
        k, v = (part.transpose(0, 1)[None].to(q.dtype) for part in (k, v))  # widened if float16
        out, lse = flash(rows, k, v, attn_mask=parts.mask, scale=scale)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        merged = outs[0]
    else:
        # Each part's share of a row's softmax mass: e^lse_i / sum_j e^lse_j.
        weights = torch.softmax(torch.stack(lses).float(), dim=0)[..., None]
        merged = (torch.stack(outs).float() * weights).sum(0).to(q.dtype)
    if num_q == 1:
        return merged.reshape(1, hq, d)
    return merged[0].transpose(0, 1)  # [L, Hq, D]
