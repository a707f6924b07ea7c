"""Sizing the KV pool: from a block count, a byte budget, or the free GPU memory."""

from __future__ import annotations

import torch

from runner.engine.config import EngineConfig
from runner.kv_pool.store import KVStore

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
    per_block = KVStore.bytes_per_block(
        num_layers, config.block_size, num_kv_heads, head_dim, dtype
    )
    if config.num_kv_blocks is not None:
        check_pool_fits(config.num_kv_blocks, per_block, device, "num_kv_blocks (--num-kv-blocks)")
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
        check_pool_fits(budget // per_block, per_block, device, "kv_cache_memory_bytes")
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


def check_pool_fits(blocks: int, per_block: int, device: torch.device, option: str) -> None:
    """Refuse a pool asked for by size (`option`) that is larger than the memory available
    now, naming the option and both sizes, before the allocation fails with a bare
    "Cannot allocate memory" (or, since the CPU pool's pages are taken as blocks are first
    written, before the machine runs out hours into a run)."""
    need = blocks * per_block
    if device.type == "cuda":
        have, where = torch.cuda.mem_get_info(device)[0], f"{device} has"
    else:
        import psutil

        have, where = psutil.virtual_memory().available, "this machine has"
    if need <= have:
        return
    raise ValueError(
        f"{option}: a KV pool of {blocks:,} blocks needs {_size(need)} "
        f"({per_block:,} bytes a block), but {where} {_size(have)} available: at most "
        f"{have // per_block:,} blocks fit"
    )


def _size(nbytes: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"
