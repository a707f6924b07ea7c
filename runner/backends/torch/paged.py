"""Paged attention over flat (varlen) token batches: the torch reference path.

Each step the model runner describes the batch once in an AttentionMetadata; every
layer then calls its backend (runner/attention/backend.py), which writes the new K/V into the store
at ``slot_mapping`` and lets each query token attend causally to its sequence's context
(cached prefix + new tokens) read back through the block table.

Torch path strategy (no per-token Python loops; the plan is built once per step and
shared by all layers):
- long queries (prefill chunks) run one SDPA per sequence; with no cached prefix they
  use k/v directly with is_causal, else they gather their blocks and use a causal mask
  shifted by the prefix length (on the CPU, the cached context is read in parts instead: its
  long runs of consecutive blocks in place, runner/backends/torch/context_parts.py);
- short queries (decodes, short suffixes) run as one padded batch: their blocks are
  gathered with one index_select and masked by context length;
- when every sequence of that batch starts with the same blocks, the shared prefix is read
  once for all of them (runner/backends/torch/cascade.py, CPU only), and queries up to
  CASCADE_MAX_QUERY_LEN join the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from runner.attention.backend import AttentionCall
from runner.backends.torch.capped import capped_attention
from runner.backends.torch.cascade import cascade_attention
from runner.backends.torch.context_parts import context_parts_attention
from runner.backends.torch.plan import Group, Plan, Single, build_plan

# A kernel for the step's decodes, reading their blocks in place (runner/backends/cpu/
# portable.py): (q [S, Hq, D], k_cache, v_cache, block tables [S, max_blocks] int32, context
# lengths [S] int32, scale, window) -> [S, Hq, D].
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int | None],
    torch.Tensor,
]


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
    call: AttentionCall, decode_kernel: DecodeKernel | None = None
) -> torch.Tensor:
    """Reference implementation of paged attention's contract (AttentionCall) with torch SDPA
    (scores with a soft cap, which SDPA cannot apply: runner/backends/torch/capped.py). With a
    `decode_kernel`, the step's decodes go to it instead (not with a soft cap)."""
    q, k, v, k_cache, v_cache = call.q, call.k, call.v, call.k_cache, call.v_cache
    meta, scale, softcap = call.meta, call.scale, call.softcap
    num_tokens, hq, d = q.shape
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
            call.window,
        )
    plan, window = _step_plan(call, decode_kernel is not None)

    out = q.new_empty((num_tokens, hq, d))
    if plan.decodes is not None:
        assert decode_kernel is not None
        dec = plan.decodes
        res = decode_kernel(q[dec.rows], k_cache, v_cache, dec.tables, dec.contexts, scale, window)
        only_decodes = not plan.singles and plan.group is None
        if only_decodes and isinstance(dec.rows, slice) and dec.rows == slice(0, num_tokens):
            return res
        if isinstance(dec.rows, slice):
            out[dec.rows] = res
        else:
            out.index_copy_(0, dec.rows, res)
    for item in plan.singles:
        res = _single_attention(item, q, k, v, k_cache, v_cache, scale)
        if len(plan.singles) == 1 and plan.group is None and item.end - item.start == num_tokens:
            return res[0].transpose(0, 1)  # [T, Hq, D] view; the caller's reshape copies once
        out[item.start : item.end] = res[0].transpose(0, 1)  # [L, Hq, D]

    g = plan.group
    if g is not None:
        res = _group_attention(g, q, k_cache, v_cache, scale)
        if isinstance(g.out_rows, slice):
            if g.out_rows == slice(0, num_tokens) and not plan.singles:
                return res
            out[g.out_rows] = res
        elif g.out_rows is not None:
            out.index_copy_(0, g.out_rows, res)
    return out


def _step_plan(call: AttentionCall, decodes_apart: bool) -> tuple[Plan, int | None]:
    """The step's plan for this layer's window, built once a step and kept on the metadata,
    and the window it was built for (None where no context reaches past it: it cuts nothing)."""
    meta, q, window = call.meta, call.q, call.window
    block_size = call.k_cache.shape[1]
    if window is not None and window < meta.max_context_len:
        plan = meta._window_plans.get(window)
        if plan is None or plan.block_size != block_size or plan.decodes_apart != decodes_apart:
            plan = meta._window_plans[window] = build_plan(
                meta, block_size, q.device, q.dtype, window, decodes_apart
            )
        return plan, window
    plan = meta._torch_plan
    if plan is None or plan.block_size != block_size or plan.decodes_apart != decodes_apart:
        plan = meta._torch_plan = build_plan(
            meta, block_size, q.device, q.dtype, None, decodes_apart
        )
    return plan, None


def _single_attention(
    item: Single,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One long query's attention, [1, Hq, L, D]: over its own new K/V alone, its cached
    context read in parts, or its gathered blocks."""
    hq, hkv = q.shape[1], k.shape[1]
    qs = q[item.start : item.end].transpose(0, 1)[None]  # [1, Hq, L, D]
    if item.parts is not None:
        rows = q[item.start : item.end]  # [L, Hq, D]
        res = context_parts_attention(rows, k_cache, v_cache, item.parts, scale)
        return res.transpose(0, 1)[None]  # [1, Hq, L, D] view, like SDPA's result
    if item.blocks is None:
        ks = k[item.start : item.end].transpose(0, 1)[None]  # [1, Hkv, L, D]
        vs = v[item.start : item.end].transpose(0, 1)[None]
        return F.scaled_dot_product_attention(  # causal, or the window's mask
            qs,
            ks,
            vs,
            attn_mask=item.mask,
            is_causal=item.mask is None,
            scale=scale,
            enable_gqa=hq != hkv,
        )
    # [1, Hkv, C, D]
    ks = _gather(k_cache, item.blocks, 1, q.dtype)[:, :, : item.context_len]
    vs = _gather(v_cache, item.blocks, 1, q.dtype)[:, :, : item.context_len]
    return F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=item.mask, scale=scale, enable_gqa=hq != hkv
    )


def _group_attention(
    g: Group, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """The short queries' padded batch: [R, Hq, D], the rows of its valid queries."""
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    qg = q[g.q_rows]  # [S * L, Hq, D]
    if g.shared is not None:
        qs = qg.view(g.num_seqs, g.max_query_len, hq, d)
        real = qg if g.valid is None else q[g.out_rows]  # [R, Hq, D]
        return cascade_attention(real, qs, g.valid, k_cache, v_cache, g.shared, scale)
    ks = _gather(k_cache, g.blocks, g.num_seqs, q.dtype)  # [S, Hkv, K, D]
    vs = _gather(v_cache, g.blocks, g.num_seqs, q.dtype)
    if g.max_query_len == 1:
        # GQA without repeating K/V: the G query heads sharing a KV head become
        # G "query rows" of that head (q head h uses kv head h // G).
        qs = qg.reshape(g.num_seqs, hkv, hq // hkv, d)  # [S, Hkv, G, D]
        res = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.mask, scale=scale)
        return res.reshape(g.num_seqs, hq, d)  # [S, Hq, D]
    qs = qg.reshape(g.num_seqs, g.max_query_len, hq, d).transpose(1, 2)  # [S, Hq, L, D]
    res = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=g.mask, scale=scale, enable_gqa=hq != hkv
    )
    res = res.transpose(1, 2).reshape(-1, hq, d)  # [S * L, Hq, D]
    return res if g.valid is None else res[g.valid]
