"""Cutting a loaded model down to one rank's share (runner/model/tensor_parallel.py says how
the heads, the MLP and the vocabulary split). In place, before the CPU packing: every weight
format (float, GGUF, the rounded CPU weights) is sharded the same way."""

from __future__ import annotations

import torch
from torch import nn

from runner.model.decoder import CausalLM
from runner.model.decoder_layers import MLP, Attention
from runner.model.tensor_parallel import (
    SplitRMSNorm,
    TensorParallel,
    VocabParallelEmbedding,
    even_split,
    head_share,
)


def shard_model(model: CausalLM, tp: TensorParallel) -> None:
    """Cut `model` (a loaded runner.model.decoder.CausalLM) down to rank tp.rank's share, in
    place; the layers then all-reduce their outputs and the LM head gathers on rank 0."""
    first_heads, first_kv_heads = model.num_heads, model.num_kv_heads
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, MLP)
        shard_attention(attn, tp)
        shard_mlp(mlp, tp)
    vocab_start, vocab_end = even_split(model.vocab_size, tp.size, tp.rank)
    spans = [even_split(model.vocab_size, tp.size, r) for r in range(tp.size)]
    model.vocab_widths = [end - start for start, end in spans]
    if model.lm_head is not None:  # an untied head: its rows of the vocabulary
        head = model.lm_head
        assert isinstance(head, nn.Linear) and head.bias is None
        model.lm_head = narrowed_linear(head, rows=(vocab_start, vocab_end))
    model.embed_tokens = VocabParallelEmbedding(
        model.embed_tokens.weight, vocab_start, vocab_end, tp
    )
    first: Attention = model.layers[0].self_attn  # type: ignore[assignment]
    model.num_heads, model.num_kv_heads = first.num_heads, first.num_kv_heads
    model.tp = tp
    model.counts_kv = head_share(first_heads, first_kv_heads, tp.size, tp.rank).owns_kv


def shard_attention(attn: Attention, tp: TensorParallel) -> None:
    share = head_share(attn.num_heads, attn.num_kv_heads, tp.size, tp.rank)
    d = attn.head_dim
    q_size, kv_size = attn.q_size, attn.kv_size
    rows = [
        (share.q_start * d, share.q_end * d),
        (q_size + share.kv_start * d, q_size + share.kv_end * d),
        (q_size + kv_size + share.kv_start * d, q_size + kv_size + share.kv_end * d),
    ]
    attn.qkv_proj = narrowed_linear(attn.qkv_proj, rows=rows)
    attn.o_proj = narrowed_linear(attn.o_proj, cols=(share.q_start * d, share.q_end * d), tp=tp)
    if not attn.qk_norm_per_head and attn.q_norm is not None and attn.k_norm is not None:
        attn.q_norm = SplitRMSNorm(attn.q_norm, *rows[0], q_size, True, tp)
        attn.k_norm = SplitRMSNorm(
            attn.k_norm, share.kv_start * d, share.kv_end * d, kv_size, share.owns_kv, tp
        )
    attn.num_heads = share.q_end - share.q_start
    attn.num_kv_heads = share.kv_end - share.kv_start
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
    attn.tp = tp


def shard_mlp(mlp: MLP, tp: TensorParallel) -> None:
    start, end = even_split(mlp.intermediate, tp.size, tp.rank)
    full = mlp.intermediate
    mlp.gate_up_proj = narrowed_linear(
        mlp.gate_up_proj, rows=[(start, end), (full + start, full + end)]
    )
    mlp.down_proj = narrowed_linear(mlp.down_proj, cols=(start, end), tp=tp)
    mlp.intermediate = end - start
    mlp.tp = tp


def narrowed_linear(
    linear: nn.Module,
    rows: tuple[int, int] | list[tuple[int, int]] | None = None,
    cols: tuple[int, int] | None = None,
    tp: TensorParallel | None = None,
) -> nn.Linear:
    """A fresh Linear of `linear`'s output `rows` (column parallel: its bias sliced alike) or
    input `cols` (row parallel: the bias kept on rank 0 alone, so the all-reduce adds it once)."""
    assert isinstance(linear, nn.Linear)
    weight: torch.Tensor = linear.weight
    bias: torch.Tensor | None = linear.bias
    if rows is not None:
        spans = [rows] if isinstance(rows, tuple) else rows
        weight = torch.cat([weight[a:b] for a, b in spans])
        bias = None if bias is None else torch.cat([bias[a:b] for a, b in spans])
    if cols is not None:
        weight = weight[:, cols[0] : cols[1]]
        assert tp is not None
        bias = bias if tp.rank == 0 else None
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return out
