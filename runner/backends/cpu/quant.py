"""Weight rounding for the CPU's packed products: bfloat16, or int8 with a scale per group.

`cpu_weight_dtype` other than float32 changes the model itself: every weight matrix (each
nn.Linear and nn.Embedding; norms and biases stay as they are) is replaced in place by its
rounded values, kept as float32, and the C kernels then store the same values in 2 bytes
(bfloat16) or 1 byte plus a scale (int8). Whatever runs the products, the panel kernel, oneDNN or
torch, computes the same model, and the reference for its greedy output is transformers'
`generate` on those same rounded weights.

int8 is symmetric, with one float32 scale per output row and group of INT8_GROUP input columns
(like llama.cpp's Q8_0, with float32 scales): q = round(w / s) in [-127, 127] with
s = max|w| / 127 over the group, and the weight the model uses is q * s, rounded once to
float32. The kernel widens q and multiplies by s exactly so, so its products equal the float32
products of these weights bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

# What the CPU's packed products may store weights as (rounded here); "bfloat16-dot" also rounds
# each product's inputs to bfloat16 (AVX512-BF16 dot products), "int8-dot" quantizes weights
# per row and each product's inputs per row to int8 (AVX512-VNNI integer dot products).
CPU_WEIGHT_DTYPES = ("float32", "bfloat16", "int8", "bfloat16-dot", "int8-dot")

INT8_GROUP = 32  # input columns per int8 scale; panel_gemm.c's INT8_GROUP

# (q [N, K] int8, scales [N, ceil(K / INT8_GROUP)] float32) of one weight matrix
Int8Weight = tuple[torch.Tensor, torch.Tensor]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric int8 of weight [N, K] float32 with a scale per row and group of columns."""
    n, k = weight.shape
    groups = -(-k // INT8_GROUP)
    grouped = _grouped(weight, groups)  # [N, groups, INT8_GROUP], zero-padded past K
    scales = grouped.abs().amax(dim=2).div_(127.0)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group
    q = torch.round(grouped / scales[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, groups * INT8_GROUP)[:, :k].contiguous(), scales.contiguous()


def quantize_int8_columns(weight: torch.Tensor) -> Int8Weight:
    """Symmetric int8 of weight [N, K] float32 with one scale per row (an output column of the
    product; "int8-dot"): q = round(w / s) in [-127, 127], s = max|w| / 127 over the row.
    scales [N, 1]."""
    scales = weight.abs().amax(dim=1, keepdim=True).div_(127.0)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row
    q = torch.round(weight / scales).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 as "int8-dot" products read it: each row quantized to int8 with its own
    scale (s = max|x| / 127, q = round(x / s) to nearest even, clamped to [-127, 127]) and
    returned as q * s, float32. runner/backends/cpu/csrc/quad_gemm.c quantizes so, to the bit;
    the reference model rounds each product's input with this."""
    scales = x.abs().amax(dim=-1, keepdim=True).div(127.0)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(x / scales).clamp_(-127, 127) * scales


def dequantize_int8(quantized: Int8Weight) -> torch.Tensor:
    """The float32 weights [N, K] that an int8 weight stands for: q * s, rounded once."""
    q, scales = quantized
    n, k = q.shape
    grouped = _grouped(q, scales.shape[1]).float() * scales[:, :, None]
    return grouped.view(n, -1)[:, :k].contiguous()


def _grouped(matrix: torch.Tensor, groups: int) -> torch.Tensor:
    """matrix [N, K] as [N, groups, INT8_GROUP]: a view when K fills the groups, else a
    zero-padded copy."""
    n, k = matrix.shape
    if k == groups * INT8_GROUP:
        return matrix.view(n, groups, INT8_GROUP)
    padded = matrix.new_zeros((n, groups * INT8_GROUP))
    padded[:, :k] = matrix
    return padded.view(n, groups, INT8_GROUP)


@torch.no_grad()
def round_matrices(model: nn.Module, dtype: str) -> dict[nn.Module, Int8Weight]:
    """Replace every float32 nn.Linear and nn.Embedding weight of `model` by its `dtype`
    ("bfloat16", "bfloat16-dot", "int8" or "int8-dot") rounding, in place, kept as float32.
    Returns the int8 form of each module's weight (empty otherwise), which the packed products
    store:
    "int8" with a scale per group of INT8_GROUP columns, "int8-dot" with one per row."""
    if dtype not in CPU_WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {CPU_WEIGHT_DTYPES}, got {dtype!r}")
    quantized: dict[nn.Module, Int8Weight] = {}
    if dtype == "float32":
        return quantized
    for module in model.modules():
        if not isinstance(module, nn.Linear | nn.Embedding):
            continue
        weight = module.weight
        if weight.dtype != torch.float32:
            continue
        if dtype.startswith("bfloat16"):  # "bfloat16-dot" stores the same rounded weights
            weight.copy_(weight.to(torch.bfloat16))
        elif dtype == "int8-dot":
            q, scales = quantized[module] = quantize_int8_columns(weight)
            weight.copy_(q.float() * scales)
        else:
            quantized[module] = quantize_int8(weight)
            weight.copy_(dequantize_int8(quantized[module]))
    return quantized
