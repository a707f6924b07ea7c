"""The LLM options the bench sets on the engines it measures, by their EngineConfig names
(runner/engine/config.py has what each does): one type for the systems' option sets
(systems.py, pd_interference.py), the command line's and the tiers' figures'."""

from __future__ import annotations

from typing import TypedDict


class EngineOptions(TypedDict, total=False):
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    batching: str
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    cpu_weight_dtype: str
    kv_cache_dtype: str
    speculative_tokens: int
    deterministic: bool
    prepack_weights: bool
    record_metrics: bool
    host_cache_bytes: int
    disk_cache_dir: str
    remote_cache_url: str
    cache_chunk_tokens: int
    cache_key: str | None


def given_options(
    max_num_batched_tokens: int | None, max_num_seqs: int | None, block_size: int | None
) -> EngineOptions:
    """The options `kvcache bench` was given (those not None)."""
    options = EngineOptions()
    if max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = max_num_batched_tokens
    if max_num_seqs is not None:
        options["max_num_seqs"] = max_num_seqs
    if block_size is not None:
        options["block_size"] = block_size
    return options
