"""Building an engine's parts: the model, the KV pool sized for the device, the runner."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcache import BlockManager
from kvcache.tiers import BlockSpec
from kvcache.tiers.loader import PoolBlocks, TierLoader
from runner.attention.backend import AttentionBackend
from runner.engine.config import EngineConfig
from runner.engine.executor.build import load_share, make_worker, pool_blocks
from runner.engine.executor.executor import Executor
from runner.engine.executor.multiproc import start_tensor_parallel
from runner.engine.kv.tiers import cache_identity_string, cache_mac_key, open_tiers
from runner.engine.kv.transfer import PoolCopies, block_spec
from runner.engine.step.model_runner import ModelRunner
from runner.kv_pool.store import KVStore
from runner.model.loader import LoadedModel


class EngineParts(NamedTuple):
    loaded: LoadedModel
    device: torch.device
    max_model_len: int
    kv: KVStore
    block_manager: BlockManager
    runner: ModelRunner
    attention: AttentionBackend
    block_spec: BlockSpec  # what a block stored outside the pool must agree with
    cache_mac_key: bytes | None  # the MAC key of stored blocks (runner/engine/kv/tiers.py)
    tiers: TierLoader | None  # the tiers below the pool, where any is configured
    executor: Executor  # the worker in this process, or the tensor-parallel ranks


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """Load the model (or, with tensor parallelism, start the other ranks and load rank 0's
    share), size and allocate the KV pool (once: it never grows), open the tiers below it, and
    on CUDA capture decode graphs."""
    mac_key = cache_mac_key(config)  # before the model loads: a missing key costs nothing
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
    executor: Executor
    if config.tensor_parallel_size == 1:
        share = load_share(config, device)
        executor = make_worker(config, share, device, pool_blocks(config, share, device))
        shards = ""
    else:
        launched = start_tensor_parallel(config, device)
        executor, share = launched.executor, launched.share
        shards = f" tp={config.tensor_parallel_size} shards={executor.shard_nbytes}"
    worker = executor.local
    kv = worker.kv
    block_manager = BlockManager(
        kv.num_blocks, config.block_size, config.enable_prefix_caching, config.eviction_policy
    )
    runner = ModelRunner(executor, config.block_size, config.max_num_seqs, share.max_model_len)
    # A block stored outside the pool must come from the same sharding: a tensor-parallel
    # engine's blocks hold every rank's shard, in rank order, and name the ranks' sizes.
    identity = cache_identity_string(share.loaded.fingerprint, config.cpu_weight_dtype) + shards
    spec = block_spec(kv, identity, executor.shard_nbytes)
    # Blocks copied off the pool for the tiers: this worker's (queued behind a GPU's step), or
    # every rank's shard, joined.
    pool: PoolBlocks = PoolCopies.for_pool(kv) if config.tensor_parallel_size == 1 else executor
    tiers = open_tiers(config, block_manager, pool, spec) if config.has_tiers else None
    return EngineParts(
        share.loaded,
        device,
        share.max_model_len,
        kv,
        block_manager,
        runner,
        worker.attention,
        spec,
        mac_key,
        tiers,
        executor,
    )
