"""The C kernels' arguments as they take them, shared by both decode-attention libraries
(kernel.py's AVX-512 one and portable.py's): the shapes they take, the operands of a decode, its
status, the window and the soft cap."""

from __future__ import annotations

import ctypes
import math

import torch

# The attention kernels' limits (decode_attention.c, portable/decode_attention_vec.c,
# prefill_attention.c): head size; and the decodes' query heads per KV head and block size.
MAX_HEAD_DIM, MAX_GROUP, MAX_BLOCK = 256, 8, 256


def heads_fit(q: torch.Tensor, k_cache: torch.Tensor, lanes: int) -> bool:
    """Whether an attention kernel of vector width `lanes` takes these heads: q [T, Hq, D] and
    the cache [blocks, B, Hkv, D] on the CPU, D a multiple of lanes up to MAX_HEAD_DIM, and Hq a
    multiple of Hkv."""
    d, hq, hkv = q.shape[-1], q.shape[1], k_cache.shape[2]
    return (
        q.device.type == k_cache.device.type == "cpu"
        and d % lanes == 0
        and d <= MAX_HEAD_DIM
        and hq % hkv == 0
    )


def decode_groups_fit(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """What the decode kernels take beyond the heads (heads_fit): at most MAX_GROUP query heads
    per KV head and blocks of at most MAX_BLOCK tokens."""
    return q.shape[1] // k_cache.shape[2] <= MAX_GROUP and k_cache.shape[1] <= MAX_BLOCK


def decode_operands(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a decode kernel (this library's or runner/backends/cpu/portable.py's) reads and
    writes: q contiguous, the tables and context lengths as contiguous int32, and the output;
    the caches are read in place. Raises ValueError when they are not contiguous."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention reads the caches in place: they must be contiguous")
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    return q, tables, lens, torch.empty_like(q)


def check_decode_status(status: int, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """A decode kernel's refusal (a nonzero status) as the ValueError naming the shapes."""
    if status != 0:
        raise ValueError(
            f"decode_attention cannot take q {tuple(q.shape)}, cache block "
            f"{tuple(k_cache.shape[1:])}"
        )


def window_arg(window: int | None) -> int:
    """The kernels' window: keys a query sees, itself included; 0 for the whole context."""
    if window is None:
        return 0
    if window < 1:
        raise ValueError(f"sliding window {window} must be at least 1")
    return window


def softcap_arg(softcap: float | None) -> float:
    """The kernels' soft cap c (each score s becomes c * tanh(s / c)); 0.0 for none."""
    if softcap is None:
        return 0.0
    # As the kernels read it, a float: a cap under float32's range would pass as 0 (no cap).
    if not 0.0 < ctypes.c_float(softcap).value < math.inf:
        raise ValueError(f"attention soft cap {softcap} must be a positive finite float32")
    return softcap
