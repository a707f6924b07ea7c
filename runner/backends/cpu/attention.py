"""The CPU attention backend ("cpu"): the C kernels of runner/backends/cpu/csrc on the paged cache,
and the torch path (runner/attention/paged.py) wherever they cannot run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.attention.cascade import count_shared_blocks
from runner.attention.paged import AttentionMetadata, torch_paged_attention, write_kv
from runner.backends.cpu.loader import load_cpu_kernels


def cpu_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The C kernels (runner/backends/cpu/csrc): decodes in decode_attention.c, longer queries in
    prefill_attention.c, both reading every sequence's blocks in place with no gather, padding
    or split to plan; with a sliding `window`, each query only its last `window` keys (the
    others are not read); with a `softcap` c, each score s as c * tanh(s / c). The torch path
    where the kernels cannot run (no build, a head size they do not take)."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.prefill_supported(q, k_cache):
        return torch_paged_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
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
        )
        out.index_copy_(0, rows, decoded)
    if split.longer is not None:
        tables, starts, lens, contexts = split.longer
        kernels.prefill_attention(
            q, k_cache, v_cache, tables, starts, lens, contexts, out, scale, window, softcap
        )
    return out


# Query rows (sequences x query heads per KV head) from which a decode step scores a shared
# prefix for all rows together: one 16-lane tile.
SHARED_PREFIX_MIN_ROWS = 16


@dataclass
class CpuSplit:
    """A step's sequences for the CPU kernels, built once and shared by every layer: the
    decodes (one new token) for decode_attention, the rest for prefill_attention."""

    # (each decode's row of q [Sd] int64, block tables [Sd, max_blocks] int32, context
    # lengths [Sd] int32) of the decodes
    decodes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (block tables, first rows, query lengths, context lengths) of the others, int32
    longer: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    # Leading blocks common to every decode of the step, worth scoring together. One count for
    # every layer: in a layer whose sliding window starts past key 0 for some decode,
    # decode_attention.c reads them per sequence instead (it never scores a key out of a window).
    shared_blocks: int = 0

    @classmethod
    def for_step(
        cls, meta: AttentionMetadata, decode_kernel: bool, group: int, block_size: int
    ) -> CpuSplit:
        """The step's split: built by its first layer, kept on `meta` for the others."""
        if meta._cpu_split is None:
            meta._cpu_split = cls.of(meta, decode_kernel, group, block_size)
        split: CpuSplit = meta._cpu_split
        return split

    @classmethod
    def of(
        cls, meta: AttentionMetadata, decode_kernel: bool, group: int, block_size: int
    ) -> CpuSplit:
        lens = torch.tensor(meta.query_lens)
        is_decode = (lens == 1) if decode_kernel else torch.zeros_like(lens, dtype=torch.bool)
        decodes = is_decode.nonzero().flatten()
        others = (~is_decode).nonzero().flatten()
        starts = meta.query_start_loc[:-1].to(torch.int64)
        longer = None
        if others.numel():
            longer = (
                meta.block_tables.index_select(0, others).contiguous(),
                starts.index_select(0, others).to(torch.int32),
                lens.index_select(0, others).to(torch.int32),
                meta.context_lens.index_select(0, others).contiguous(),
            )
        if not decodes.numel():
            return cls(None, longer)
        decode_tables = meta.block_tables.index_select(0, decodes).contiguous()
        shared = 0
        # A shared prefix pays when its rows fill a 16-lane tile (decode_attention.c).
        if decodes.numel() * group >= SHARED_PREFIX_MIN_ROWS:
            contexts = meta.context_lens_host
            first_query = [contexts[i] - 1 for i in decodes.tolist()]
            shared = count_shared_blocks(decode_tables, first_query, block_size)
        rows = starts.index_select(0, decodes)
        contexts_of_decodes = meta.context_lens.index_select(0, decodes).contiguous()
        return cls((rows, decode_tables, contexts_of_decodes), longer, shared)
