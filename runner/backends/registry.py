"""The attention backends by name: "torch" (the reference path), "cpu" (the C kernels) and
"triton". The engine picks one here once, when it is built, and passes it to the model
(runner/attention/backend.py); the names live here alone, and everything below asks a
backend's Capabilities, never its name.

A backend is one module that builds an AttentionBackend, and one registration: a line in
BACKENDS below, or `BACKENDS.with_backend(...)` for a registry of a caller's own (tests, tools),
which leaves the default as it is."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from runner.attention.backend import AttentionBackend, AttentionCall
from runner.attention.metadata import AttentionMetadata
from runner.backends.torch.backend import TORCH_ATTENTION

# Builds a backend; deterministic=True asks for its batch-invariant form (docs/DETERMINISM.md).
BackendFactory = Callable[[bool], AttentionBackend]


class Registry:
    """Backends by name, each built on demand (Triton's import is slow, and most CPU runs never
    need it). Never changed in place: `with_backend` makes a new registry, so adding a backend
    somewhere changes no other registry (the default below included)."""

    def __init__(self, factories: Mapping[str, BackendFactory]) -> None:
        self._factories: Mapping[str, BackendFactory] = MappingProxyType(dict(factories))

    def with_backend(self, name: str, factory: BackendFactory) -> Registry:
        """These backends and `name`, built by `factory`; ValueError if `name` is taken."""
        if name in self._factories:
            raise ValueError(f"attention backend {name!r} is registered already")
        return Registry({**self._factories, name: factory})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def build(self, name: str, deterministic: bool = False) -> AttentionBackend:
        """The backend called `name` (in its batch-invariant form where `deterministic`);
        ValueError names the known ones, or says the backend has no such form."""
        if name not in self._factories:
            known = ", ".join(repr(n) for n in self.names)
            raise ValueError(f"unknown attention backend {name!r}; expected one of {known}")
        return self._factories[name](deterministic)


def _torch(deterministic: bool) -> AttentionBackend:
    if deterministic:  # EngineConfig refuses it first; here for a caller that did not ask it
        raise ValueError("the torch attention backend has no batch-invariant form")
    return TORCH_ATTENTION


def _cpu(deterministic: bool) -> AttentionBackend:
    from runner.backends.cpu.attention import batch_invariant_backend, cpu_backend

    return batch_invariant_backend() if deterministic else cpu_backend()


def _triton(deterministic: bool) -> AttentionBackend:
    # Imported on demand. Its decodes read a shared prefix once where the cost model
    # (cascade_cost.py) says that wins.
    if deterministic:
        from runner.backends.triton.batch_invariant_attention import (
            batch_invariant_triton_backend,
        )

        return batch_invariant_triton_backend()
    from runner.backends.triton.attention import triton_backend

    return triton_backend()


BACKENDS = Registry({"torch": _torch, "cpu": _cpu, "triton": _triton})
BACKEND_NAMES = BACKENDS.names


def attention_backend(name: str, deterministic: bool = False) -> AttentionBackend:
    """The default registry's backend called `name`; ValueError names the known ones."""
    return BACKENDS.build(name, deterministic)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "torch",
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One attention call through the backend named `backend`, its arguments checked: for
    tests and tools that compare the backends (runner/attention/backend.py's AttentionCall
    states the contract). The model's layers call their engine's backend directly."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window} must be at least 1")
    if softcap is not None and not 0 < softcap < math.inf:  # an infinite cap makes NaN scores
        raise ValueError(f"attention soft cap {softcap} must be positive and finite")
    call = AttentionCall(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
    return attention_backend(backend).attend(call)
