"""The scheduler's machinery, shared by every scheduling rule: the waiting and running queues,
admission and freeing, preemption by recompute, chunked prefill, speculative drafts for decoding
sequences (runner/engine/step/speculative.py) and prompts' reused segments. The rule (what is
admitted, in what order, when to decode and when to prefill) is the policy named by
`EngineConfig.batching` (runner/engine/step/policies/: continuous or static batching)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvcache import BlockManager, Purpose
from kvcache.tiers.loader import TierLoader
from runner.engine.config import EngineConfig
from runner.engine.sequence import SeqStatus, Sequence
from runner.engine.step.admission import Admission
from runner.engine.step.policies.registry import policy_for
from runner.engine.step.scheduled import ScheduledSeq, SchedulerOutput
from runner.engine.step.segments import SegmentReuse
from runner.engine.step.speculative import draft_for

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Owns the waiting and running queues; the block manager owns the blocks; the policy
    (chosen once, by `config.batching`) decides each step's work through the primitives here
    (`admit`, `schedule_decode`, `schedule_prefill_chunk`, `add_drafts`: the
    SchedulerMachinery of runner/engine/step/policies/policy.py).
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
        self.tiers = tiers  # the KV tiers below the pool (kvcache/tiers/loader.py), if any
        self.admission = Admission(config, block_manager)
        self.policy = policy_for(config.batching)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order (the policy picks whom to preempt)
        # Finished but still in the batch, as the policy says (static batching's members).
        self.held: list[Sequence] = []
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
        stopped or reached its length holds its slot until the batch is done, if the policy
        says so (static batching); one that was aborted or failed gives its blocks back at
        once."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.waiting:
            self.waiting.remove(seq)
            return
        if seq not in self.running:
            return
        self.running.remove(seq)
        if self.policy.holds_finished(reason):
            self.held.append(seq)
        else:
            self._free(seq)
        self._release_held()

    def _release_held(self) -> None:
        """Once no member of a static batch runs (whether the last one finished, failed, was
        aborted or preempted), the finished members held in it give back their blocks, and the
        next batch can be admitted. Nothing is held under a policy that holds no finished
        sequence (continuous batching)."""
        if not self.running:
            for done in self.held:
                self._free(done)
            self.held.clear()

    def _free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks, telling the block manager what its computed slots
        hold exactly, so that its partial last block can stay cached as a tail; and the
        segments a blend not run yet holds."""
        if self.segments is not None and seq.blend is not None:
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
        self.policy.schedule(self, out)
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

    def drop_cached(self) -> int:
        """Forget every cached block no request holds (after a device step failed,
        what it and the step after it cached may hold K/V never written); returns the blocks
        freed."""
        return self.bm.drop_cached()

    # ----------------------------------------------------------------- the policy's primitives
    def add_drafts(self, out: SchedulerOutput, budget: int) -> None:
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

    def schedule_decode(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Schedule one decode position of a running sequence, once the pool has room for its
        token (preempting the policy's victims if needed); False when `seq` itself was
        preempted."""
        if not self._reserve_decode_slot(seq, out):
            return False
        out.scheduled.append(ScheduledSeq(seq, 1, True, seq.num_computed_tokens))
        return True

    def _reserve_decode_slot(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Make room for one more token, preempting the policy's victims if needed."""
        while not self.bm.grow(seq.seq_id, seq.num_tokens):
            victim = self.policy.victim(self.running)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def schedule_prefill_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
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

    def admit(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Allocate a sequence's blocks (its cached prefix matched, a blend's segments held)
        and run it; the caller took it out of `waiting` and checked `bm.can_allocate`."""
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
            seq.seq_id,
            seq.token_ids,
            seq.root,
            purpose,
            reads_cache=seq.reuses_cache,
            priority=seq.cache_retention,
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
