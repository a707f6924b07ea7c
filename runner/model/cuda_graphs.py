"""CUDA graphs of the decode step: one graph per batch size, replayed with static inputs.

A decode step of a small model is hundreds of tiny kernel launches (~10 per layer); on a fast GPU
their host-side launch cost, not the math, sets the step time. A CUDA graph records the launches
once and replays them with one call. A graph replays fixed pointers and fixed launch grids, so:

- inputs live in static buffers sized for `max_bs` rows; `run()` copies each step's tensors in;
- the decode attention grid must not follow the step's longest context (a host value that
  changes every step). The graphs are captured with `max_context_len = max_model_len`, i.e.
  ceil(max_model_len / partition_size) partitions per sequence (a sliding-window layer's grid:
  ceil(min(max_model_len, window) / partition_size)); runner/backends/triton/decode.py already
  makes a partition that starts past its sequence's context loop zero times and store nothing, and
  the reduce kernel (runner/backends/triton/decode_reduce.py) reads the partition count from the
  device `context_lens`;
- a batch of B rows runs the graph of the smallest captured size >= B; the padding rows get
  slot -1 (store_kv skips negative slots, so they write no K/V) and context_len 1 (they read
  one key of a valid block id, left over from an earlier step or 0, so their output is finite
  and is never looked at).

Shared-prefix attention (issue 39) is captured too. Each size that a group can fill (at least
the cost model's smallest group) gets a second graph whose decode reads its groups' prefixes
once, over fixed-shape plan buffers (runner/backends/triton/shared_prefix.py: PlanBuffers)
sized for the most chunks that many rows can form and prefixes as long as max_model_len.
`run()` plans on the host from the step's own host tables (meta.block_tables_host, never a
read from the device), and only where the cost model keeps a group does it fill the buffers (one
non-blocking copy from pinned memory) and replay that graph; any other step replays the plain
graph, the same kernels as before. The warm-up and capture run with an empty plan (no group:
every row reads its whole context), so the padding rows' made-up contexts never plan anything.
`num_prefix_replays` counts the steps that replayed a shared-prefix graph, and each
`step_listeners` entry is told of every step's contexts and plan (a bench's byte count).

Only the Triton attention path can be captured (the torch path builds its plan from host lists),
so the graphs always use it, whatever backend the engine chose for eager steps.
Without CUDA (tests) `capture()` records nothing and `run()` executes the same padded, fixed-grid
step eagerly, so the padding and fixed-grid logic is testable on the CPU (Triton interpreter).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runner.attention.backend import AttentionBackend
from runner.attention.metadata import AttentionMetadata
from runner.backends.triton.cascade_cost import DEFAULT_THRESHOLDS, NEVER, CascadeThresholds
from runner.backends.triton.shared_prefix import (
    PlanBuffers,
    SharedPrefixPlan,
    members_per_chunk,
    plan_decode_step,
)
from runner.kv_pool.store import KVStore
from runner.model.decoder import CausalLM

# Told of each replayed step: its rows' context lengths (the new token included) and the
# shared-prefix plan it replayed with (None: the plain graph). A bench counts the bytes the
# executed plans read from these.
StepListener = Callable[[list[int], SharedPrefixPlan | None], None]

# Beyond this many rows a decode step is long enough that launch overhead no longer matters,
# and every captured size costs start-up time and graph-pool memory.
MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 16 up to max_num_seqs (capped at 512),
    with the cap itself included so every batch the scheduler can form has a graph."""
    top = max(1, min(max_num_seqs, MAX_GRAPH_BATCH))
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def prefix_chunk_capacity(batch_size: int, members: int, min_group: int) -> int:
    """The most prefix chunks `batch_size` rows can form in groups of at least `min_group`
    members cut into chunks of `members`: sum ceil(n / members) <= rows / members + groups."""
    return max(1, min(batch_size, batch_size // members + batch_size // min_group))


def greedy_on_device(logits: torch.Tensor) -> torch.Tensor:
    """Argmax token of each row of logits [B, vocab] -> [B] int64, left on the device so that a
    step copies all its tokens to the host at once (one sync) with `.tolist()`."""
    return torch.argmax(logits, dim=-1)


class DecodeGraphs:
    """Decode-step graphs of `model` over the KV store `kv` (whose tensors must never move)."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVStore,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device | str,
        batch_sizes: list[int] | None = None,
        cascade: CascadeThresholds = DEFAULT_THRESHOLDS,
    ) -> None:
        # Imported here: Triton's import is slow, and a CPU engine builds no graphs.
        from runner.backends.triton.attention import triton_backend

        self.model = model
        self.attention = triton_backend(NEVER)  # the plain graphs: no shared prefix
        self.kv = kv
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda"
        self.batch_sizes = sorted(batch_sizes or graph_batch_sizes(max_num_seqs))
        self.max_bs = self.batch_sizes[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        dev = self.device
        # Static inputs; row i of a step goes to row i, rows past the batch are padding.
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)  # [max_bs]
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)  # [max_bs]
        self.slot_mapping = torch.full((self.max_bs,), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)  # [max_bs]
        # [max_bs, max_blocks_per_seq]; columns past a step's table width keep stale (valid)
        # ids that the kernel never reads: it stops at each row's context length.
        self.block_tables = torch.zeros(
            (self.max_bs, self.max_blocks_per_seq), dtype=torch.int32, device=dev
        )
        self.query_start_loc = torch.arange(self.max_bs + 1, dtype=torch.int32, device=dev)
        # One logits buffer [max_bs, vocab] float32 shared by every graph (a graph writes its
        # first bs rows): one vocab-sized buffer instead of one per captured size.
        self.logits = torch.zeros((self.max_bs, model.vocab_size), dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Shared-prefix graphs, at each size a group the cost model keeps can fill.
        self.cascade = cascade
        self.num_q_heads = int(model.config.num_attention_heads)
        self.members = members_per_chunk(self.num_q_heads // kv.num_kv_heads, kv.dtype)
        min_group = max(2, cascade.min_group_size)
        planning = cascade.min_prefix_tokens < max_model_len and self.max_bs >= min_group
        self.plans: dict[int, PlanBuffers] = {
            bs: PlanBuffers(
                bs,
                self.members,
                prefix_chunk_capacity(bs, self.members, min_group),
                self.max_blocks_per_seq,
                block_size,
                dev,
            )
            for bs in self.batch_sizes
            if planning and bs >= min_group
        }
        self.prefix_attention: dict[int, AttentionBackend] = {
            bs: triton_backend(NEVER, shared_prefix=buffers.plan)
            for bs, buffers in self.plans.items()
        }
        self.prefix_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captured = False
        # Steps run through run(): lets tests and the bench tell "captured" from "used".
        self.num_replays = 0
        self.num_prefix_replays = 0  # of those, steps that read shared prefixes once
        self.last_plan: SharedPrefixPlan | None = None  # the last step's plan (None: plain)
        self.step_listeners: list[StepListener] = []

    def _meta(self, bs: int) -> AttentionMetadata:
        """Metadata over the first bs static rows, with the fixed (max_model_len) decode grid."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
            query_lens=[1] * bs,
            context_lens_host=[self.max_model_len] * bs,
            max_query_len=1,
            max_context_len=self.max_model_len,
            decode_only=True,
        )

    def _step(self, bs: int, prefix: bool = False) -> None:
        """The decode step over the first bs static rows, reading shared prefixes by the size's
        plan buffers when `prefix`; writes self.logits[:bs]."""
        attention = self.prefix_attention[bs] if prefix else self.attention
        hidden = self.model(
            self.input_ids[:bs], self.positions[:bs], self._meta(bs), self.kv, attention
        )
        self.logits[:bs].copy_(self.model.compute_logits(hidden))  # [bs, vocab]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first, all in one memory pool: a smaller
        graph reuses the larger ones' scratch memory (only one graph replays at a time)."""
        if not self.use_graphs:
            self.captured = True  # CPU: run() executes the same step eagerly
            return
        # Padding values everywhere: warm-up and capture must not write K/V.
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.batch_sizes):
            # The plain graph, then (where a group fits) the shared-prefix one over its empty
            # plan buffers: each warm-up compiles the kernels and sets up cuBLAS off-graph.
            for prefix, graphs in ((False, self.graphs), (True, self.prefix_graphs)):
                if prefix and bs not in self.plans:
                    continue
                self._step(bs, prefix)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._step(bs, prefix)
                graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.captured = True

    def can_run(self, batch_size: int, max_blocks: int) -> bool:
        """Whether a decode step of batch_size rows whose block tables are max_blocks wide fits
        a captured graph."""
        return (
            self.captured
            and 0 < batch_size <= self.max_bs
            and max_blocks <= self.max_blocks_per_seq
        )

    def graph_size(self, batch_size: int) -> int:
        """The captured size a batch of batch_size rows runs in (smallest >= batch_size)."""
        return next(s for s in self.batch_sizes if s >= batch_size)

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the decode step for input_ids [B] / positions [B] (on the device) and a
        decode-only `meta` (context_lens [B], block_tables [B, W], slot_mapping [B]).

        Returns logits [B, vocab] float32: a view of the shared static buffer, valid until
        the next run(), so sample from it (or copy it) before the next step."""
        bs = int(input_ids.shape[0])
        width = int(meta.block_tables.shape[1])
        if not meta.decode_only or not self.can_run(bs, width):
            raise ValueError(f"no decode graph for {bs} rows with block tables {width} wide")
        size = self.graph_size(bs)
        # Device-to-device copies, queued on the stream before the replay: no host sync.
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.slot_mapping[:bs].copy_(meta.slot_mapping, non_blocking=True)
        self.context_lens[:bs].copy_(meta.context_lens, non_blocking=True)
        self.block_tables[:bs, :width].copy_(meta.block_tables, non_blocking=True)
        if size > bs:  # padding rows: write no K/V, attend to one key
            self.slot_mapping[bs:size].fill_(-1)
            self.context_lens[bs:size].fill_(1)
        plan = self._plan(size, meta)
        self.last_plan = None if plan is None else self.plans[size].fill(plan)
        prefix = plan is not None
        if self.use_graphs:
            (self.prefix_graphs if prefix else self.graphs)[size].replay()
        else:
            self._step(size, prefix)
        self.num_replays += 1
        self.num_prefix_replays += prefix
        for listener in self.step_listeners:
            listener(meta.context_lens_host, self.last_plan)
        return self.logits[:bs]

    def _plan(self, size: int, meta: AttentionMetadata) -> SharedPrefixPlan | None:
        """The step's shared-prefix plan on the host, from its host block tables, where the
        cost model keeps a group and the plan fits the size's buffers; else None (plain)."""
        buffers = self.plans.get(size)
        if buffers is None or meta.block_tables_host is None:
            return None
        plan = plan_decode_step(
            torch.from_numpy(meta.block_tables_host),
            meta.context_lens_host,
            self.block_size,
            self.num_q_heads,
            self.kv.num_kv_heads,
            self.kv.head_dim,
            self.kv.dtype,
            "cpu",
            self.cascade,
        )
        return plan if plan is not None and buffers.fits(plan) else None
