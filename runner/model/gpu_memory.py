"""GPU memory sizing: how much a step's activations peak at, measured once at start-up.

runner/engine/kv/memory.py sizes the KV pool as `total * gpu_memory_utilization - used -
activation_bytes`. The activations of a step are not known in advance (they depend on the attention
path, the allocator, cuBLAS workspaces), so, like vLLM's profile run, we run one forward of the
largest step the scheduler can form and read the allocator's peak.
"""

from __future__ import annotations

import torch

from runner.attention.metadata import AttentionMetadata
from runner.kv_pool.store import KVStore
from runner.model.decoder import CausalLM


def profile_sequence_lengths(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Prefill lengths of the profiling step: max_num_batched_tokens tokens cut into sequences
    of at most max_model_len (the largest step a scheduler with this budget can form)."""
    if max_num_batched_tokens < 1 or max_model_len < 1:
        raise ValueError("max_num_batched_tokens and max_model_len must be >= 1")
    lens = []
    left = max_num_batched_tokens
    while left > 0:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    return lens


@torch.inference_mode()
def profile_activation_bytes(
    model: CausalLM,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
    device: torch.device | str,
    max_num_seqs: int = 1,
) -> int:
    """Peak bytes one step of max_num_batched_tokens prefill tokens allocates beyond what is
    already allocated (weights), logits of min(max_num_seqs, tokens) rows included. 0 off CUDA.

    The step writes its K/V into a temporary store of just enough blocks for the longest
    sequence: every sequence uses the same block table, so their writes collide, which is
    harmless for a measurement. The store itself is excluded from the result (the real pool is
    counted by the caller). Frees the allocator's cache afterwards, so `mem_get_info` reports
    the activations as free again when the caller sizes the pool.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    lens = profile_sequence_lengths(max_num_batched_tokens, max_model_len)
    num_blocks = -(-max(lens) // block_size)
    dtype = next(model.parameters()).dtype
    kv = KVStore(
        model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, dtype, dev
    )
    table = list(range(num_blocks))
    meta = AttentionMetadata.build(lens, lens, [table] * len(lens), block_size, dev)
    total = sum(lens)
    # Token ids cycle through the vocabulary; positions restart at 0 in each sequence.
    input_ids = torch.arange(total, device=dev) % model.vocab_size  # [T]
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])  # [T]
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    hidden = model(input_ids, positions, meta, kv)  # [T, H]
    rows = torch.arange(min(max_num_seqs, total), device=dev) % total  # rows that would sample
    logits = model.compute_logits(hidden.index_select(0, rows))  # [N, vocab] float32
    torch.argmax(logits, dim=-1)  # the sampler's own scratch
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del hidden, logits, kv, meta
    torch.cuda.empty_cache()
    return int(max(peak, 0))
