"""Continuous batching: every step decodes the running sequences first, then runs the running
prompts' next chunks, then admits waiting requests (cache-aware order: admission.py) into what
is left of the token budget, so a request joins the batch as soon as there is room."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from runner.engine.sequence import SeqStatus, Sequence
from runner.engine.step.policies.policy import SchedulerMachinery
from runner.engine.step.scheduled import SchedulerOutput


class ContinuousBatching:
    """Decodes, then prefill chunks, then admissions, all under the step's token budget; a
    decode that finds the pool short preempts the policy's `victim`, the most recently admitted
    sequence."""

    def schedule(self, machinery: SchedulerMachinery, out: SchedulerOutput) -> None:
        m = machinery
        budget = m.config.token_budget
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for seq in m.running:
            (prefilling if seq.in_prefill else decoding).append(seq)
        for seq in decoding:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if m.schedule_decode(seq, out):
                budget -= 1
        for seq in prefilling:
            if budget <= 0:
                break
            if seq.status is SeqStatus.RUNNING:  # not preempted by a decode above
                budget -= m.schedule_prefill_chunk(seq, budget, out)
        inflight: set[int] | None = None  # built only when something can be admitted
        while budget > 0 and m.waiting and len(m.running) < m.config.max_num_seqs:
            if inflight is None:
                inflight = m.admission.inflight_hashes(m.running)
            chosen = self.next_admission(m, inflight)
            if chosen is None or not m.bm.can_allocate(
                chosen.token_ids, chosen.root, reads_cache=chosen.reuses_cache
            ):
                break
            m.waiting.remove(chosen)
            m.admit(chosen, out)
            budget -= m.schedule_prefill_chunk(chosen, budget, out)
            inflight.update(m.admission.prompt_hashes(chosen))
        m.add_drafts(out, budget)

    def next_admission(self, m: SchedulerMachinery, inflight: set[int]) -> Sequence | None:
        """The waiting request to admit next: cache-aware order (admission.py)."""
        return m.admission.pick(m.waiting, inflight, m.step_count)

    def victim(self, running: Seq[Sequence]) -> Sequence:
        return running[-1]  # the most recently admitted

    def holds_finished(self, reason: str) -> bool:
        return False  # a finished sequence's slot goes to the next request at once
