"""Wall time the model spends inside its matrix products, for the bench's "decode outside
matmul" figure: the share of a decode step that is not weight products (attention, norms,
scheduling, sampling, Python).

Forward hooks time every projection and the LM head. On the CPU each product finishes before
its hook returns, so the sum is exact; on CUDA kernels run asynchronously and the figure is not
taken. The hooks cost about 2 us a product (~0.5% of a decode step of the default model). Steps
whose layers run in C (runner/model/cpu_layers.py) call no module: the C code times its products
and the sum is added here.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from runner.backends.cpu.linear import PackedLinear
from runner.model.cpu_layers import CpuLayers
from runner.model.decoder import CausalLM


class MatmulTimer:
    def __init__(self, model: CausalLM, layers: CpuLayers | None = None) -> None:
        self._hooked_s = 0.0
        self._started = 0.0
        self._layers = layers  # the engine's C layer stack, if its steps run there
        self._layers_start = self._layers.product_s if self._layers is not None else 0.0
        self._handles = [
            handle
            for module in model.modules()
            if isinstance(module, nn.Linear | PackedLinear)
            for handle in (
                module.register_forward_pre_hook(self._start),
                module.register_forward_hook(self._stop),
            )
        ]
        # A tied head that is not packed has no module of its own: time the call that uses it.
        self._model = model
        self._compute_logits = model.compute_logits
        if model.lm_head is None:
            model.compute_logits = self._timed_logits  # type: ignore[method-assign]

    @property
    def total_s(self) -> float:
        """Seconds in the products since the timer was made."""
        in_c = self._layers.product_s - self._layers_start if self._layers is not None else 0.0
        return self._hooked_s + in_c

    def _start(self, *_: object) -> None:
        self._started = time.perf_counter()

    def _stop(self, *_: object) -> None:
        self._hooked_s += time.perf_counter() - self._started

    def _timed_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._start()
        logits = self._compute_logits(hidden)
        self._stop()
        return logits

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._model.compute_logits == self._timed_logits:
            del self._model.compute_logits  # back to the class's method
