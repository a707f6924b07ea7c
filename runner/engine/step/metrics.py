"""Records what each engine step did, for `kvcache report` (metrics schema version 1), and
where one step's time went (`StepClock`).

Where one engine step's time went, for `kvcache report`: the model's share (the runner's
forward, inputs to logits), and within it the weight products and the attention kernels.

Only on the CPU, where each call has finished when it returns: on a GPU the forward returns
once its kernels are queued, so the split would measure launches, and nothing is recorded.
The products and attention are timed by the C code of runner/model/cpu_layers.py (two clock reads
per kernel call, well under 0.1% of a step) and the LM head by CausalLM.compute_logits; a step
that ran elsewhere (torch's operators) records only the model's share.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from kvcache import CacheStats
from runner.engine.sequence import SeqStatus, Sequence
from runner.engine.step.scheduler import SchedulerOutput
from runner.model.cpu_layers import CpuLayers
from runner.model.decoder import CausalLM


class StepTiming(NamedTuple):
    model_s: float  # the runner's forward: inputs, layers, LM head
    product_s: float | None  # weight products, the LM head's included; None: not timed
    attention_s: float | None  # attention kernels; None: not timed


class StepClock:
    """Times the forward of one step at a time: `start()` before it, `stop()` after."""

    def __init__(self, model: CausalLM, layers: CpuLayers | None, on_cpu: bool) -> None:
        self.model = model
        self.layers = layers  # the C layer stack, whose clocks say where its time went
        self.on_cpu = on_cpu
        self._t0 = 0.0
        self._c0 = (0.0, 0.0, 0.0)

    def _counters(self) -> tuple[float, float, float]:
        """(C products, C attention, LM head) seconds so far."""
        layers = self.layers
        in_c = (layers.product_s, layers.attention_s) if layers is not None else (0.0, 0.0)
        return (*in_c, self.model.head_s)

    def start(self) -> None:
        if self.on_cpu:
            self._c0 = self._counters()
            self._t0 = time.perf_counter()

    def stop(self) -> StepTiming | None:
        """The step's timing since `start()`; None off the CPU."""
        if not self.on_cpu:
            return None
        model_s = time.perf_counter() - self._t0
        products, attention, head = (b - a for a, b in zip(self._c0, self._counters(), strict=True))
        if products <= 0.0:  # the layers did not run in C: only the whole forward is known
            return StepTiming(model_s, None, None)
        return StepTiming(model_s, products + head, attention)


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
                # Where the step's time went (CPU only; runner/engine/step/metrics.py): None if
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
