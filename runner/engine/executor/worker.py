"""A worker: the model (whole, or one tensor-parallel rank's share) and its KV pool, and every
operation that touches them. The engine reaches it only through an executor (multiproc.py), by
values: a step's plan, block ids, bytes. On one device the engine's process holds the one
worker; with tensor parallelism each rank holds one, and rank 0's is the engine's.

The step's plan (`StepPlan`): one engine step's plan as a value: what every worker needs to run the
step's forward pass, and nothing that lives only in the engine (no sequences, no scheduler state).
The engine builds it once (runner/engine/step/model_runner.py); one worker in this process consumes
it as it is, N tensor-parallel workers receive it pickled (multiproc.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from runner.attention.backend import AttentionBackend
from runner.attention.metadata import AttentionMetadata
from runner.engine.kv.transfer import read_blocks, write_blocks
from runner.kv_pool.store import KVStore
from runner.model.blend import BlendRegion, Placement, blend, compute_chunk, place
from runner.model.decoder import CausalLM
from runner.sampling.logprobs import TokenLogprobs, logprobs_of

if TYPE_CHECKING:
    from runner.model.cuda_graphs import DecodeGraphs

ALIGN = 256  # bytes: where each of a step's packed inputs starts (see `upload`)
PROMPT_ROWS = 256  # prompt positions put through the LM head at once for prompt_logprobs


@dataclass(frozen=True)
class PromptLogprobRows:
    """Rows of the step whose logits score prompt tokens: row i predicts targets[i], with the
    widths[i] likeliest tokens beside it."""

    rows: list[int]
    targets: list[int]
    widths: list[int]


@dataclass(frozen=True)
class StepRows:
    """Which of the step's hidden rows go through the LM head: `logit_rows` (None: every row,
    each item sampling one token), and those scoring prompt tokens."""

    logit_rows: list[int] | None
    prompt_logprobs: PromptLogprobRows | None = None


@dataclass(frozen=True)
class StepPlan:
    """The flat inputs of one forward pass over a batch of N items and T tokens."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]: block * block_size + offset of each token's K/V
    query_start_loc: np.ndarray  # int32 [N + 1]
    context_lens: np.ndarray  # int32 [N]
    block_tables: np.ndarray  # int32 [N, W]
    query_lens: list[int]
    rows: StepRows

    @property
    def decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)


@dataclass(frozen=True)
class StepOutput:
    """A forward pass's result: float32 logits [rows, vocab] of the rows that sample (on a
    tensor-parallel rank other than 0: no columns), and the prompt tokens' log-probabilities."""

    logits: torch.Tensor
    prompt_logprobs: list[TokenLogprobs] | None = None


class StepInputs(NamedTuple):
    """A plan's inputs on the worker's device, and (on the host) the rows its LM head takes."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: StepRows


class Worker:
    """Runs plans on one model and one KV pool. Owns no scheduling state."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVStore,
        attention: AttentionBackend,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.attention = attention  # the engine's backend, passed to every forward pass
        self.device = device
        self.graphs = graphs  # CUDA graphs of decode steps, captured at start-up

    def upload(self, plan: StepPlan) -> StepInputs:
        slots, starts, contexts, tables, ids, positions = upload(
            [
                plan.slot_mapping,
                plan.query_start_loc,
                plan.context_lens,
                plan.block_tables,
                plan.input_ids,
                plan.positions,
            ],
            self.device,
        )
        context_lens = plan.context_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=starts,
            context_lens=contexts,
            block_tables=tables,
            query_lens=plan.query_lens,
            context_lens_host=context_lens,
            max_query_len=max(plan.query_lens),
            max_context_len=max(context_lens),
            decode_only=plan.decode_only,
            block_tables_host=plan.block_tables,
        )
        return StepInputs(ids, positions, meta, plan.rows)

    def execute(self, plan: StepPlan) -> StepOutput:
        """One forward pass over the plan's batch."""
        return self.forward(self.upload(plan))

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> StepOutput:
        """The logits of the inputs' rows (and the prompt tokens' log-probabilities) over inputs
        already on the device (an overlapped step uploads on the host first)."""
        input_ids, positions, meta, rows = inputs
        graphs = self.graphs
        if (
            graphs is not None
            and meta.decode_only
            and graphs.can_run(len(meta.query_lens), int(meta.block_tables.shape[1]))
        ):
            logits = graphs.run(input_ids, positions, meta)  # [B, vocab]: one row an item
            scored = self._prompt_logprobs(rows, logits=logits)
            if rows.logit_rows is not None:  # a one-token chunk that does not sample
                logits = logits.index_select(0, index_on(rows.logit_rows, logits.device))
            return StepOutput(logits, scored)
        hidden = self.model(input_ids, positions, meta, self.kv, self.attention)  # [T, H]
        scored = self._prompt_logprobs(rows, hidden=hidden)
        wanted = rows.logit_rows
        if wanted is None or len(wanted) == hidden.shape[0]:
            return StepOutput(self.model.compute_logits(hidden), scored)
        if not wanted:
            return StepOutput(hidden.new_empty((0, 0), dtype=torch.float32), scored)
        picked = hidden.index_select(0, index_on(wanted, hidden.device))
        return StepOutput(self.model.compute_logits(picked), scored)

    def _prompt_logprobs(
        self, rows: StepRows, hidden: torch.Tensor | None = None, logits: torch.Tensor | None = None
    ) -> list[TokenLogprobs] | None:
        """The prompt tokens' log-probabilities of `rows.prompt_logprobs`: from `logits` when
        the step made them for every row (a decode graph), else through the LM head over
        `hidden` [T, H], PROMPT_ROWS at a time (a [T, vocab] block of logits for a long prompt
        would take gigabytes). On a tensor-parallel rank other than 0, None (rank 0 scores)."""
        asked = rows.prompt_logprobs
        if asked is None:
            return None
        found: list[TokenLogprobs] = []
        for first in range(0, len(asked.rows), PROMPT_ROWS):
            index = index_on(asked.rows[first : first + PROMPT_ROWS], self.device)
            if logits is not None:
                chunk = logits.index_select(0, index)
            else:
                assert hidden is not None
                chunk = self.model.compute_logits(hidden.index_select(0, index))
            if chunk.shape[1] == 0:  # not rank 0: the head's collective ran, rank 0 scores
                continue
            end = first + PROMPT_ROWS
            found += logprobs_of(chunk, asked.targets[first:end], asked.widths[first:end])
        return found if found or not asked.rows else None

    def copy_slots(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        self.kv.copy_slots(src_block, dst_block, num_tokens)

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

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """This worker's share of each block's K/V, as bytes."""
        return read_blocks(self.kv, block_ids)

    def write_blocks(
        self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
    ) -> None:
        write_blocks(self.kv, block_ids, payloads)

    def weight_bytes(self) -> int:
        """The bytes of this worker's weights as they are held (packed panels included): every
        tensor a module of the model holds, each storage counted once."""
        seen: dict[int, int] = {}
        for module in self.model.modules():
            for value in vars(module).values():
                tensors = value.values() if isinstance(value, dict) else [value]
                for tensor in tensors:
                    if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                        storage = tensor.untyped_storage()
                        seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def shutdown(self) -> None:
        """Nothing to stop in this process (multiproc.py's workers stop their processes)."""

    # One worker in the engine's process is its own executor (executor.py).
    @property
    def local(self) -> Worker:
        return self

    @property
    def tensor_parallel_size(self) -> int:
        return 1

    def rank_weight_bytes(self) -> list[int]:
        """`weight_bytes` of each rank: here, one."""
        return [self.weight_bytes()]

    @property
    def shard_nbytes(self) -> list[int]:
        """One block's bytes on each rank: here, one rank."""
        kv = self.kv
        return [
            KVStore.bytes_per_block(
                kv.num_layers, kv.block_size, kv.num_kv_heads, kv.head_dim, kv.dtype
            )
        ]


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
