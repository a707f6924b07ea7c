"""Readies a loaded model for the CPU: packed matrix products, the C kernels for the row-wise
layers (RMSNorm, the gated SiLU), and whole steps in C where the model fits them."""

from __future__ import annotations

from runner.cpu_kernel_loader import load_cpu_kernels
from runner.cpu_layers import CpuLayers
from runner.cpu_linear import PACKED_DTYPES, PackedLinear, prepack_linears
from runner.layers import RMSNorm
from runner.model import MLP, CausalLM


def prepack_for_cpu(model: CausalLM, cpu_kernels: bool = True) -> int:
    """Pack every projection and the LM head once (see runner/cpu_linear.py), for the panel
    kernel where it builds (and then run norms, the activation and, where the model fits, whole
    steps in the CPU kernels too), else for oneDNN. A tied head gets its own packed
    copy; the embedding keeps the plain one for lookups. Call after loading the weights.
    Returns how many matrices were packed."""
    packed = prepack_linears(model, cpu_kernels)
    kernels = load_cpu_kernels() if cpu_kernels else None
    for module in model.modules():
        if isinstance(module, RMSNorm | MLP):
            module.kernels = kernels
    weight = model.embed_tokens.weight
    if packed and model.lm_head is None and weight.dtype in PACKED_DTYPES:
        model.lm_head = PackedLinear(weight, None, cpu_kernels)
        packed += 1
    model.cpu_layers = CpuLayers.for_model(model, kernels)
    return packed
