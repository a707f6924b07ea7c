"""The attention backends by name: "torch" (the reference path), "cpu" (the C kernels) and
"triton". The engine picks one here once, when it is built, and passes it to the model
(runner/attention/backend.py); nothing below it dispatches on a name."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from runner.attention.backend import TORCH_ATTENTION, AttentionBackend
from runner.attention.metadata import AttentionMetadata


def _cpu() -> AttentionBackend:
    from runner.backends.cpu.attention import cpu_paged_attention

    return AttentionBackend("cpu", cpu_paged_attention)


def _triton() -> AttentionBackend:
    # Imported on demand: Triton's import is slow, and most CPU runs never need it. Its decodes
    # read a shared prefix once where the cost model (cascade_cost.py) says that wins.
    from runner.backends.triton.attention import triton_backend

    return triton_backend()


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": lambda: TORCH_ATTENTION,
    "cpu": _cpu,
    "triton": _triton,
}
BACKEND_NAMES = tuple(_BACKENDS)


def attention_backend(name: str) -> AttentionBackend:
    """The backend called `name`; ValueError names the known ones."""
    if name not in _BACKENDS:
        known = ", ".join(repr(n) for n in BACKEND_NAMES)
        raise ValueError(f"unknown attention backend {name!r}; expected one of {known}")
    return _BACKENDS[name]()


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
    tests and tools that compare the backends (runner/attention/paged.py states the contract).
    The model's layers call their engine's backend directly."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window} must be at least 1")
    if softcap is not None and not 0 < softcap < math.inf:  # an infinite cap makes NaN scores
        raise ValueError(f"attention soft cap {softcap} must be positive and finite")
    return attention_backend(backend).attend(
        q, k, v, k_cache, v_cache, meta, scale, window, softcap
    )
