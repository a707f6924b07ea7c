"""The panel layout that runner/backends/cpu/csrc/panel_gemm.c reads: weights packed once, at load
time.

W [N, K] becomes panels [ceil(N / 16), K, 16]: panel p holds output columns 16p .. 16p + 15, one
row of 16 weights per k, zero-padded past N, so a product streams each panel front to back.
float32, bfloat16 (rounded to nearest even, as torch rounds) or int8 weights, an int8 panel's K
rows followed by its scales (runner/backends/cpu/quant.py). Bfloat16 pairs, for products that round
x too (`cpu_weight_dtype="bfloat16-dot"`), hold each column's weights of k and k + 1 side by side:
[ceil(N / 16), ceil(K / 2), 16, 2]. Int8 quads, for products that quantize x too
(`cpu_weight_dtype="int8-dot"`), hold four k of each column side by side, then the columns'
scales and offsets: [ceil(N / 16), ceil(K / 4) + 2, 16, 4] int8. Pairs and quads are the panels
with four dimensions.
"""

from __future__ import annotations

import torch

from runner.backends.cpu.quant import INT8_GROUP, Int8Weight

LANES = 16  # floats per vector: panel width, and the unit of a head size
# What a panel can hold, and panel_gemm.c's code for it: float32 weights, bfloat16 ones widened
# as they are read, or int8 ones with a float32 scale per column and group of INT8_GROUP rows.
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
BF16_PAIRS = 3  # panel_gemm.c's WEIGHTS_BF16_PAIRS: bfloat16 pairs, x rounded to bfloat16 too
INT8_QUADS = 4  # panel_gemm.c's WEIGHTS_INT8_QUADS: int8 quads, x quantized to int8 too
QUAD_TAIL = 2  # rows of 64 bytes after a quad panel's weights: its scales, then its offsets


def weight_type(packed: torch.Tensor) -> int:
    """panel_gemm.c's code for what `packed` holds (pair and quad panels have four dimensions)."""
    if packed.dim() == 4:
        return INT8_QUADS if packed.dtype == torch.int8 else BF16_PAIRS
    return WEIGHT_TYPES[packed.dtype]


def fits(packed: torch.Tensor, k: int) -> bool:
    """Whether `packed` takes rows of k inputs."""
    if packed.dim() == 4 and packed.dtype == torch.int8:
        return packed.shape[1] == -(-k // 4) + QUAD_TAIL
    if packed.dim() == 4:
        return packed.shape[1] == -(-k // 2)
    return packed.shape[1] == panel_rows(k, packed.dtype)


def panel_rows(k: int, dtype: torch.dtype) -> int:
    """Rows of 16 in a panel of K weights of `dtype` (int8: 4 more per group, its scales)."""
    return k + 4 * -(-k // INT8_GROUP) if dtype == torch.int8 else k


def pack_panels(
    weight: torch.Tensor, dtype: torch.dtype = torch.float32, int8: Int8Weight | None = None
) -> torch.Tensor:
    """weight [N, K] float32 -> panels [ceil(N / 16), K, 16] of `dtype` (float32, or
    bfloat16 rounded to nearest even as torch rounds), zero-padded past N. For int8, `int8` is
    the weight's quantized form (runner/backends/cpu/quant.py) and each panel's K rows of 16 bytes
    are followed by its scales [ceil(K / 32), 16] float32, as 4 rows of 16 bytes per group:
    [panels, K + 4 * groups, 16] int8."""
    if dtype not in WEIGHT_TYPES:
        raise ValueError(f"panels hold float32, bfloat16 or int8 weights, not {dtype}")
    if dtype == torch.int8:
        if int8 is None:
            raise ValueError("int8 panels need the quantized weight (cpu_quant.quantize_int8)")
        return _pack_int8(int8)
    n, k = weight.shape
    panels = -(-n // LANES)
    padded = weight
    if n % LANES:  # only a ragged last panel needs a zero-padded copy
        padded = weight.new_zeros((panels * LANES, k))
        padded[:n] = weight
    return padded.reshape(panels, LANES, k).transpose(1, 2).to(dtype).contiguous()


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> bfloat16 pair panels [ceil(N / 16), ceil(K / 2), 16, 2] (rounded
    to nearest even), zero-padded past N and to an even K."""
    n, k = weight.shape
    panels, pairs = -(-n // LANES), -(-k // 2)
    padded = weight.new_zeros((panels * LANES, 2 * pairs))
    padded[:n, :k] = weight
    grouped = padded.reshape(panels, LANES, pairs, 2).transpose(1, 2)  # [P, pairs, 16, 2]
    return grouped.to(torch.bfloat16).contiguous()


def pack_quads(int8: Int8Weight) -> torch.Tensor:
    """An int8 weight with one scale per row (q [N, K], scales [N, 1]: quant.py
    quantize_int8_columns) -> quad panels [ceil(N / 16), ceil(K / 4) + 2, 16, 4] int8: each
    column's q of k .. k + 3 side by side, zero-padded past N and to a multiple of 4 in K, then
    the 16 columns' scales (float32) and offsets (int32: 128 * the column's sum of q, which
    quad_gemm.c subtracts for x's +128)."""
    q, scales = int8
    n, k = q.shape
    if scales.shape != (n, 1):
        raise ValueError(f"quad panels take one scale per row, got scales {tuple(scales.shape)}")
    panels, quads = -(-n // LANES), -(-k // 4)
    rows = q.new_zeros((panels * LANES, 4 * quads))
    rows[:n, :k] = q
    weights = rows.reshape(panels, LANES, quads, 4).transpose(1, 2)  # [P, quads, 16, 4]
    col_scales = scales.new_ones(panels * LANES)  # padding columns: q 0, scale 1
    col_scales[:n] = scales[:, 0]
    offsets = (rows.to(torch.int32).sum(dim=1) * 128).to(torch.int32)
    tail = torch.stack([col_scales.view(torch.int32), offsets], dim=0)  # [2, P * 16] 4 bytes
    tail = tail.view(2, panels, LANES).transpose(0, 1).contiguous().view(torch.int8)
    return torch.cat([weights, tail.view(panels, QUAD_TAIL, LANES, 4)], dim=1).contiguous()


def _pack_int8(int8: Int8Weight) -> torch.Tensor:
    q, scales = int8
    n, k = q.shape
    panels, groups = -(-n // LANES), scales.shape[1]
    q_rows = q.new_zeros((panels * LANES, k))
    q_rows[:n] = q
    s_rows = scales.new_ones((panels * LANES, groups))  # padding columns: q 0, scale 1
    s_rows[:n] = scales
    q_panels = q_rows.reshape(panels, LANES, k).transpose(1, 2)  # [P, K, 16]
    s_panels = s_rows.reshape(panels, LANES, groups).transpose(1, 2).contiguous()
    s_bytes = s_panels.view(torch.int8).reshape(panels, 4 * groups, LANES)  # [P, G, 16] f32
    return torch.cat([q_panels, s_bytes], dim=1).contiguous()
