"""vLLM's `cleanup_dist_env_and_memory`, which its scripts call between two engines
(`del llm` first): no process group exists here, so what is left is the memory: a collection,
which frees an engine no name holds any more (its KV pool and weights), and on CUDA the
allocator's cached blocks given back to the device."""

from __future__ import annotations

import gc

import torch


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Free what engines no longer held left behind. `shutdown_ray` is vLLM's and means
    nothing here (no Ray)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
