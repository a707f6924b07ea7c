"""Building a worker: the model (or one tensor-parallel rank's share of it) with its attention
backend and packed weights, then its KV pool and CUDA graphs. Rank 0 sizes the pool
(`pool_blocks`) and every rank allocates that many blocks of its own heads."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from runner.attention.backend import AttentionBackend
from runner.backends.cpu.allocator import keep_step_buffers_in_heap
from runner.backends.cpu.quant import round_matrices
from runner.backends.registry import attention_backend
from runner.engine.config import EngineConfig
from runner.engine.executor.worker import Worker
from runner.engine.kv.memory import kv_pool_blocks
from runner.kv_pool.store import KVStore
from runner.model.cpu_prepack import prepack_for_cpu
from runner.model.decoder import CausalLM
from runner.model.layers import rope_context_limit
from runner.model.loader import LoadedModel, load_model
from runner.model.sharding import shard_model
from runner.model.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)


class ModelShare(NamedTuple):
    """A rank's model, ready to run: loaded, sharded, packed, its backend chosen."""

    loaded: LoadedModel
    attention: AttentionBackend
    max_model_len: int


def load_share(
    config: EngineConfig, device: torch.device, tp: TensorParallel | None = None
) -> ModelShare:
    """Load the model, cut it to `tp`'s share (None: whole), choose its attention backend and
    pack its weights for the CPU."""
    dtype = getattr(torch, config.dtype) if config.dtype else None
    if config.cpu_weight_dtype != "float32":
        if device.type != "cpu":
            raise ValueError("cpu_weight_dtype is for the CPU; on a GPU, dtype sets the weights")
        if config.dtype not in (None, "float32"):  # it rounds float32 weights, and only those
            raise ValueError(
                f"cpu_weight_dtype={config.cpu_weight_dtype!r} rounds a float32 model's weights; "
                f"it cannot be combined with dtype={config.dtype!r}"
            )
    if device.type == "cpu":
        keep_step_buffers_in_heap()
    # The RoPE tables sized by the context asked for, not the config's positions (context_length
    # below refuses a max_model_len past the model's).
    loaded = load_model(
        config.model, device=str(device), dtype=dtype, max_positions=config.max_model_len
    )
    model = loaded.model
    if tp is not None:
        shard_model(model, tp)
    # deterministic: the backend's batch-invariant form (EngineConfig checked the rest).
    attention = attention_backend(attention_backend_name(config, device), config.deterministic)
    triton_deterministic = config.deterministic and attention.capabilities.triton_products
    if triton_deterministic:  # products through the batch-invariant kernels too
        # Triton is needed on GPUs (and for this path) only: imported here.
        from runner.model.batch_invariant import route_linears

        route_linears(model, model.embed_tokens.weight if model.lm_head is None else None)
    if device.type == "cpu" and config.prepack_weights and not triton_deterministic:
        packing = prepack_for_cpu(
            model, config.cpu_kernels, config.cpu_weight_dtype, config.deterministic
        )
        # Whole steps in C where the model fits layers.c; a tensor-parallel share all-reduces
        # between the layers, so its layers run one by one.
        if attention.capabilities.cpu_layer_stack and tp is None:
            attention = attention.with_layers(packing.layers)
    elif config.cpu_weight_dtype in ("bfloat16-dot", "int8-dot"):  # the panel kernel's products
        raise ValueError(f"cpu_weight_dtype={config.cpu_weight_dtype!r} needs prepack_weights")
    elif device.type == "cpu" and config.cpu_weight_dtype != "float32":
        round_matrices(model, config.cpu_weight_dtype)  # the same model, in torch's products
        log.warning("cpu_weight_dtype without prepack_weights: the rounded weights stay float32")
    max_model_len = context_length(config, model)
    model.keep_rope_positions(max_model_len)  # no position reaches past the context
    return ModelShare(loaded, attention, max_model_len)


def pool_blocks(config: EngineConfig, share: ModelShare, device: torch.device) -> int:
    """How many blocks the KV pool holds, for this rank's heads (rank 0's are the most)."""
    model = share.loaded.model
    activation = 0
    if (
        device.type == "cuda"
        and config.num_kv_blocks is None
        and config.kv_cache_memory_bytes is None
    ):
        from runner.model.gpu_memory import profile_activation_bytes

        # Without chunking a whole prompt can exceed the token budget in one step.
        step = config.token_budget + (0 if config.enable_chunked_prefill else share.max_model_len)
        activation = profile_activation_bytes(
            model, step, share.max_model_len, config.block_size, device, config.max_num_seqs
        )
    return kv_pool_blocks(
        config,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=kv_dtype_of(config, model, device),
        max_model_len=share.max_model_len,
        device=device,
        activation_bytes=activation,
    )


def make_worker(
    config: EngineConfig, share: ModelShare, device: torch.device, num_blocks: int
) -> Worker:
    """The worker over a pool of `num_blocks` blocks of this share's heads; on CUDA with a
    backend that replays graphs, its decode graphs captured."""
    model, attention = share.loaded.model, share.attention
    kv = KVStore(
        model.num_layers,
        num_blocks,
        config.block_size,
        model.num_kv_heads,
        model.head_dim,
        kv_dtype_of(config, model, device),
        device,
        prefault=config.prefault_kv_cache,
    )
    graphs = None
    if (
        device.type == "cuda"
        and not config.enforce_eager
        and attention.capabilities.supports_cuda_graphs
        and model.tp is None
    ):
        from runner.model.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(
            model, kv, config.block_size, config.max_num_seqs, share.max_model_len, device
        )
        graphs.capture()
    return Worker(model, kv, attention, device, graphs)


def attention_backend_name(config: EngineConfig, device: torch.device) -> str:
    """The configured backend, else Triton on a GPU and the C kernels on the CPU (which keep
    the torch path wherever a kernel cannot run), else the torch path."""
    if config.attention_backend is not None:
        return config.attention_backend
    if device.type == "cuda":
        return "triton"
    return "cpu" if config.cpu_kernels else "torch"


def context_length(config: EngineConfig, model: CausalLM) -> int:
    """EngineConfig.max_model_len, or the model's context when it is None; refused past the
    model's. A longrope model stops at its original context (layers.py)."""
    limit, why = int(model.max_position_embeddings), "its positions"
    original = rope_context_limit(model.config)
    if original is not None and original < limit:
        limit, why = original, "its longrope original context"
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} is longer than the model's context "
            f"({limit} tokens: {why})"
        )
    return config.max_model_len


def kv_dtype_of(config: EngineConfig, model: CausalLM, device: torch.device) -> torch.dtype:
    return kv_cache_dtype_of(config.kv_cache_dtype, next(model.parameters()).dtype, device)


def kv_cache_dtype_of(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for EngineConfig.kv_cache_dtype `name`: the model's for "auto". A
    narrower cache is the CPU's (its C kernels and torch's attention widen what they read);
    the Triton kernels read the model's dtype."""
    if name == "auto":
        return model_dtype
    dtype: torch.dtype = getattr(torch, name)
    if dtype != model_dtype and device.type != "cpu":
        raise ValueError(
            f"kv_cache_dtype={name!r} with a {str(model_dtype).removeprefix('torch.')} model "
            "runs on the CPU only; on a GPU the cache holds the model's dtype"
        )
    return dtype
