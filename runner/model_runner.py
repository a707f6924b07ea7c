"""Turns a scheduled batch into flat model inputs (positions, slot mapping, block tables) and
returns the logits of the rows that sample."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcache import BlockManager
from kvcache.store import KVStore
from runner.attention import AttentionMetadata
from runner.model import CausalLM
from runner.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from runner.cuda_graphs import DecodeGraphs


class ModelRunner:
    """Runs one engine step on the model. Owns no scheduling state."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVStore,
        block_manager: BlockManager,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.graphs = graphs  # CUDA graphs of decode steps, captured at start-up
        self.model = model
        self.kv = kv
        self.bm = block_manager
        self.device = device
        self.block_size = block_manager.block_size

    def prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the batch: token ids [T], positions [T] and the attention metadata.

        A chunk starts at `item.start` (the cached or already computed length), so its positions
        continue the prefix, and its K/V go to slots after the prefix in the block table."""
        input_ids: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        for item in batch:
            seq = item.seq
            end = item.start + item.num_new_tokens
            tokens = seq.token_ids
            input_ids.extend(tokens[item.start : end])
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            starts.append(item.start)
            tables.append(self.bm.block_table(seq.seq_id))
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]

        dev = self.device
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        # [T]: which sequence each token belongs to, and its position in that sequence.
        seq_index = torch.repeat_interleave(torch.arange(len(batch)), q_lens)
        query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        offsets = torch.arange(len(input_ids)) - query_start_loc[:-1].to(torch.int64)[seq_index]
        positions = torch.tensor(starts, dtype=torch.int64)[seq_index] + offsets
        block_tables = torch.tensor(padded, dtype=torch.int32)
        block_ids = block_tables[seq_index, positions // self.block_size].to(torch.int64)
        slot_mapping = block_ids * self.block_size + positions % self.block_size

        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev, non_blocking=True),
            query_start_loc=query_start_loc.to(dev, non_blocking=True),
            context_lens=torch.tensor(context_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            query_lens=query_lens,
            context_lens_host=context_lens,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            decode_only=all(n == 1 for n in query_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
        return ids, positions.to(dev, non_blocking=True), meta

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """One forward pass; returns float32 logits [N, vocab], one row per item that samples,
        in batch order. Only those rows go through the LM head."""
        input_ids, positions, meta = self.prepare(batch)
        if (
            self.graphs is not None
            and meta.decode_only
            and self.graphs.can_run(len(batch), int(meta.block_tables.shape[1]))
        ):
            logits = self.graphs.run(input_ids, positions, meta)  # [B, vocab]
            if all(item.sample for item in batch):
                return logits
            # A one-token prefill chunk that does not sample can share a decode step.
            keep = [i for i, item in enumerate(batch) if item.sample]
            return logits.index_select(0, torch.tensor(keep, device=logits.device))
        hidden = self.model(input_ids, positions, meta, self.kv)  # [T, H]
        rows: list[int] = []  # each sampling item's last token
        end = -1
        for item, query_len in zip(batch, meta.query_lens, strict=True):
            end += query_len
            if item.sample:
                rows.append(end)
        if not rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        if len(rows) == hidden.shape[0]:  # every token samples (a decode step): all rows
            return self.model.compute_logits(hidden)
        index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, index))
