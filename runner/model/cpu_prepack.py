"""Readies a loaded model for the CPU: packed matrix products, the C kernels for the row-wise
layers (RMSNorm, the gated SiLU), and whole steps in C where the model fits them."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from runner.backends.cpu.linear import PACKED_DTYPES, PackedLinear, prepack_linears
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.cpu.quant import round_matrices
from runner.model.cpu_layers import CpuLayers
from runner.model.decoder import CausalLM
from runner.model.decoder_layers import MLP
from runner.model.layers import RMSNorm

log = logging.getLogger(__name__)


class CpuPacking(NamedTuple):
    packed: int  # matrices packed
    layers: CpuLayers | None  # the whole layer stack in C, where the model fits layers.c


def prepack_for_cpu(
    model: CausalLM,
    cpu_kernels: bool = True,
    weight_dtype: str = "float32",
    deterministic: bool = False,
) -> CpuPacking:
    """Pack every projection and the LM head once (see runner/backends/cpu/linear.py), for the panel
    kernel where it builds (and then run norms, the activation and, where the model fits, whole
    steps in the CPU kernels too), else for oneDNN. A tied head gets its own packed
    copy; the embedding keeps the plain one for lookups. With `weight_dtype` "bfloat16" or
    "int8", every weight matrix is first rounded in place (runner/backends/cpu/quant.py), and the
    panels store it in 2 bytes, or 1 and a scale per group; "bfloat16-dot" stores bfloat16 pairs and
    its products round their inputs too, "int8-dot" int8 quads whose products quantize their
    inputs to int8 (each raises ValueError where the kernels cannot). Call after
    loading the weights. Returns how many matrices were packed, and the C layer stack that the
    "cpu" attention backend runs (runner/attention/backend.py), or None; `deterministic`: a
    stack whose steps are batch-invariant (CpuLayers.batch_invariant, docs/DETERMINISM.md)."""
    kernels = load_cpu_kernels() if cpu_kernels else None
    dot = weight_dtype == "bfloat16-dot"
    if dot and (kernels is None or not kernels.has_pairs):
        raise ValueError(
            "cpu_weight_dtype='bfloat16-dot' needs the C kernels on a CPU with AVX512-BF16 "
            "(this one " + ("has no such kernels" if kernels is None else "lacks AVX512-BF16") + ")"
        )
    int8_dot = weight_dtype == "int8-dot"
    if int8_dot and (kernels is None or not kernels.has_quads):
        raise ValueError(
            "cpu_weight_dtype='int8-dot' needs the C kernels on a CPU with AVX512-VNNI "
            "(this one " + ("has no such kernels" if kernels is None else "lacks AVX512-VNNI") + ")"
        )
    int8 = round_matrices(model, weight_dtype)
    dtype = torch.bfloat16 if dot else torch.int8 if int8_dot else getattr(torch, weight_dtype)
    packed = prepack_linears(model, cpu_kernels, dtype, int8, dot, int8_dot)
    for module in model.modules():
        if isinstance(module, RMSNorm | MLP):
            module.kernels = kernels
    weight = model.embed_tokens.weight
    if packed and model.lm_head is None and weight.dtype in PACKED_DTYPES:
        tied = int8.get(model.embed_tokens)
        model.lm_head = PackedLinear(weight, None, cpu_kernels, dtype, tied, dot, int8_dot)
        packed += 1
    layers = CpuLayers.for_model(model, kernels, batch_invariant=deterministic)
    if weight_dtype != "float32" and kernels is None:
        log.warning(
            "cpu_weight_dtype=%s without the C kernels: the rounded weights are kept as float32 "
            "(same answers as with the kernels, but no faster and no smaller)",
            weight_dtype,
        )
    return CpuPacking(packed, layers)
