"""Triton paged attention: the "triton" backend, the twin of the torch path
(runner/backends/torch/paged.py).

Cache layout (runner/kv_pool/store.py): k_cache / v_cache [num_blocks, block_size, Hkv, D];
a token's flat slot is block * block_size + offset. A step first writes the new tokens' K/V at
their slots (store_kv), then attends: decode-only steps go to the split-K decode kernels
(runner/backends/triton/decode.py), anything else to the varlen causal prefill kernel
(runner/backends/triton/prefill.py), which also covers mixed prefill + decode batches. Both take an
optional sliding window (and then load only the keys inside it) and an optional logit soft cap.

A decode-only step whose sequences share leading blocks can read each group's prefix once
(shared-prefix attention: runner/backends/triton/shared_prefix.py), where the cost model
(cascade_cost.py) says it saves enough; the plan is built once a step, on its first layer, from
the host copy of the block tables the runner uploaded them from (meta.block_tables_host: no
device read). The registry's "triton" backend plans by the default thresholds; a step without
host tables (a decode graph's static metadata) or being captured never plans, and a decode graph
gets its plan from runner/model/cuda_graphs.py instead (`shared_prefix=`, its static tensors).

Without CUDA the kernels run in Triton's interpreter on CPU tensors
(runner/backends/triton/common.py).
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from runner.attention.backend import Attend, AttentionBackend, AttentionCall, Capabilities
from runner.attention.metadata import AttentionMetadata
from runner.backends.triton.cascade_cost import DEFAULT_THRESHOLDS, NEVER, CascadeThresholds
from runner.backends.triton.common import (
    check_cache_pair,
    check_softcap,
    check_window,
    last_dim_contiguous,
    pow2_at_least,
)
from runner.backends.triton.decode import decode_attention
from runner.backends.triton.prefill import prefill_attention
from runner.backends.triton.shared_prefix import SharedPrefixPlan, plan_decode_step

__all__ = [
    "decode_attention",
    "planned_shared_prefix",
    "prefill_attention",
    "store_kv",
    "triton_backend",
    "triton_paged_attention",
]


@triton.jit
def _store_kv_kernel(
    k_ptr: tl.tensor,  # [T, Hkv, D]
    v_ptr: tl.tensor,  # [T, Hkv, D]
    k_cache_ptr: tl.tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr: tl.tensor,  # same layout and strides as k_cache
    slot_mapping_ptr: tl.tensor,  # [T] int64 flat slots; < 0 means "do not store"
    stride_kt: int,
    stride_kh: int,
    stride_vt: int,
    stride_vh: int,
    stride_cb: int,
    stride_co: int,
    stride_ch: int,
    NUM_KV_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    # A negative slot (padding) stores nothing. where() rather than `mask & (slot >= 0)`: the
    # interpreter turns `tensor & scalar-bool` into an int array that tl.load rejects.
    mask = tl.where(slot >= 0, mask, False)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
    dst_off = dst + offs_h[:, None] * stride_ch + offs_d[None, :]  # [H_PAD, D_PAD]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask)
    tl.store(k_cache_ptr + dst_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V [T, Hkv, D] into k_cache / v_cache [num_blocks, block_size, Hkv, D] at the
    flat slots slot_mapping [T] (int32 or int64); tokens with a negative slot are skipped.
    k / v may be strided views (e.g. slices of a fused qkv projection). Mutates the caches."""
    check_cache_pair(k_cache, v_cache)
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    num_tokens, num_kv_heads, head_dim = k.shape
    _, block_size, cache_heads, cache_dim = k_cache.shape
    if v.shape != k.shape or (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit cache {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} != ({num_tokens},)")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        H_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        D_PAD=pow2_at_least(head_dim, floor=1),
        BLOCK_SIZE=block_size,
    )


def triton_paged_attention(
    call: AttentionCall,
    *,
    partition_size: int | None = None,
    cascade: CascadeThresholds = NEVER,
    shared_prefix: SharedPrefixPlan | None = None,
    store: bool = True,
) -> torch.Tensor:
    """Paged attention's contract (AttentionCall) in Triton.

    q [T, Hq, D], k / v [T, Hkv, D]; k_cache / v_cache [num_blocks, block_size, Hkv, D].
    Writes k / v into the caches at meta.slot_mapping (mutates them), then query i of a sequence
    with query_len L and context_len C sits at position p = C - L + i and attends to its
    sequence's keys at positions j with

        p - window < j <= p    (window W >= 1: its last W tokens, itself included)
        0 <= j <= p            (window None: the whole causal context)

    which is transformers' sliding_window_overlay (kv_idx > q_idx - sliding_window). A window
    of 1 sees only the token itself; one >= C cuts nothing (the same result as None).
    Each score is s = (q . k) * scale; a `softcap` c > 0 makes it c * tanh(s / c) before the
    mask and the softmax (Gemma 2's attn_logit_softcapping); None leaves it as it is.
    Returns [T, Hq, D] in q's dtype.

    The window is a runtime kernel argument (one compiled kernel serves every window size, so
    the layers of a model may differ and a CUDA graph captures each layer's value) plus a
    constexpr flag: window=None compiles the kernels exactly as before, with no extra work.
    Work outside the window is skipped, not masked: a decode's split-K partitions start at its
    window start max(C - W, 0), so it reads only keys C - W .. C - 1 and launches
    cdiv(min(C, W), partition_size) partitions, none of them empty; a prefill tile starts its
    key loop at the window start of its first query and masks per key only the span where its
    queries' windows differ, exactly at any block or tile alignment. The soft cap is passed the
    same way (a runtime float plus a constexpr flag), so softcap=None costs nothing either.

    `partition_size` overrides the decode split-K partition length (keys per program).
    `cascade` holds the cost model's thresholds for reading a shared prefix once (NEVER, the
    default here: never; the registry's "triton" backend passes DEFAULT_THRESHOLDS); a decode
    plans only from `meta.block_tables_host`. `shared_prefix` is a plan given as it is (a
    decode graph's static one, refilled before each replay): it replaces the planning, and
    a step with no group in it reads every context whole, as the plain kernel does.
    `store` False: k / v are already in the caches (rope_store.py wrote them); no store_kv.
    """
    q, k_cache, v_cache, meta = call.q, call.k_cache, call.v_cache, call.meta
    scale, window, softcap = call.scale, call.window, call.softcap
    check_window(window)
    check_softcap(softcap)  # before store_kv: a refused call leaves the caches as they were
    if store:
        store_kv(call.k, call.v, k_cache, v_cache, meta.slot_mapping)
    if meta.decode_only:
        kwargs = {} if partition_size is None else {"partition_size": partition_size}
        plan = shared_prefix
        if plan is None:  # no fixed plan given: the cost model's, from the host tables
            plan = step_shared_prefix(meta, q, k_cache, cascade)
        uncut = window is None or window >= meta.max_context_len  # a window could hide it all
        return decode_attention(
            q,
            k_cache,
            v_cache,
            meta.context_lens,
            meta.block_tables,
            scale,
            meta.max_context_len,
            window=window,
            softcap=softcap,
            shared_prefix=plan if uncut else None,
            **kwargs,
        )
    return prefill_attention(
        q,
        k_cache,
        v_cache,
        meta.query_start_loc,
        meta.context_lens,
        meta.block_tables,
        scale,
        meta.max_query_len,
        window=window,
        softcap=softcap,
    )


def planned_shared_prefix(meta: AttentionMetadata) -> SharedPrefixPlan | None:
    """The shared-prefix plan a decode step ran with (None: none, or not planned yet)."""
    cached = meta._shared_prefix
    plan: SharedPrefixPlan | None = None if cached is None else cached[1]
    return plan


def step_shared_prefix(
    meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, thresholds: CascadeThresholds
) -> SharedPrefixPlan | None:
    """The decode step's shared-prefix plan, built on its first layer and kept on `meta` for the
    others; None without the host's block tables (they are never read back from the device),
    while a CUDA graph is being captured (its plan comes from the graph's buffers), or when the
    cost model keeps no group."""
    if meta.block_tables_host is None or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    key = (thresholds, block_size, q.shape[1], num_kv_heads, head_dim, k_cache.dtype)
    cached = meta._shared_prefix
    if cached is not None and cached[0] == key:
        plan: SharedPrefixPlan | None = cached[1]
        return plan
    plan = None
    if meta.num_seqs >= max(2, thresholds.min_group_size) and (
        meta.max_context_len > thresholds.min_prefix_tokens
    ):  # only then can a group pass the cost model: skip the grouping's host work
        plan = plan_decode_step(
            torch.from_numpy(meta.block_tables_host),
            meta.context_lens_host,
            block_size,
            q.shape[1],
            num_kv_heads,
            head_dim,
            k_cache.dtype,
            q.device,
            thresholds,
        )
    meta._shared_prefix = (key, plan)
    return plan


def triton_backend(
    cascade: CascadeThresholds = DEFAULT_THRESHOLDS, shared_prefix: SharedPrefixPlan | None = None
) -> AttentionBackend:
    """The Triton attention as a backend whose decodes read shared prefixes by `cascade`'s
    thresholds (NEVER: a baseline without, ALWAYS: every group found), or by the fixed plan
    `shared_prefix` (a decode graph's static tensors, filled before each replay)."""

    def attention(store: bool) -> Attend:
        return partial(
            triton_paged_attention, cascade=cascade, shared_prefix=shared_prefix, store=store
        )

    # attend_stored: the K/V are in the cache already (the fused RoPE + store kernel wrote them).
    return AttentionBackend(
        "triton",
        attention(store=True),
        Capabilities(supports_cuda_graphs=True, fuses_rope_store=True, shared_prefix_plan=True),
        attend_stored=attention(store=False),
    )
