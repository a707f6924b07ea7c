"""Records what each engine step did, for `kvcache report` (metrics schema version 1)."""

from __future__ import annotations

import time
from typing import Any

from kvcache import CacheStats
from runner.engine.sequence import SeqStatus, Sequence
from runner.engine.step.clock import StepTiming
from runner.engine.step.scheduler import SchedulerOutput


class MetricsRecorder:
    """Keeps one row per step and per request. Cost per step is O(requests the step ran, held or
    left preempted), not O(queue); memory grows with every step and generated token, so
    `record=False` keeps nothing (`request_record`, pure, still times each output)."""

    def __init__(self, record: bool = True) -> None:
        self.record = record
        self.t0 = time.perf_counter()
        self.steps: list[dict[str, Any]] = []
        # A live request is its Sequence; a finished one shrinks to its report row, so a
        # long-lived engine keeps no token lists or generators of finished requests.
        self.requests: list[Sequence | dict[str, Any]] = []
        self.index: dict[int, int] = {}  # seq_id -> request index in the report
        self.prefix_keys: dict[int, str] = {}
        # Preempted requests waiting to be admitted again, by seq_id: followed from each step's
        # preempted and admitted lists, so a step costs nothing per request still queued.
        self.preempted: dict[int, Sequence] = {}

    def add_request(self, seq: Sequence, prefix_key: str) -> None:
        if not self.record:
            return
        self.index[seq.seq_id] = len(self.requests)
        self.requests.append(seq)
        self.prefix_keys[seq.seq_id] = prefix_key

    def on_finish(self, seq: Sequence) -> None:
        """Replace a finished request by its report row."""
        position = self.index.get(seq.seq_id)
        if position is not None:
            self.requests[position] = self.report_row(seq)
            self.prefix_keys.pop(seq.seq_id, None)
        self.preempted.pop(seq.seq_id, None)

    def note_preempted(self, seqs: list[Sequence]) -> None:
        """Requests that went back to the queue; each step shows them until readmitted."""
        if self.record:
            self.preempted.update((seq.seq_id, seq) for seq in seqs)

    def on_step(
        self,
        step: int,
        out: SchedulerOutput,
        held: list[Sequence],
        t_start: float,
        duration: float,
        stats: CacheStats,
        timing: StepTiming | None = None,
    ) -> None:
        if not self.record:
            return
        admitted = {s.seq_id for s in out.admitted}
        self.note_preempted(out.preempted)
        for seq_id in admitted:
            self.preempted.pop(seq_id, None)
        states: dict[str, str] = {}
        # A request waiting for its first admission is not stored per step (the report derives
        # it from arrival_step), so a big batch costs O(steps + requests), not their product.
        for seq in self.preempted.values():
            states[str(self.index[seq.seq_id])] = "preempted"
        for seq in held:
            states[str(self.index[seq.seq_id])] = "held"
        for item in out.scheduled:
            seq = item.seq
            if item.decodes and seq.output_token_ids:  # a draft's extra tokens included
                state = "decode"
            elif seq.seq_id in admitted and item.start > 0:
                state = "cached"
            else:
                state = "prefill"
            states[str(self.index[seq.seq_id])] = state
        self.steps.append(
            {
                "step": step,
                "t_start_s": t_start - self.t0,
                "duration_s": duration,
                "num_prefill_tokens": out.num_prefill_tokens,
                "num_decode_tokens": out.num_decode_tokens,
                "num_cached_tokens": sum(s.num_computed_tokens for s in out.admitted)
                if out.admitted
                else 0,
                "hit_tokens_cum": stats.hit_tokens,
                "query_tokens_cum": stats.query_tokens,
                "states": states,
                # Where the step's time went (CPU only; runner/engine/step/clock.py): None if
                # unknown.
                "model_s": timing.model_s if timing else None,
                "product_s": timing.product_s if timing else None,
                "attention_s": timing.attention_s if timing else None,
            }
        )

    def request_record(self, seq: Sequence) -> dict[str, Any]:
        """Timings of one request, in seconds from its arrival."""
        times = seq.token_times
        return {
            "arrival_time_s": seq.arrival_time - self.t0,
            "first_token_time_s": None
            if seq.first_token_time is None
            else seq.first_token_time - self.t0,
            "finish_time_s": None if seq.finish_time is None else seq.finish_time - self.t0,
            "ttft_s": None
            if seq.first_token_time is None
            else seq.first_token_time - seq.arrival_time,
            "itl_s": [b - a for a, b in zip(times, times[1:], strict=False)],
            "num_preemptions": seq.num_preemptions,
            "arrival_step": seq.arrival_step,
        }

    def report_row(self, seq: Sequence) -> dict[str, Any]:
        row = self.request_record(seq)
        row.update(
            {
                "id": seq.request_id,
                "prompt_tokens": seq.num_prompt_tokens,
                "cached_tokens": seq.num_cached_tokens,
                "reused_segment_tokens": seq.num_reused_segment_tokens,
                "output_tokens": len(seq.output_token_ids),
                "finish_reason": seq.finish_reason if seq.status is SeqStatus.FINISHED else None,
                "prefix_key": self.prefix_keys.get(seq.seq_id, ""),
                "prefix_preview": (seq.prompt_text or "")[:60],
            }
        )
        return row

    def to_dict(
        self, header: dict[str, Any], stats: CacheStats, preemptions: int
    ) -> dict[str, Any]:
        requests = [r if isinstance(r, dict) else self.report_row(r) for r in self.requests]
        return {
            "version": 1,
            **header,
            "wall_time_s": time.perf_counter() - self.t0,
            "cache": {**stats.as_dict(), "hit_rate": stats.hit_rate},
            "num_preemptions": preemptions,
            "requests": requests,
            "steps": self.steps,
        }
