"""Continuous (and static) batching over a per-step token budget, with chunked prefill,
preemption by recompute, cache-aware admission (admission.py) and speculative drafts
for decoding sequences (runner/engine/step/speculative.py)."""

from __future__ import annotations

import time
from collections import abc, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache import BlockManager, Purpose
from runner.engine.config import EngineConfig
from runner.engine.kv.kv_tiers import TierLoader
from runner.engine.sequence import SeqStatus, Sequence
from runner.engine.step.admission import Admission
from runner.engine.step.segments import SegmentReuse
from runner.engine.step.speculative import draft_for


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # True when this chunk ends at the sequence's newest token: its logits pick the next token.
    sample: bool
    # K/V positions [start, start + num_new_tokens) are computed this step. Of a drafted
    # item's, `commit` caches only those whose tokens were output (the newest token and the
    # accepted guesses: StepResult.computed).
    start: int = 0
    # Guessed tokens fed after a decoding sequence's newest one (speculative.py): the
    # step computes 1 + len(draft) positions, and the engine keeps those the model agrees with.
    draft: list[int] = field(default_factory=list)
    # The sequence's block table as the block manager holds it (read only), set once the step
    # is scheduled: the model runner reads its slots from here, never from the manager.
    block_table: abc.Sequence[int] = ()

    @property
    def decodes(self) -> bool:
        return self.sample and (bool(self.draft) or self.num_new_tokens == 1)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.decodes)

    @property
    def num_decode_tokens(self) -> int:
        """Decode positions computed, drafts included."""
        return sum(1 + len(s.draft) for s in self.scheduled if s.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def without(self, gone: list[Sequence]) -> SchedulerOutput:
        """The step as it ran once these sequences failed out of it (for the step's record)."""
        ids = {id(seq) for seq in gone}
        return SchedulerOutput(
            [item for item in self.scheduled if id(item.seq) not in ids],
            [seq for seq in self.admitted if id(seq) not in ids],
            list(self.preempted),
        )


class Scheduler:
    """Owns the waiting and running queues; the block manager owns the blocks.

    Continuous mode per step: running decodes first (preempting the most recently admitted
    sequence when blocks run out), then running chunked prefills, then new admissions, all under
    `max_num_batched_tokens`. Static mode admits a batch only when the last one is done, and a
    finished member holds its slot until every member finishes.
    """

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        copy_slots: Callable[[int, int, int], None],
        tiers: TierLoader | None = None,
    ) -> None:
        self.config = config
        # Reuse of prompts' later segments (runner/engine/step/segments.py), set by the engine
        # when the prefix cache is on; None: segments run as plain tokens.
        self.segments: SegmentReuse | None = None
        self.bm = block_manager
        # Runs an Allocation's SlotCopy (src, dst, tokens) on the KV store, at once: the source
        # block may be handed out again by a later admission of the same step.
        self.copy_slots = copy_slots
        self.tiers = tiers  # the KV tiers below the pool (runner/engine/kv/kv_tiers.py), if any
        self.admission = Admission(config, block_manager)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.held: list[Sequence] = []  # static mode: finished but still in the batch
        self.step_count = 0
        self.num_preemptions = 0
        self.last_step_tokens = 0  # positions the latest step computes (vLLM's iteration tokens)
        # Told of each step's schedule before its forward runs (the soak's admission counter).
        self.listeners: list[Callable[[SchedulerOutput], None]] = []

    # ----------------------------------------------------------------- queue bookkeeping
    def add(self, seq: Sequence) -> None:
        seq.arrival_step = seq.wait_since_step = self.step_count
        self.waiting.append(seq)
        if self.tiers is not None and seq.reuses_cache:
            self.tiers.prefetch(seq.token_ids, seq.root)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is, for `reason`: out of the queue, or out of the batch
        with its blocks freed (its full blocks stay cached). A static batch's member that
        stopped or reached its length holds its slot until the batch is done; one that was
        aborted or failed gives its blocks back at once."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.waiting:
            self.waiting.remove(seq)
            return
        if seq not in self.running:
            return
        self.running.remove(seq)
        if self.config.batching == "static" and reason in ("stop", "length"):
            self.held.append(seq)
        else:
            self._free(seq)
        self._release_held()

    def _release_held(self) -> None:
        """Once no member of a static batch runs (whether the last one finished, failed, was
        aborted or preempted), the finished members held in it give back their blocks, and the
        next batch can be admitted. Nothing is ever held in continuous mode."""
        if not self.running:
            for done in self.held:
                self._free(done)
            self.held.clear()

    def _free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks, telling the block manager what its computed slots
        hold exactly, so that its partial last block can stay cached as a tail; and the
        segments a blend not run yet holds."""
        if self.segments is not None:
            self.segments.release(seq)
        self.bm.free(seq.seq_id, seq.token_ids, seq.num_exact_tokens)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free a running sequence's blocks and queue it first for re-admission.

        Its committed full blocks stay in the tree, so re-admission mostly hits the cache."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.wait_since_step = self.step_count
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.scheduled = [item for item in out.scheduled if item.seq is not seq]
        self._release_held()  # or a static batch's finished members would hold the pool for good

    # ----------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.step_count += 1
        if self.config.batching == "static":
            self._schedule_static(out)
            if out.is_empty and self.waiting and not self.running and not self.held:
                self._schedule_static(out)  # a preemption released the batch: the next one
        else:
            self._schedule_continuous(out)
        if out.is_empty and self.waiting and not self.running:
            # Every block is free or evictable now, so the head of the queue can never run.
            raise RuntimeError(
                f"request {self.waiting[0].request_id!r} does not fit in an empty KV pool of "
                f"{self.bm.num_blocks} blocks"
            )
        for item in out.scheduled:  # every allocation and growth of the step is done
            item.block_table = self.bm.block_table(item.seq.seq_id)
        self.last_step_tokens = out.num_prefill_tokens + out.num_decode_tokens
        for listener in self.listeners:
            listener(out)
        return out

    def commit(self, computed: list[tuple[ScheduledSeq, int]]) -> None:
        """After the model ran: advance each item's progress by the positions its step kept
        (runner/engine/step/settle.py) and cache every block that just filled."""
        for item, kept in computed:
            seq = item.seq
            seq.num_computed_tokens = item.start + kept
            self.bm.commit(seq.seq_id, seq.token_ids, seq.num_exact_tokens)

    def _schedule_continuous(self, out: SchedulerOutput) -> None:
        budget = self.config.token_budget
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for seq in self.running:
            (prefilling if seq.in_prefill else decoding).append(seq)
        for seq in decoding:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._reserve_decode_slot(seq, out):
                out.scheduled.append(ScheduledSeq(seq, 1, True, seq.num_computed_tokens))
                budget -= 1
        for seq in prefilling:
            if budget <= 0:
                break
            if seq.status is SeqStatus.RUNNING:  # not preempted by a decode above
                budget -= self._schedule_prefill_chunk(seq, budget, out)
        inflight: set[int] | None = None  # built only when something can be admitted
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            if inflight is None:
                inflight = self.admission.inflight_hashes(self.running)
            chosen = self.admission.pick(self.waiting, inflight, self.step_count)
            if chosen is None or not self.bm.can_allocate(
                chosen.token_ids, chosen.root, reads_cache=chosen.reuses_cache
            ):
                break
            self.waiting.remove(chosen)
            self._admit(chosen, out)
            budget -= self._schedule_prefill_chunk(chosen, budget, out)
            inflight.update(self.admission.prompt_hashes(chosen))
        self._add_drafts(out, budget)

    def _schedule_static(self, out: SchedulerOutput) -> None:
        if not self.running and not self.held:
            reserved = 0
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                # Reserve room for the whole answer: a static batch should never preempt.
                total = min(seq.num_prompt_tokens + seq.max_tokens, self.max_model_len)
                need = -(-total // self.bm.block_size)
                if reserved + need > self.bm.num_available_blocks():
                    break
                reserved += need
                self._admit(self.waiting.popleft(), out)
        budget = self.config.token_budget
        prefilling = [s for s in self.running if s.in_prefill]
        for seq in prefilling:
            if budget <= 0:
                break
            budget -= self._schedule_prefill_chunk(seq, budget, out)
        if prefilling:
            return  # a padded batch decodes only once every member has its prompt in
        for seq in self.running:
            if self._reserve_decode_slot(seq, out):
                out.scheduled.append(ScheduledSeq(seq, 1, True, seq.num_computed_tokens))
                budget -= 1
        self._add_drafts(out, budget)

    # ----------------------------------------------------------------- helpers
    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Give the step's decoding sequences guessed tokens (speculative.py) out of
        what the budget and the pool leave once every decode, prefill chunk and admission has
        its share: a guess never delays or preempts another request (its blocks may evict
        least recently used cached ones, like any growth)."""
        for item in out.scheduled:
            if budget <= 0 or not self.config.speculative_tokens:
                return
            if not item.decodes:
                continue
            seq = item.seq
            k = min(self.config.speculative_tokens, budget)
            draft = draft_for(seq, k, self.max_model_len, self.bm)  # its blocks taken
            if draft:
                item.draft, item.num_new_tokens = draft, 1 + len(draft)
                budget -= len(draft)

    def _reserve_decode_slot(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Make room for one more token, preempting the newest other sequences if needed."""
        while not self.bm.grow(seq.seq_id, seq.num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _schedule_prefill_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule the next chunk of a prefill; returns the tokens it takes from the budget.
        A prompt with a blend to run is computed up to the blend's region, the blend is run
        (at once, as a slot copy is), then the rest is computed."""
        plan = seq.blend
        if plan is not None and self.segments is not None:
            if seq.num_computed_tokens == plan.start:
                self.segments.run(seq, self.bm.block_table(seq.seq_id))
            else:  # the prompt up to the region first: a chunk that does not sample
                size = plan.start - seq.num_computed_tokens
                if self.config.enable_chunked_prefill:
                    size = min(size, budget)
                out.scheduled.append(ScheduledSeq(seq, size, False, seq.num_computed_tokens))
                return size
        remaining = seq.num_uncomputed_tokens
        size = min(remaining, budget) if self.config.enable_chunked_prefill else remaining
        start = seq.num_computed_tokens
        out.scheduled.append(ScheduledSeq(seq, size, size == remaining, start))
        return size

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> None:
        if self.tiers is not None and seq.reuses_cache:
            self.tiers.load(seq.token_ids, seq.root)
        purpose = Purpose.READMISSION if seq.admitted else Purpose.ADMISSION
        ratio = self.config.blend_ratio if seq.blend_ratio is None else seq.blend_ratio
        if self.segments is not None and seq.segments and seq.reuses_cache and ratio < 1:
            self.segments.reserve(seq, counted=not seq.admitted)
            if seq.blend is not None and not self.bm.can_allocate(seq.token_ids, seq.root):
                self.segments.release(seq)  # the held segments leave no room: plain tokens
                seq.blend, seq.exact_limit = None, None
        alloc = self.bm.allocate(
            seq.seq_id, seq.token_ids, seq.root, purpose, reads_cache=seq.reuses_cache
        )
        if alloc.copy is not None:
            self.copy_slots(*alloc.copy)
        if not seq.admitted:
            seq.num_cached_tokens = alloc.num_cached_tokens
            seq.first_scheduled_time = time.perf_counter()  # its time queued ends here
        seq.admitted = True
        seq.num_computed_tokens = alloc.num_cached_tokens
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.admitted.append(seq)
