"""A model readied for the CPU kernels beside its C layer stack, as the engine holds them: the
stack belongs to the "cpu" attention backend (runner/attention/backend.py), not to the model."""

from __future__ import annotations

from typing import Any, NamedTuple

from runner.attention.backend import AttentionBackend
from runner.backends.registry import attention_backend
from runner.model.cpu_layers import CpuLayers
from runner.model.cpu_prepack import prepack_for_cpu
from runner.model.decoder import CausalLM


class CpuModel(NamedTuple):
    model: CausalLM
    stack: CpuLayers | None  # what prepack_for_cpu built, None where layers.c cannot run it

    def backend(self, in_c: bool = True) -> AttentionBackend:
        """The "cpu" backend, running whole steps in C (`in_c`) or through the modules."""
        return attention_backend("cpu").with_layers(self.stack if in_c else None)


def packed(model: CausalLM, cpu_kernels: bool = True) -> CpuModel:
    """Pack `model` for the CPU kernels, as the engine does at start-up."""
    return CpuModel(model, prepack_for_cpu(model, cpu_kernels).layers)


def of_engine(llm: Any) -> CpuModel:
    """An engine's model and the C stack its backend runs."""
    return CpuModel(llm.model, llm.cpu_layers)
