"""The CPU attention backend ("cpu"): the C kernels of runner/backends/cpu/csrc on the paged
cache, and the torch path (runner/backends/torch/paged.py) wherever they cannot run; and its
batch-invariant form (`batch_invariant_attention`, EngineConfig.deterministic), which has no
such fallback."""

from __future__ import annotations

import torch

from runner.attention.backend import AttentionBackend, AttentionCall, Capabilities
from runner.backends.cpu.kernel import CpuKernels
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.cpu.portable import load_portable_decode
from runner.backends.cpu.split import CpuSplit
from runner.backends.torch.paged import torch_paged_attention, write_kv


def cpu_paged_attention(call: AttentionCall) -> torch.Tensor:
    """The C kernels (runner/backends/cpu/csrc): decodes in decode_attention.c, longer queries in
    prefill_attention.c, both reading every sequence's blocks in place with no gather, padding
    or split to plan; with a sliding `window`, each query only its last `window` keys (the
    others are not read); with a `softcap` c, each score s as c * tanh(s / c). The torch path
    where the kernels cannot run (no AVX-512, no build, a head size they do not take), with its
    decodes in the portable kernel where that one can (runner/backends/cpu/portable.py)."""
    q, k, v, k_cache, v_cache, meta = call.q, call.k, call.v, call.k_cache, call.v_cache, call.meta
    scale, window, softcap = call.scale, call.window, call.softcap
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.prefill_supported(q, k_cache):
        portable = load_portable_decode()
        decode = None
        if portable is not None and portable.supported(q, k_cache):
            decode = portable.decode_attention
        return torch_paged_attention(call, decode)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    group = q.shape[1] // k_cache.shape[2]
    decode_kernel = kernels.decode_supported(q, k_cache)
    split = CpuSplit.for_step(meta, decode_kernel, group, k_cache.shape[1])
    if split.longer is None and split.decodes is not None:  # decodes only: q as it is
        return kernels.decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            scale,
            split.shared_blocks,
            window,
            softcap,
        )
    return attend_split(kernels, q, k_cache, v_cache, split, scale, window, softcap)


def attend_split(
    kernels: CpuKernels,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    split: CpuSplit,
    scale: float,
    window: int | None,
    softcap: float | None,
    tiled: bool = False,
) -> torch.Tensor:
    """A step's attention as `split` divides it: its decodes through decode_attention.c (in the
    prefill tile's order when `tiled`), its longer queries through prefill_attention.c."""
    out = torch.empty_like(q)
    if split.decodes is not None:
        rows, tables, contexts = split.decodes
        decoded = kernels.decode_attention(
            q.index_select(0, rows),
            k_cache,
            v_cache,
            tables,
            contexts,
            scale,
            split.shared_blocks,
            window,
            softcap,
            tiled=tiled,
        )
        out.index_copy_(0, rows, decoded)
    if split.longer is not None:
        tables, starts, lens, contexts = split.longer
        kernels.prefill_attention(
            q, k_cache, v_cache, tables, starts, lens, contexts, out, scale, window, softcap
        )
    return out


def batch_invariant_attention(call: AttentionCall) -> torch.Tensor:
    """The C kernels with each query row summed in one order, prefill_attention.c's tile's
    (CpuSplit.for_step's batch_invariant): a row's output is bitwise the same whatever else the
    step holds, whether it is a prompt's, a decode's or a recompute's, and wherever its prompt's
    chunk or cached prefix ends (docs/DETERMINISM.md). Raises ValueError where the kernels
    cannot take these shapes: there is no other path whose sums are fixed."""
    q, k_cache, v_cache, meta = call.q, call.k_cache, call.v_cache, call.meta
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.decode_supported(q, k_cache):
        raise ValueError(
            f"deterministic attention needs the CPU attention kernels for q {tuple(q.shape)}, "
            f"cache block {tuple(k_cache.shape[1:])}"
        )
    write_kv(call.k, call.v, k_cache, v_cache, meta.slot_mapping)
    group = q.shape[1] // k_cache.shape[2]
    split = CpuSplit.for_step(meta, True, group, k_cache.shape[1], batch_invariant=True)
    return attend_split(
        kernels, q, k_cache, v_cache, split, call.scale, call.window, call.softcap, tiled=True
    )


def batch_invariant_backend() -> AttentionBackend:
    """The "cpu" backend in its batch-invariant form (EngineConfig.deterministic). Raises
    ValueError where the C kernels do not run here (no AVX-512, no C compiler, a failed build):
    torch's own products and attention choose their kernels, and so their sums, by the batch."""
    if load_cpu_kernels() is None:
        raise ValueError(
            "deterministic=True needs the CPU's C kernels (an AVX-512 CPU and a C compiler; "
            "the log says why they did not load): torch's own products and attention sum in an "
            "order that depends on the batch"
        )
    return AttentionBackend(
        "cpu", batch_invariant_attention, Capabilities(deterministic=True, cpu_layer_stack=True)
    )


def cpu_backend() -> AttentionBackend:
    """The "cpu" backend: the C kernels (a shared prefix read once by its decodes), whose C
    layer stack may run whole steps for it."""
    return AttentionBackend(
        "cpu", cpu_paged_attention, Capabilities(shared_prefix_plan=True, cpu_layer_stack=True)
    )
