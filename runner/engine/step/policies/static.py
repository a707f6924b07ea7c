"""Static batching: a batch is admitted only when the last one is done, with room reserved for
each member's whole answer (so it never preempts); it decodes only once every member's prompt is
in, and a member that finishes holds its slot until every member has (a padded batch's
behaviour, the baseline continuous batching is measured against)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from runner.engine.sequence import Sequence
from runner.engine.step.policies.policy import SchedulerMachinery
from runner.engine.step.scheduled import SchedulerOutput


class StaticBatching:
    """One batch at a time: admitted whole, prefilled, then decoded to its last member's end."""

    def schedule(self, machinery: SchedulerMachinery, out: SchedulerOutput) -> None:
        self._step(machinery, out)
        m = machinery
        if out.is_empty and m.waiting and not m.running and not m.held:
            self._step(m, out)  # a preemption released the batch: the next one

    def victim(self, running: Seq[Sequence]) -> Sequence:
        return running[-1]  # reserved room makes this rare: a preemption ends the batch

    def holds_finished(self, reason: str) -> bool:
        # An aborted or failed member gives its blocks back at once.
        return reason in ("stop", "length")

    def _step(self, m: SchedulerMachinery, out: SchedulerOutput) -> None:
        if not m.running and not m.held:
            reserved = 0
            while m.waiting and len(m.running) < m.config.max_num_seqs:
                seq = m.waiting[0]
                # Reserve room for the whole answer: a static batch should never preempt.
                total = min(seq.num_prompt_tokens + seq.max_tokens, m.max_model_len)
                need = -(-total // m.bm.block_size)
                if reserved + need > m.bm.num_available_blocks():
                    break
                reserved += need
                m.admit(m.waiting.popleft(), out)
        budget = m.config.token_budget
        prefilling = [s for s in m.running if s.in_prefill]
        for seq in prefilling:
            if budget <= 0:
                break
            budget -= m.schedule_prefill_chunk(seq, budget, out)
        if prefilling:
            return  # a padded batch decodes only once every member has its prompt in
        for seq in m.running:
            if m.schedule_decode(seq, out):
                budget -= 1
        m.add_drafts(out, budget)
