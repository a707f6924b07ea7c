"""An attention backend as the model receives it, chosen once when the engine is built.

A backend is the call that attends (`Attend`, over one `AttentionCall`), what it can do
(`Capabilities`: callers ask these, never its name) and, optionally, a layer stack that runs a
whole step's layers instead of the model's modules (the CPU's C layers,
runner/model/cpu_layers.py). The model takes one with every forward pass; the backends
themselves live under runner/backends/, and runner/backends/registry.py builds them by name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from runner.attention.metadata import AttentionMetadata
from runner.kv_pool.store import KVStore


@dataclass(frozen=True)
class AttentionCall:
    """One layer's attention in one step. The backend writes the new `k`, `v` at
    `meta.slot_mapping` of the caches, then returns [T, Hq, D]: a query at position p attends
    to its sequence's keys at positions <= p; with a sliding `window` W, only to those > p - W
    (its last W tokens, itself included: transformers' sliding_window_overlay); None: the whole
    context. With a `softcap` c, each score s = (q . k) * scale becomes c * tanh(s / c) before
    the mask (Gemma 2)."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [blocks, B, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    window: int | None = None
    softcap: float | None = None


class Attend(Protocol):
    """Paged attention's contract: AttentionCall says what it computes."""

    def __call__(self, call: AttentionCall) -> torch.Tensor: ...


class LayerStack(Protocol):
    """Every decoder layer of a step in one call: `takes` says whether it can run this cache."""

    def takes(self, kv: KVStore) -> bool: ...

    def run(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVStore,
        rope_by_type: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        layers: range | None = None,  # only these consecutive layers (None: all)
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared by the backend and asked by its callers (the engine's
    setup, the decoder), so that a new backend is one file and one registration."""

    # Its CUDA decode steps may be captured once and replayed (runner/model/cuda_graphs.py):
    # its kernels and their plan read only the graph's static tensors.
    supports_cuda_graphs: bool = False
    # On CUDA tensors the layers may fuse RoPE with the K/V store (then call `attend_stored`)
    # and their elementwise work (runner/backends/triton/fused_elementwise.py).
    fuses_rope_store: bool = False
    # Its decodes read a prefix that a step's sequences share once (a shared-prefix plan).
    shared_prefix_plan: bool = False
    # A row's result is bitwise the same whatever else the step holds (docs/DETERMINISM.md).
    deterministic: bool = False
    # Its batch-invariant products are Triton's (runner/model/batch_invariant.py), not the
    # CPU's packed panels: deterministic mode routes the model's linears through them.
    triton_products: bool = False
    # Its attention is the CPU's C kernels, so the C layer stack (which attends with them,
    # runner/model/cpu_layers.py) may run whole steps for it.
    cpu_layer_stack: bool = False


@dataclass(frozen=True)
class AttentionBackend:
    name: str  # for logs and reports; nothing dispatches on it
    attend: Attend
    capabilities: Capabilities = Capabilities()
    layers: LayerStack | None = None  # runs the whole stack where it `takes` the cache
    # The same attention over K/V the caller already wrote at the slots (a fused RoPE + store,
    # runner/backends/triton/rope_store.py); None: the backend has no such entry.
    attend_stored: Attend | None = None

    def with_layers(self, layers: LayerStack | None) -> AttentionBackend:
        return replace(self, layers=layers)
