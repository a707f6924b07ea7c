"""Turns a scheduled batch into one step's plan (flat token ids, positions, slot mapping, block
tables: runner/engine/executor/worker.py) and hands it to the executor; returns the logits of the
rows that sample.

`BlockTableRows`: the step's block tables as one int32 array, kept between steps instead of built
anew.

A decoding sequence's block table gains a block every `block_size` tokens and is otherwise the
same from step to step, so rebuilding [batch, longest table] from the block manager's lists
each step copies every entry again: ~0.6 ms a step at 256 sequences of 2,000 tokens, host time
a GPU waits on. Here each sequence keeps a row of a persistent array, and a step copies only
the entries its table gained, then gathers the batch's rows in one indexing.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from runner.attention.backend import AttentionBackend
from runner.engine.executor.executor import Executor
from runner.engine.executor.worker import (
    ALIGN,
    PromptLogprobRows,
    StepInputs,
    StepOutput,
    StepPlan,
    StepRows,
    index_on,
    upload,
)
from runner.engine.step.scheduler import ScheduledSeq
from runner.model.blend import BlendRegion, Placement
from runner.model.decoder import CausalLM

if TYPE_CHECKING:
    from runner.model.cuda_graphs import DecodeGraphs

__all__ = ["ALIGN", "ModelRunner", "index_on", "upload"]

# Per-item fields read over a whole batch each step, by C-level scans.
_PROMPT_LOGPROBS = operator.attrgetter("seq.prompt_logprobs")  # a list while it is wanted
_SAMPLES = operator.attrgetter("sample")


class _Row:
    __slots__ = ("index", "table", "copied")

    def __init__(self, index: int, table: Sequence[int]) -> None:
        self.index = index
        # The block manager's own list: it only grows while its request lives, and a new
        # allocation of the request makes a new list. Holding it keeps its identity unique,
        # so `is` tells a readmitted sequence's fresh table from the one this row copied.
        self.table = table
        self.copied = 0  # entries of `table` already in the row


class BlockTableRows:
    """Rows of block tables by sequence id, each a prefix copy of the block manager's list."""

    def __init__(self, num_rows: int, width: int) -> None:
        self._array = np.zeros((max(num_rows, 1), max(width, 1)), dtype=np.int32)
        self._rows: dict[int, _Row] = {}
        self._free = list(range(self._array.shape[0]))

    def gather(self, seq_ids: Sequence[int], tables: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(seq_ids), longest table] int32: each sequence's table, padded with 0."""
        index: list[int] = []
        width = 0
        rows = self._rows
        for seq_id, table in zip(seq_ids, tables, strict=True):  # ~0.2 us a sequence: keep it lean
            row = rows.get(seq_id)
            if row is None or row.table is not table:
                row = self._assign(seq_id, table, seq_ids)
            n = len(table)
            if n != row.copied:
                if n > self._array.shape[1]:
                    self._widen(n)
                self._array[row.index, row.copied : n] = table[row.copied : n]
                row.copied = n
            index.append(row.index)
            if n > width:
                width = n
        return self._array[index, :width]

    def _assign(self, seq_id: int, table: Sequence[int], batch: Sequence[int]) -> _Row:
        """A row for a sequence new here, or whose table was allocated again. Rows of
        sequences that finished are taken back only when none is free, from those not in this
        batch (the runner is not told when a sequence ends)."""
        old = self._rows.pop(seq_id, None)
        if old is not None:
            self._free.append(old.index)
        if not self._free:
            wanted = set(batch)
            for gone in [s for s in self._rows if s not in wanted]:
                self._free.append(self._rows.pop(gone).index)
        if not self._free:  # every row is in this batch: a batch wider than expected
            grown = self._array.shape[0]
            self._array = np.concatenate([self._array, np.zeros_like(self._array)])
            self._free = list(range(grown, self._array.shape[0]))
        row = _Row(self._free.pop(), table)
        self._array[row.index] = 0  # the padding past a table is 0, as a fresh array's
        self._rows[seq_id] = row
        return row

    def _widen(self, width: int) -> None:
        """Room for a table longer than any before (a context past the expected longest)."""
        grown = np.zeros((self._array.shape[0], max(width, 2 * self._array.shape[1])), np.int32)
        grown[:, : self._array.shape[1]] = self._array
        self._array = grown


class ModelRunner:
    """Plans one engine step and runs it through the executor. Owns no scheduling state."""

    def __init__(
        self, executor: Executor, block_size: int, max_num_seqs: int, max_model_len: int
    ) -> None:
        self.executor = executor
        self.block_size = block_size
        self.table_rows = BlockTableRows(2 * max_num_seqs, -(-max_model_len // self.block_size))

    # What reads rank 0's worker in place: the decoder, its backend, its graphs.
    @property
    def model(self) -> CausalLM:
        return self.executor.local.model

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.executor.local.graphs

    @property
    def attention(self) -> AttentionBackend:
        return self.executor.local.attention

    @attention.setter
    def attention(self, backend: AttentionBackend) -> None:
        if self.executor.tensor_parallel_size > 1:
            raise ValueError("the attention backend of tensor-parallel workers is fixed")
        self.executor.local.attention = backend

    @property
    def device(self) -> torch.device:
        return self.executor.local.device

    def plan(self, batch: list[ScheduledSeq]) -> StepPlan:
        """Flatten the batch: token ids [T], positions [T], slots and block tables.

        A chunk starts at `item.start` (the cached or already computed length), so its positions
        continue the prefix, and its K/V go to slots after the prefix in the block table.

        Built in numpy on the host: this runs every step, and at 256 decoding sequences torch's
        per-call overhead and its nested-list conversion of the block tables cost more than the
        step's GPU work (~1 ms here against ~0.3 ms)."""
        n = len(batch)
        query_lens = [item.num_new_tokens for item in batch]
        starts = [item.start for item in batch]
        context_lens = [start + q for start, q in zip(starts, query_lens, strict=True)]
        seq_ids = [item.seq.seq_id for item in batch]
        block_tables = self.table_rows.gather(seq_ids, [item.block_table for item in batch])
        if all(q == 1 for q in query_lens):  # one token each: the newest, at position `start`
            input_ids = [item.seq.token_ids[item.start] for item in batch]
            positions = np.array(starts, dtype=np.int64)
            seq_index = np.arange(n)
        else:
            input_ids = []
            for item in batch:  # a draft's guessed tokens follow the sequence's own
                own = item.num_new_tokens - len(item.draft)
                input_ids.extend(item.seq.token_ids[item.start : item.start + own] + item.draft)
            q_lens = np.array(query_lens, dtype=np.int64)
            # [T]: which sequence each token belongs to, and its position in that sequence.
            seq_index = np.repeat(np.arange(n), q_lens)
            first_token = np.cumsum(q_lens) - q_lens
            positions = np.array(starts, dtype=np.int64)[seq_index] + (
                np.arange(len(input_ids)) - first_token[seq_index]
            )
        block_ids = block_tables[seq_index, positions // self.block_size].astype(np.int64)
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        query_start_loc = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        return StepPlan(
            input_ids=np.array(input_ids, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            context_lens=np.array(context_lens, dtype=np.int32),
            block_tables=block_tables,
            query_lens=query_lens,
            rows=step_rows(batch, query_lens),
        )

    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """One forward pass; returns float32 logits [N, vocab], one row per item that samples
        (1 + len(draft) for an item with a draft), in batch order. Only those rows go through
        the LM head. One worker in this process takes the plan's inputs as `prepare` uploads
        them; N ranks take the plan itself."""
        if self.executor.tensor_parallel_size == 1:
            return self.forward(batch, self.prepare(batch))
        return self._finish(batch, self.executor.execute(self.plan(batch)))

    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs:
        """The step's inputs on the device, for `forward` (an overlapped step uploads them on
        the host, then queues `forward` as the device's work: overlap.py; in-process only)."""
        return self.executor.local.upload(self.plan(batch))

    def forward(self, batch: list[ScheduledSeq], inputs: StepInputs) -> torch.Tensor:
        """`run`'s device half, over the inputs `prepare` made for `batch`."""
        return self._finish(batch, self.executor.local.forward(inputs))

    def compute_kv(self, token_ids: list[int], start: int, block_table: list[int]) -> None:
        """Write the K/V of positions [start, start + len(token_ids)) of a prompt whose earlier
        positions' K/V are in its blocks already (a segment cached on its own)."""
        self.executor.compute_kv(token_ids, start, block_table)

    def place_and_blend(self, placement: Placement, region: BlendRegion, ratio: float) -> int:
        """Cached segments' K/V placed into a prompt's slots, then blended (runner/model/
        blend.py); returns how many reused tokens were recomputed."""
        return self.executor.place_and_blend(placement, region, ratio)

    def _finish(self, batch: list[ScheduledSeq], out: StepOutput) -> torch.Tensor:
        """The logits, with the prompt tokens' log-probabilities handed to their sequences."""
        if out.prompt_logprobs is not None:
            wanted = prompt_rows(batch, [item.num_new_tokens for item in batch])
            for (_, item, position), value in zip(wanted, out.prompt_logprobs, strict=True):
                assert item.seq.prompt_logprobs is not None
                item.seq.prompt_logprobs[position] = value
        return out.logits


def step_rows(batch: list[ScheduledSeq], query_lens: list[int]) -> StepRows:
    """Which hidden rows the LM head takes: each sampling item's last token and a draft's every
    token (None: one token an item, each sampling), and the rows scoring prompt tokens."""
    asked = None
    if any(map(_PROMPT_LOGPROBS, batch)):  # the usual step: no one asks
        scored = prompt_rows(batch, query_lens)
        asked = PromptLogprobRows(
            [row for row, _, _ in scored],
            [item.seq.prompt_token_ids[p] for _, item, p in scored],
            [int(item.seq.params.prompt_logprobs or 0) for _, item, _ in scored],
        )
    if len(batch) == sum(query_lens) and all(map(_SAMPLES, batch)):
        return StepRows(None, asked)
    logit_rows: list[int] = []
    end = -1
    for item, query_len in zip(batch, query_lens, strict=True):
        end += query_len
        if item.sample:
            logit_rows.extend(range(end - len(item.draft), end + 1))
    return StepRows(logit_rows, asked)


def prompt_rows(
    batch: list[ScheduledSeq], query_lens: list[int]
) -> list[tuple[int, ScheduledSeq, int]]:
    """(hidden row, item, prompt position predicted) of each row scoring a prompt token, in row
    order: the row of chunk position p predicts prompt token p + 1."""
    found: list[tuple[int, ScheduledSeq, int]] = []
    offset = 0
    for item, query_len in zip(batch, query_lens, strict=True):
        seq = item.seq
        if seq.prompt_logprobs is not None:
            last = min(item.start + query_len, seq.num_prompt_tokens - 1)
            found.extend((offset + p - item.start, item, p + 1) for p in range(item.start, last))
        offset += query_len
    return found
