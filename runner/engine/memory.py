"""Sizing the KV pool: from a block count, a byte budget, or the free GPU memory."""

from __future__ import annotations

import torch

from kvcache.store import KVStore
from runner.engine.config import EngineConfig

# On the CPU the pool is a slice of host memory; cap the default so a laptop-sized machine
# keeps room for everything else.
_CPU_DEFAULT_BUDGET = 1 << 30


def kv_pool_blocks(
    config: EngineConfig,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_model_len: int,
    device: torch.device,
    activation_bytes: int = 0,
) -> int:
    """How many KV blocks to allocate.

    An explicit `num_kv_blocks` wins; then `kv_cache_memory_bytes`; on CUDA the free memory times
    `gpu_memory_utilization`, less what a warm-up step peaked at (`activation_bytes`); on the
    CPU enough for `max_num_seqs` full-context sequences, capped at 1 GiB."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = KVStore.bytes_per_block(
        num_layers, config.block_size, num_kv_heads, head_dim, dtype
    )
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free
        budget = int(total * config.gpu_memory_utilization) - used_by_others - activation_bytes
    else:
        want = config.max_num_seqs * max_model_len * per_block // config.block_size
        budget = min(want, _CPU_DEFAULT_BUDGET)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(
            f"no room for the KV cache: budget {budget} bytes, one block needs {per_block} bytes"
        )
    return int(blocks)
