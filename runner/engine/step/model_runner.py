"""Turns a scheduled batch into flat model inputs (positions, slot mapping, block tables) and
returns the logits of the rows that sample."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvcache.store import KVStore
from runner.attention.backend import AttentionBackend
from runner.attention.metadata import AttentionMetadata
from runner.backends.torch.backend import TORCH_ATTENTION
from runner.engine.step.scheduler import ScheduledSeq
from runner.model.blend import BlendRegion, Placement, blend, compute_chunk, place
from runner.model.block_tables import BlockTableRows
from runner.model.decoder import CausalLM
from runner.sampling.logprobs import logprobs_of

if TYPE_CHECKING:
    from runner.model.cuda_graphs import DecodeGraphs

ALIGN = 256  # bytes: where each of a step's packed inputs starts (see `upload`)
PROMPT_ROWS = 256  # prompt positions put through the LM head at once for prompt_logprobs
# Per-item fields read over a whole batch each step, by C-level scans.
_PROMPT_LOGPROBS = operator.attrgetter("seq.prompt_logprobs")  # a list while it is wanted
_SAMPLES = operator.attrgetter("sample")


class ModelRunner:
    """Runs one engine step on the model. Owns no scheduling state."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVStore,
        block_size: int,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        attention: AttentionBackend = TORCH_ATTENTION,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.graphs = graphs  # CUDA graphs of decode steps, captured at start-up
        self.model = model
        self.attention = attention  # the engine's backend, passed to every forward pass
        self.kv = kv
        self.device = device
        self.block_size = block_size
        self.table_rows = BlockTableRows(2 * max_num_seqs, -(-max_model_len // self.block_size))

    def prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the batch: token ids [T], positions [T] and the attention metadata.

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
        decode_only = all(q == 1 for q in query_lens)
        if decode_only:  # one token each: the newest, at position `start`
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

        slots, starts_t, contexts, tables, ids, positions_t = upload(
            [
                slot_mapping,
                query_start_loc,
                np.array(context_lens, dtype=np.int32),
                block_tables,
                np.array(input_ids, dtype=np.int64),
                positions,
            ],
            self.device,
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=starts_t,
            context_lens=contexts,
            block_tables=tables,
            query_lens=query_lens,
            context_lens_host=context_lens,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            decode_only=decode_only,
            block_tables_host=block_tables,
        )
        return ids, positions_t, meta

    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """One forward pass; returns float32 logits [N, vocab], one row per item that samples
        (1 + len(draft) for an item with a draft), in batch order. Only those rows go through
        the LM head."""
        return self.forward(batch, *self.prepare(batch))

    @torch.inference_mode()
    def forward(
        self,
        batch: list[ScheduledSeq],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`run`'s device half, over the inputs `prepare` made for `batch` (an overlapped step,
        overlap.py, prepares on the host and queues this as the device's work)."""
        if (
            self.graphs is not None
            and meta.decode_only
            and self.graphs.can_run(len(batch), int(meta.block_tables.shape[1]))
        ):
            logits = self.graphs.run(input_ids, positions, meta)  # [B, vocab]
            self._record_prompt_logprobs(batch, meta.query_lens, logits=logits)
            if all(map(_SAMPLES, batch)):
                return logits
            # A one-token prefill chunk that does not sample can share a decode step.
            keep = [i for i, item in enumerate(batch) if item.sample]
            return logits.index_select(0, index_on(keep, logits.device))
        hidden = self.model(input_ids, positions, meta, self.kv, self.attention)  # [T, H]
        self._record_prompt_logprobs(batch, meta.query_lens, hidden=hidden)
        if len(batch) == hidden.shape[0] and all(map(_SAMPLES, batch)):
            return self.model.compute_logits(hidden)  # one token an item, each samples: all rows
        rows: list[int] = []  # each sampling item's last token, and a draft's every token
        end = -1
        for item, query_len in zip(batch, meta.query_lens, strict=True):
            end += query_len
            if item.sample:
                rows.extend(range(end - len(item.draft), end + 1))
        if not rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        if len(rows) == hidden.shape[0]:  # every token samples (a decode step): all rows
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden.index_select(0, index_on(rows, hidden.device)))

    @torch.inference_mode()
    def compute_kv(self, token_ids: list[int], start: int, block_table: list[int]) -> None:
        """Write the K/V of positions [start, start + len(token_ids)) of a prompt whose earlier
        positions' K/V are in its blocks already: a prefill that samples nothing (a segment
        cached on its own)."""
        compute_chunk(self.model, self.kv, self.attention, token_ids, start, block_table)

    @torch.inference_mode()
    def place_and_blend(self, placement: Placement, region: BlendRegion, ratio: float) -> int:
        """Cached segments' K/V placed into a prompt's slots, then blended (runner/model/
        blend.py); returns how many reused tokens were recomputed."""
        place(self.model, self.kv, placement)
        return blend(self.model, self.kv, self.attention, region, ratio)

    def _record_prompt_logprobs(
        self,
        batch: list[ScheduledSeq],
        query_lens: list[int],
        hidden: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        """For the sequences that ask for prompt log-probabilities: the row of each position p
        of this step's chunk predicts prompt token p + 1; its figures go to
        seq.prompt_logprobs[p + 1]. From `logits` when the step made them for every row (a
        decode graph), else through the LM head over `hidden` [T, H], PROMPT_ROWS at a time
        (a [T, vocab] block of logits for a long prompt would take gigabytes)."""
        if not any(map(_PROMPT_LOGPROBS, batch)):
            return  # the usual step: no one asks
        rows: list[int] = []
        targets: list[tuple[ScheduledSeq, int]] = []  # (item, prompt position predicted)
        offset = 0
        for item, query_len in zip(batch, query_lens, strict=True):
            seq = item.seq
            if seq.prompt_logprobs is not None:
                last = min(item.start + query_len, seq.num_prompt_tokens - 1)
                for position in range(item.start, last):
                    rows.append(offset + position - item.start)
                    targets.append((item, position + 1))
            offset += query_len
        for first in range(0, len(rows), PROMPT_ROWS):
            index = torch.tensor(rows[first : first + PROMPT_ROWS], device=self.device)
            if logits is not None:
                chunk = logits.index_select(0, index)
            else:
                assert hidden is not None
                chunk = self.model.compute_logits(hidden.index_select(0, index))
            wanted = targets[first : first + PROMPT_ROWS]
            found = logprobs_of(
                chunk,
                [item.seq.prompt_token_ids[p] for item, p in wanted],
                [int(item.seq.params.prompt_logprobs or 0) for item, _ in wanted],
            )
            for (item, position), value in zip(wanted, found, strict=True):
                assert item.seq.prompt_logprobs is not None
                item.seq.prompt_logprobs[position] = value


def index_on(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`. On a GPU it goes over from pinned memory
    without blocking: `torch.tensor(values, device=...)` waits for every kernel queued before
    it, which would stall an overlapped step (overlap.py) on the one in flight."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload(
    arrays: list[np.ndarray], device: torch.device, pack: bool | None = None
) -> list[torch.Tensor]:
    """The host arrays as tensors on `device`. On the CPU they share the arrays' memory. On a
    GPU (`pack`) they go over in one host-to-device copy from pinned memory: their bytes packed
    into one staging buffer (each at a 256-byte boundary, as a fresh device allocation is:
    kernels compiled for aligned pointers get them), copied without blocking, and each tensor
    a view of the device copy. A copy from pageable memory may wait for the kernels
    queued before it, which would undo asynchronous scheduling (runner/engine/step/overlap.py);
    torch's pinned allocator keeps the buffer until its copy has run."""
    if pack is None:
        pack = device.type == "cuda"
    if not pack:
        return [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets = []
    total = 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // ALIGN) * ALIGN
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host = staging.numpy()
    for a, at in zip(arrays, offsets, strict=True):
        host[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
    on_device = staging.to(device, non_blocking=True)
    return [
        on_device[at : at + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape)
        for a, at in zip(arrays, offsets, strict=True)
    ]
