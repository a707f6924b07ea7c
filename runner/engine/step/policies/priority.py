"""Priority scheduling (vLLM's ``scheduling_policy="priority"``): continuous batching whose
queue is ordered by each request's priority, lower first, and whose preemption takes the running
sequence of the highest priority value (the latest to arrive among equals). Among the waiting
requests of the first priority, admission stays cache-aware (admission.py), so a request never
overtakes one of a lower value, yet requests of one priority still reuse each other's prefixes.
As in vLLM, a waiting request never preempts a running one: priority decides who is admitted
next and who gives way when a decode finds the pool short."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq

from runner.engine.sequence import Sequence
from runner.engine.step.policies.continuous import ContinuousBatching
from runner.engine.step.policies.policy import SchedulerMachinery


class PriorityScheduling(ContinuousBatching):
    """Continuous batching, the queue and the preemptions ordered by (priority, arrival)."""

    def next_admission(self, m: SchedulerMachinery, inflight: set[int]) -> Sequence | None:
        first = min(seq.priority for seq in m.waiting)
        if all(seq.priority == first for seq in m.waiting):  # the usual case: one priority
            return super().next_admission(m, inflight)
        level = deque(seq for seq in m.waiting if seq.priority == first)
        return m.admission.pick(level, inflight, m.step_count)

    def victim(self, running: Seq[Sequence]) -> Sequence:
        return max(running, key=lambda seq: (seq.priority, seq.arrival_time))
