"""Shared pieces of the Triton kernels: the CPU interpreter fallback, tile helpers, the
attention-logit soft cap, and rounding to a 16-bit dtype as torch rounds.

Without a GPU the kernels run in Triton's interpreter: runner/__init__.py sets TRITON_INTERPRET
before any kernel module imports Triton (`interpreting()` says which).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors) instead of on a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def pow2_at_least(n: int, floor: int = 16) -> int:
    """Smallest power of two >= n and >= floor; tl.dot needs every tile dimension >= 16."""
    return max(floor, triton.next_power_of_2(n))


def dot_config(cache_dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """(operand dtype, input_precision) for the kernels' tl.dot calls on a cache of this dtype.

    Operands stay in the cache dtype (fp32 accumulation either way) except for bf16 under the
    interpreter, whose tl.dot multiplies bf16's raw uint16 storage: there they go up to fp32.
    fp32 operands get exact IEEE products so results match the torch path (tf32 would drop ~3
    decimal digits); the precision is ignored for fp16 / bf16 operands.
    """
    if cache_dtype == torch.bfloat16 and interpreting():
        return tl.float32, "ieee"
    operand = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if cache_dtype not in operand:
        raise ValueError(f"unsupported KV cache dtype {cache_dtype}")
    return operand[cache_dtype], "ieee" if cache_dtype == torch.float32 else "tf32"


LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: exp(x) == exp2(x * log2(e))


def check_softcap(softcap: float | None) -> None:
    """A soft cap c replaces each score s by c * tanh(s / c); only c > 0 (finite) means that."""
    if softcap is not None and not (0.0 < softcap < float("inf")):
        raise ValueError(f"attention soft cap {softcap} must be a positive finite number")


def log2_softcap(softcap: float | None) -> float:
    """The kernel argument for a soft cap: c * log2(e), or 0.0 (unread) without a cap.

    The kernels hold scores in base 2, s2 = s * log2(e). Capping s2 with c2 = c * log2(e) is the
    natural-units cap carried over exactly: c2 * tanh(s2 / c2) = log2(e) * c * tanh(s / c)."""
    check_softcap(softcap)
    return 0.0 if softcap is None else softcap * LOG2E


@triton.jit
def soft_cap(s: tl.tensor, cap: float) -> tl.tensor:
    """cap * tanh(s / cap), elementwise, for finite s (cap before masking: tanh(-inf) = -1).

    tanh from exp2 rather than libdevice so the interpreter runs it too; tanh(|x|) =
    (1 - e) / (1 + e) with e = exp(-2|x|) <= 1 never overflows, and the sign comes back after.
    Near 0, 1 - e cancels: the capped score is off by about cap * 2^-23 at most (6e-6 for
    Gemma 2's cap of 50), far below what moves a softmax weight."""
    x = s / cap
    e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0.0, -t, t)


def default_tile(dtype: torch.dtype) -> int:
    """Key/query tile length: 64 for 16-bit caches, 32 for fp32 so K, V and Q tiles of head_dim
    128 still fit in shared memory with software pipelining."""
    return 32 if dtype == torch.float32 else 64


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take strides for every dimension but assume the head dimension has stride 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches [num_blocks, block_size, Hkv, D] must share shape, dtype and strides (the
    kernels take one set of strides for both; KVStore.layer() gives such a pair)."""
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
            f"{tuple(v_cache.shape)} {v_cache.dtype} differ"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need equal strides and a contiguous head dim")


@triton.jit
def rounded(x: tl.tensor, out_ty: tl.constexpr) -> tl.tensor:
    """float32 x rounded to out_ty (to nearest, ties to even), still in float32. bfloat16 is
    rounded by hand: Triton's interpreter converts float32 to bfloat16 by truncation, and the
    tests run the kernel there; on a GPU this is what the conversion does anyway."""
    if out_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(out_ty).to(tl.float32)
