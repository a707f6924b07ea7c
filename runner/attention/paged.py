"""Paged attention over flat (varlen) token batches: the torch reference path.

Each step the model runner describes the batch once in an AttentionMetadata; every
layer then calls paged_attention(), which writes the new K/V into the store at
``slot_mapping`` and lets each query token attend causally to its sequence's context
(cached prefix + new tokens) read back through the block table.

Torch path strategy (no per-token Python loops; the plan is built once per step and
shared by all layers):
- long queries (prefill chunks) run one SDPA per sequence; with no cached prefix they
  use k/v directly with is_causal, else they gather their blocks and use a causal mask
  shifted by the prefix length (on the CPU, a cached prefix of consecutive blocks is read in
  place instead, through the same split as the cascade below);
- short queries (decodes, short suffixes) run as one padded batch: their blocks are
  gathered with one index_select and masked by context length;
- when every sequence of that batch starts with the same blocks, the shared prefix is read
  once for all of them (runner/attention/cascade.py, CPU only), and queries up to
  CASCADE_MAX_QUERY_LEN join the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from runner.attention.capped import capped_attention
from runner.attention.cascade import cascade_attention
from runner.attention.plan import build_plan


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * B + offset) of each new token
    query_start_loc: torch.Tensor  # [S+1] int32: cu_seqlens of the new tokens per sequence
    context_lens: torch.Tensor  # [S] int32: tokens in KV per sequence, new ones included
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_lens: list[int]  # host copies for the torch path
    context_lens_host: list[int]
    max_query_len: int
    max_context_len: int
    decode_only: bool  # every query_len == 1
    # Built by the torch path / the CPU kernels on first use, reused by every layer of the step.
    _torch_plan: Any = field(default=None, init=False, repr=False, compare=False)
    # The torch path's plans for sliding windows, by window: its layers may mix several.
    _window_plans: dict[int, Any] = field(default_factory=dict, init=False, repr=False)
    _cpu_split: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences whose new tokens sit at positions C - L .. C - 1.

        A convenience for tests and simple runners: slots come from the block tables."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables differ in length")
        slots: list[int] = []
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            if q_len > ctx or len(table) * block_size < ctx:
                raise ValueError(f"bad sequence: query {q_len}, context {ctx}, {len(table)} blocks")
            for pos in range(ctx - q_len, ctx):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(
                len(block_tables), width
            ),
            query_lens=list(query_lens),
            context_lens_host=list(context_lens),
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
            decode_only=all(q == 1 for q in query_lens),
        )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "torch",
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D]; caches [blocks, B, Hkv, D]. Returns [T, Hq, D].

    A query at position p attends to its sequence's keys at positions <= p; with a sliding
    `window` W, only to those > p - W (its last W tokens, itself included: transformers'
    sliding_window_overlay). None: the whole context. With a `softcap` c, each score
    s = (q . k) * scale becomes c * tanh(s / c) before the mask (Gemma 2)."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window} must be at least 1")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention soft cap {softcap} must be positive")
    if backend == "torch":
        return torch_paged_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
    if backend == "cpu":
        from runner.backends.cpu.attention import cpu_paged_attention

        return cpu_paged_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
    if backend == "triton":
        from runner.backends.triton.attention import triton_paged_attention

        out: torch.Tensor = triton_paged_attention(
            q, k, v, k_cache, v_cache, meta, scale, window=window, softcap=softcap
        )
        return out
    raise ValueError(f"unknown attention backend {backend!r}; expected 'torch', 'cpu' or 'triton'")


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store the new tokens' K/V [T, Hkv, D] at their flat slots of the caches (rounded to
    the caches' dtype where it is narrower: kv_cache_dtype)."""
    if slots.dtype != torch.int64:
        slots = slots.long()
    hkv, d = k.shape[1:]
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))


def _gather(
    cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int, dtype: torch.dtype
) -> torch.Tensor:
    """cache [blocks, B, Hkv, D] -> [S, Hkv, nb * B, D] in `dtype` for `blocks` [S * nb]."""
    _, block_size, hkv, d = cache.shape
    return cache.index_select(0, blocks).view(num_seqs, -1, hkv, d).transpose(1, 2).to(dtype)


def torch_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference implementation of paged_attention's contract with torch SDPA (scores with a
    soft cap, which SDPA cannot apply: runner/attention/capped.py)."""
    num_tokens, hq, d = q.shape
    hkv = k.shape[1]
    block_size = k_cache.shape[1]
    # Write first, so every read below sees the new tokens through the block table.
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if k_cache.dtype != q.dtype:  # attend to the new K/V as stored, like the cached ones
        k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)

    if softcap is not None:
        return capped_attention(
            q,
            k_cache,
            v_cache,
            meta.query_lens,
            meta.context_lens_host,
            meta.block_tables,
            scale,
            softcap,
            window,
        )
    if window is not None and window < meta.max_context_len:
        plan = meta._window_plans.get(window)
        if plan is None or plan.block_size != block_size:
            plan = meta._window_plans[window] = build_plan(
                meta, block_size, q.device, q.dtype, window
            )
    else:  # a window no context reaches past cuts nothing
        plan = meta._torch_plan
        if plan is None or plan.block_size != block_size:
            plan = meta._torch_plan = build_plan(meta, block_size, q.device, q.dtype)

    out = q.new_empty((num_tokens, hq, d))
    for item in plan.singles:
        qs = q[item.start : item.end].transpose(0, 1)[None]  # [1, Hq, L, D]
        if item.cached is not None:
            rows = q[item.start : item.end]  # [L, Hq, D]
            res = cascade_attention(rows, rows[None], None, k_cache, v_cache, item.cached, scale)
            res = res.transpose(0, 1)[None]  # [1, Hq, L, D] view, like SDPA's result
        elif item.blocks is None:
            ks = k[item.start : item.end].transpose(0, 1)[None]  # [1, Hkv, L, D]
            vs = v[item.start : item.end].transpose(0, 1)[None]
            res = F.scaled_dot_product_attention(  # causal, or the window's mask
                qs,
                ks,
                vs,
                attn_mask=item.mask,
                is_causal=item.mask is None,
                scale=scale,
                enable_gqa=hq != hkv,
            )
        else:
            # [1, Hkv, C, D]
            ks = _gather(k_cache, item.blocks, 1, q.dtype)[:, :, : item.context_len]
            vs = _gather(v_cache, item.blocks, 1, q.dtype)[:, :, : item.context_len]
            res = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=item.mask, scale=scale, enable_gqa=hq != hkv
            )
        if len(plan.singles) == 1 and plan.group is None and item.end - item.start == num_tokens:
            return res[0].transpose(0, 1)  # [T, Hq, D] view; the caller's reshape copies once
        out[item.start : item.end] = res[0].transpose(0, 1)  # [L, Hq, D]

    g = plan.group
    if g is not None:
        qg = q[g.q_rows]  # [S * L, Hq, D]
        if g.shared is not None:
            qs = qg.view(g.num_seqs, g.max_query_len, hq, d)
            real = qg if g.valid is None else q[g.out_rows]  # [R, Hq, D]
            res = cascade_attention(real, qs, g.valid, k_cache, v_cache, g.shared, scale)
        elif g.max_query_len == 1:
            ks = _gather(k_cache, g.blocks, g.num_seqs, q.dtype)  # [S, Hkv, K, D]
            vs = _gather(v_cache, g.blocks, g.num_seqs, q.dtype)
            # GQA without repeating K/V: the G query heads sharing a KV head become
            # G "query rows" of that head (q head h uses kv head h // G).
            qs = qg.reshape(g.num_seqs, hkv, hq // hkv, d)  # [S, Hkv, G, D]
            res = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.mask, scale=scale)
            res = res.reshape(g.num_seqs, hq, d)  # [S, Hq, D]
        else:
            ks = _gather(k_cache, g.blocks, g.num_seqs, q.dtype)  # [S, Hkv, K, D]
            vs = _gather(v_cache, g.blocks, g.num_seqs, q.dtype)
            qs = qg.reshape(g.num_seqs, g.max_query_len, hq, d).transpose(1, 2)  # [S, Hq, L, D]
            res = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=g.mask, scale=scale, enable_gqa=hq != hkv
            )
            res = res.transpose(1, 2).reshape(-1, hq, d)  # [S * L, Hq, D]
            if g.valid is not None:
                res = res[g.valid]
        if isinstance(g.out_rows, slice):
            if g.out_rows == slice(0, num_tokens) and not plan.singles:
                return res
            out[g.out_rows] = res
        elif g.out_rows is not None:
            out.index_copy_(0, g.out_rows, res)
    return out
