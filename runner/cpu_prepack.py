"""Readies a loaded model for the CPU: packed matrix products, the C kernels for the row-wise
layers (RMSNorm, the gated SiLU), and whole steps in C where the model fits them."""

from __future__ import annotations

import torch
from torch import nn

from runner.cpu_kernel_loader import load_cpu_kernels
from runner.cpu_layers import CpuLayers
from runner.cpu_linear import PACKED_DTYPES, PackedLinear, prepack_linears
from runner.layers import RMSNorm
from runner.model import MLP, CausalLM


def prepack_for_cpu(
    model: CausalLM, cpu_kernels: bool = True, weight_dtype: torch.dtype = torch.float32
) -> int:
    """Pack every projection and the LM head once (see runner/cpu_linear.py), for the panel
    kernel where it builds (and then run norms, the activation and, where the model fits, whole
    steps in the CPU kernels too), else for oneDNN. A tied head gets its own packed
    copy; the embedding keeps the plain one for lookups. With `weight_dtype=torch.bfloat16`
    every weight matrix is first rounded to bfloat16 in place (see `round_matrices`), and the
    panels store it in 2 bytes. Call after loading the weights. Returns how many matrices were
    packed."""
    if weight_dtype == torch.bfloat16:
        round_matrices(model, weight_dtype)
    packed = prepack_linears(model, cpu_kernels, weight_dtype)
    kernels = load_cpu_kernels() if cpu_kernels else None
    for module in model.modules():
        if isinstance(module, RMSNorm | MLP):
            module.kernels = kernels
    weight = model.embed_tokens.weight
    if packed and model.lm_head is None and weight.dtype in PACKED_DTYPES:
        model.lm_head = PackedLinear(weight, None, cpu_kernels, weight_dtype)
        packed += 1
    model.cpu_layers = CpuLayers.for_model(model, kernels)
    return packed


@torch.no_grad()
def round_matrices(model: nn.Module, dtype: torch.dtype) -> int:
    """Round every float32 nn.Linear and nn.Embedding weight to `dtype` in place (kept as
    float32). The model then is exactly the one a `dtype` checkpoint would give, whatever runs
    its products: the panel kernel's 2-byte panels, oneDNN, or torch. Norms and biases stay as
    they are. Returns how many matrices were rounded."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding) and module.weight.dtype == torch.float32:
            module.weight.copy_(module.weight.to(dtype))
            count += 1
    return count
