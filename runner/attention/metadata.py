"""What the model runner tells every attention layer about a step: AttentionMetadata.

The step's sequences as flat (varlen) token batches: where each new token's K/V goes
(`slot_mapping`), where each sequence's queries start, its context length and its block table.
Built once a step and shared by every layer (and every backend: runner/attention/backend.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * B + offset) of each new token
    query_start_loc: torch.Tensor  # [S+1] int32: cu_seqlens of the new tokens per sequence
    context_lens: torch.Tensor  # [S] int32: tokens in KV per sequence, new ones included
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_lens: list[int]  # host copies for the torch path
    context_lens_host: list[int]
    max_query_len: int
    max_context_len: int
    decode_only: bool  # every query_len == 1
    # The block tables' host copy [S, max_blocks] int32 (what `block_tables` was uploaded
    # from), when the runner has one: a backend that plans from the tables (the Triton decode's
    # shared prefix) reads them here instead of copying them back from the device (a sync).
    block_tables_host: np.ndarray | None = None
    # Built by the torch path / the CPU kernels on first use, reused by every layer of the step.
    _torch_plan: Any = field(default=None, init=False, repr=False, compare=False)
    # The torch path's plans for sliding windows, by window: its layers may mix several.
    _window_plans: dict[int, Any] = field(default_factory=dict, init=False, repr=False)
    _cpu_split: Any = field(default=None, init=False, repr=False, compare=False)
    # The Triton decode's shared-prefix plan of this step, with what it was built for.
    _shared_prefix: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences whose new tokens sit at positions C - L .. C - 1.

        A convenience for tests and simple runners: slots come from the block tables."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables differ in length")
        slots: list[int] = []
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            if q_len > ctx or len(table) * block_size < ctx:
                raise ValueError(f"bad sequence: query {q_len}, context {ctx}, {len(table)} blocks")
            for pos in range(ctx - q_len, ctx):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        host = np.array(padded, dtype=np.int32).reshape(len(block_tables), width)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.from_numpy(host.copy()).to(device),
            query_lens=list(query_lens),
            context_lens_host=list(context_lens),
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
            decode_only=all(q == 1 for q in query_lens),
            block_tables_host=host,
        )
