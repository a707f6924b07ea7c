"""Where one engine step's time went, for `kvcache report`: the model's share (the runner's
forward, inputs to logits), and within it the weight products and the attention kernels.

Only on the CPU, where each call has finished when it returns: on a GPU the forward returns
once its kernels are queued, so the split would measure launches, and nothing is recorded.
The products and attention are timed by the C code of runner/model/cpu_layers.py (two clock reads
per kernel call, well under 0.1% of a step) and the LM head by CausalLM.compute_logits; a step
that ran elsewhere (torch's operators) records only the model's share.
"""

from __future__ import annotations

import time
from typing import NamedTuple

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
