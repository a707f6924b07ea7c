"""A step's sequences as the CPU kernels take them (CpuSplit), built once and shared by every
layer: by the attention backend (runner/backends/cpu/attention.py) and the C layer stack
(runner/model/cpu_layers.py), and read by the C interface (runner/backends/cpu/abi.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.attention.metadata import AttentionMetadata
from runner.backends.torch.cascade import count_shared_blocks

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
    # Deterministic mode: the decodes go to tiled_decode.c, which sums each row as
    # prefill_attention.c's tile sums a prompt's row at that position.
    tiled_decodes: bool = False

    @classmethod
    def for_step(
        cls,
        meta: AttentionMetadata,
        decode_kernel: bool,
        group: int,
        block_size: int,
        batch_invariant: bool = False,
    ) -> CpuSplit:
        """The step's split: built by its first layer, kept on `meta` for the others.
        `batch_invariant` (EngineConfig.deterministic, docs/DETERMINISM.md): the decodes go to
        tiled_decode.c, which sums each query row as prefill_attention.c's tile does (16 keys at
        a time from key 0, per key a sequential dot product over the head), the tile's order
        whatever rows share it, wherever a prompt's chunk or cached prefix ends, and whether
        the row is a prompt's, a decode's or a recompute's."""
        if meta._cpu_split is None:
            built = cls.of(meta, decode_kernel, group, block_size)
            built.tiled_decodes = batch_invariant and built.decodes is not None
            meta._cpu_split = built
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
