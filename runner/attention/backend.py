"""An attention backend as the model receives it, chosen once when the engine is built.

A backend is the call that attends (`paged_attention`'s contract, runner/attention/paged.py)
and, optionally, a layer stack that runs a whole step's layers instead of the model's modules
(the CPU's C layers, runner/model/cpu_layers.py). The model takes one with every forward pass
instead of reading a name off itself; runner/backends/registry.py builds them by name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from kvcache.store import KVStore
from runner.attention.metadata import AttentionMetadata
from runner.attention.paged import torch_paged_attention


class Attend(Protocol):
    """Paged attention's contract: writes the new K/V at `meta.slot_mapping`, then returns
    [T, Hq, D]. A query at position p attends to its sequence's keys at positions <= p; with a
    sliding `window` W, only to those > p - W (its last W tokens, itself included:
    transformers' sliding_window_overlay); None: the whole context. With a `softcap` c, each
    score s = (q . k) * scale becomes c * tanh(s / c) before the mask (Gemma 2)."""

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [blocks, B, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor: ...


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
class AttentionBackend:
    name: str  # "torch", "cpu" or "triton"
    attend: Attend
    layers: LayerStack | None = None  # runs the whole stack where it `takes` the cache
    # The same attention over K/V the caller already wrote at the slots (a fused RoPE + store,
    # runner/backends/triton/rope_store.py); None: the backend has no such entry.
    attend_stored: Attend | None = None

    def with_layers(self, layers: LayerStack | None) -> AttentionBackend:
        return replace(self, layers=layers)


# The reference path: what a model runs when nobody chose a backend (tests, tools).
TORCH_ATTENTION = AttentionBackend("torch", torch_paged_attention)
