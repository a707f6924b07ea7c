"""One sequence's attention over its context read in parts: the torch path on the CPU for a
sequence that runs alone (a long conversation's decode, a prompt's chunk after a cached prefix).

A long context's blocks are seldom one range of the pool: they were taken a block at a time
beside other requests, or loaded a few at a time from a tier, so gathering them (index_select)
copies the whole context in every layer, and an additive mask over all of it slows torch's
flash kernel down again (2-3x the time of reading it in place, measured on 3k-token contexts).
So the context is split:

* each run of at least MIN_RUN_TOKENS keys in consecutive pool blocks, wholly before the first
  query, is read in place (a view: nothing copied);
* every other block (short runs, and the blocks holding the queries) is gathered: a decode's
  one query sees all of its context, so it needs one gather and no mask; several queries need
  a causal mask over their own blocks only, gathered apart from the rest;
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


class Gather(NamedTuple):
    """Blocks read in one gather: their first `keys` keys (the last block may be partly
    filled), with an additive `mask` [1, 1, L, keys] (0 = attend, -inf = not) or None when
    every query sees every one of them."""

    blocks: torch.Tensor  # [n] int64 pool ids
    keys: int
    mask: torch.Tensor | None


class ContextParts(NamedTuple):
    runs: list[slice]  # ranges of the pool read in place, every key of them visible
    gathers: list[Gather]  # the rest of the context


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
    pieces: list[torch.Tensor] = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        if hi - lo >= min_run and len(runs) < MAX_RUNS:
            first = int(ids[lo])
            runs.append(slice(first, first + hi - lo))
        elif hi > lo:
            pieces.append(ids[lo:hi])
    rest = torch.cat(pieces) if pieces else ids[:0]
    tail = blocks[before : -(-context_len // block_size)].cpu()  # the queries' own blocks
    tail_keys = context_len - before * block_size
    if query_len == 1:  # a decode sees its whole context: the rest and its block in one gather
        whole = torch.cat([rest, tail]).to(device)
        return ContextParts(runs, [Gather(whole, rest.numel() * block_size + tail_keys, None)])
    # Several queries: causal among the tail's keys, while the rest comes before all of them
    # (a mask over it would slow the flash kernel for nothing).
    gathers = [Gather(rest.to(device), rest.numel() * block_size, None)] if rest.numel() else []
    pos_q = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    pos_k = torch.arange(before * block_size, context_len, device=device)[None, :]
    mask = torch.zeros(pos_k.shape[1:], dtype=dtype, device=device).expand(query_len, -1).clone()
    mask.masked_fill_(pos_k > pos_q, float("-inf"))
    gathers.append(Gather(tail.to(device), tail_keys, mask[None, None]))
    return ContextParts(runs, gathers)


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
    results = []
    for run in parts.runs:
        k, v = (
            cache[run].reshape(-1, hkv, d).transpose(0, 1)[None].to(q.dtype)
            for cache in (k_cache, v_cache)
        )
        results.append(flash(rows, k, v, scale=scale))
    for gather in parts.gathers:
        k, v = (
            cache.index_select(0, gather.blocks).view(-1, hkv, d)[: gather.keys]
            .transpose(0, 1)[None].to(q.dtype)  # widened where the cache is float16
            for cache in (k_cache, v_cache)
        )  # fmt: skip
        results.append(flash(rows, k, v, attn_mask=gather.mask, scale=scale))
    if len(results) == 1:
        merged = results[0][0]
    else:
        # Each part's share of a row's softmax mass: e^lse_i / sum_j e^lse_j.
        weights = torch.softmax(torch.stack([lse for _, lse in results]).float(), dim=0)
        outs = torch.stack([out for out, _ in results]).float()
        merged = (outs * weights[..., None]).sum(0).to(q.dtype)
    if num_q == 1:
        return merged.reshape(1, hq, d)
    return merged[0].transpose(0, 1)  # [L, Hq, D]
