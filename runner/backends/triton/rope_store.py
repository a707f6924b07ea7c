"""RoPE and the K/V store in one Triton kernel, for a GPU step's attention (issue 39: fewer
kernels a step).

The torch path rotates q and k (runner/model/layers.py's apply_rope: rotate-half over the
first R dims of each head, the rest passed through, about five elementwise kernels), then the
Triton attention writes k and v into the paged cache at the step's slots (store_kv in
attention.py). Here one program per token reads its q, k and v heads and its cos / sin rows,
writes the rotated q and stores the rotated k and the v at the token's flat slot (a negative
slot, a padding row, stores nothing). The attention then runs without its own store
(AttentionBackend.attend_stored).

The rotation is the one every model of the Triton path uses: rotate-half ("neox") over the
first R = cos.shape[-1] dims, R <= head_dim (partial rotary: Phi-4-mini), with the tables the
model computes (rope_cos_sin: every scaling variant, default, linear, llama3, yarn, longrope, is
folded into cos and sin; sin is stored negated over its first half). It keeps torch's roundings:
x * cos and partner * sin are each rounded to the activations' dtype, then their sum; float32
is launched without FMA contraction, so it equals the torch path bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.backends.triton.common import check_cache_pair, interpreting, pow2_at_least, rounded


@triton.jit
def _rotated_heads(
    ptr: tl.tensor,  # the token's first head
    stride_h: int,
    heads: int,
    cos: tl.tensor,  # [D_PAD] float32, the token's row (1 past ROT)
    sin: tl.tensor,  # [D_PAD] float32 (0 past ROT)
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    OUT_TY: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """The token's heads [H_PAD, D_PAD] rotated, in float32 holding OUT_TY values; the heads'
    offsets [H_PAD] and which elements are real [H_PAD, D_PAD], to store them by."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    # rotate-half's partner of dim d: d + R/2 in the first half, d - R/2 in the second.
    partner = tl.where(offs_d < ROT // 2, offs_d + ROT // 2, offs_d - ROT // 2)
    partner = tl.where(offs_d < ROT, partner, offs_d)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HEAD_DIM)
    rows = ptr + offs_h[:, None] * stride_h
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    a = rounded(x * cos[None, :], OUT_TY)
    b = rounded(xp * sin[None, :], OUT_TY)
    return tl.where(offs_d[None, :] < ROT, rounded(a + b, OUT_TY), x), offs_h, mask


@triton.jit
def _rope_store_kernel(
    q_ptr: tl.tensor,  # [T, Hq, D]
    k_ptr: tl.tensor,  # [T, Hkv, D]
    v_ptr: tl.tensor,  # [T, Hkv, D]
    cos_ptr: tl.tensor,  # [T, ROT]: cos repeated over both halves
    sin_ptr: tl.tensor,  # [T, ROT]: sin, negated over the first half
    q_out_ptr: tl.tensor,  # [T, Hq, D] contiguous
    k_cache_ptr: tl.tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr: tl.tensor,  # same layout and strides as k_cache
    slot_mapping_ptr: tl.tensor,  # [T] flat slots; < 0: store nothing
    stride_qt: int,
    stride_qh: int,
    stride_kt: int,
    stride_kh: int,
    stride_vt: int,
    stride_vh: int,
    stride_cos: int,
    stride_sin: int,
    stride_cb: int,
    stride_co: int,
    stride_ch: int,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    in_rot = offs_d < ROT
    cos = tl.load(cos_ptr + token * stride_cos + offs_d, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + offs_d, mask=in_rot, other=0.0).to(tl.float32)
    out_ty = q_out_ptr.dtype.element_ty

    q, offs_hq, q_mask = _rotated_heads(
        q_ptr + token * stride_qt, stride_qh, NUM_HEADS, cos, sin,
        HEAD_DIM, ROT, HQ_PAD, D_PAD, out_ty,
    )  # fmt: skip
    q_dst = q_out_ptr + token * NUM_HEADS * HEAD_DIM + offs_hq[:, None] * HEAD_DIM
    tl.store(q_dst + offs_d[None, :], q.to(out_ty), mask=q_mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    k, offs_h, kv_mask = _rotated_heads(
        k_ptr + token * stride_kt, stride_kh, NUM_KV_HEADS, cos, sin,
        HEAD_DIM, ROT, HKV_PAD, D_PAD, out_ty,
    )  # fmt: skip
    # A negative slot (padding) stores nothing; where(), not `mask & (slot >= 0)`, which the
    # interpreter turns into an int array (as store_kv's kernel notes).
    kv_mask = tl.where(slot >= 0, kv_mask, False)
    v_src = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v = tl.load(v_src, mask=kv_mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
    dst_off = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst_off, k.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_cache_ptr + dst_off, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rope_store_fits(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor
) -> bool:
    """Whether rope_store takes these tensors: one dtype throughout (q, k, v, the tables and
    the cache), [T, heads, D] heads with a contiguous last dim, and an even rotary width of at
    most D. Otherwise the caller rotates and stores as before (the torch path)."""
    head_dim = q.shape[-1]
    rot = cos.shape[-1]
    return (
        q.dim() == 3
        and k.dim() == 3
        and v.shape == k.shape
        and k.shape[-1] == head_dim
        and cos.dim() == 2
        and 2 <= rot <= head_dim
        and rot % 2 == 0
        and len({q.dtype, k.dtype, v.dtype, cos.dtype, k_cache.dtype}) == 1
        and all(t.stride(-1) == 1 for t in (q, k, v))
    )


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """apply_rope(q, cos, sin), returned as a new contiguous [T, Hq, D]; apply_rope(k, cos, sin)
    and v [T, Hkv, D] written into k_cache / v_cache [num_blocks, block_size, Hkv, D] at the
    flat slots slot_mapping [T] (a negative slot is skipped). cos / sin [T, R] are the model's
    tables gathered by position (rope_cos_sin). q, k, v may be strided views of a fused qkv
    projection. Mutates the caches."""
    check_cache_pair(k_cache, v_cache)
    if not rope_store_fits(q, k, v, cos, k_cache) or sin.shape != cos.shape:
        raise ValueError(
            f"rope_store of q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
            f"v {tuple(v.shape)}, cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)}, "
            f"cache {k_cache.dtype}: needs one dtype, [T, heads, D] heads with a contiguous "
            f"last dim and an even rotary width of at most D"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _, block_size, cache_heads, cache_dim = k_cache.shape
    if k.shape[0] != num_tokens or (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"q {tuple(q.shape)} / k {tuple(k.shape)} do not fit cache {tuple(k_cache.shape)}"
        )
    if cos.shape[0] != num_tokens or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"cos {tuple(cos.shape)} / slot_mapping {tuple(slot_mapping.shape)} need "
            f"{num_tokens} rows"
        )
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    # float32 must not contract x * cos + partner * sin into an FMA: torch rounds each product.
    options = {} if interpreting() else {"enable_fp_fusion": False}
    _rope_store_kernel[(num_tokens,)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HQ_PAD=triton.next_power_of_2(num_heads),
        HKV_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        D_PAD=pow2_at_least(head_dim, floor=1),
        ROT=cos.shape[-1],
        BLOCK_SIZE=block_size,
        **options,
    )  # fmt: skip
    return q_out
