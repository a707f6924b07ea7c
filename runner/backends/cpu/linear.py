"""Prepacked CPU matrix products: each float32 weight is packed once at load time.

A plain `F.linear` on the CPU hands the weight to the BLAS in its stored layout, and the BLAS
repacks it into cache-friendly panels on every call. For a decode step, whose activations are
a handful of rows, that repacking costs as much as the product itself. Packing once removes it.

Two packings, the first that this machine can run (weights as float32, or rounded to bfloat16
or int8: see `PackedLinear`):
- the panel kernel (runner/backends/cpu/kernel.py): weights as 16-column panels read front to back,
  built with the system C compiler. It streams a decode step's weights at close to the
  machine's memory bandwidth (about 1.3-1.9x oneDNN's packed product for 1-32 rows on the
  2-core EPYC this was tuned on) and matches oneDNN for prefill-sized batches;
- oneDNN's blocked layout through torch's mkldnn operators, about 1.9x `F.linear` for decode
  and 1.2x for prefill.
`python -m runner.backends.cpu.linear` prints the comparison on the machine at hand.

The packed weight replaces the plain one in the module (no second copy); the model only ever
calls forward().
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from runner.backends.cpu.kernel import CpuKernels
from runner.backends.cpu.loader import load_cpu_kernels
from runner.backends.cpu.quant import (
    Int8Weight,
    dequantize_int8,
    quantize_int8,
    quantize_int8_columns,
)

# Only float32 models are packed: the dtype whose greedy output is proven equal to transformers'
# on the CPU (oneDNN's bf16 path needs CPU features a machine may lack). Their weights may be
# stored rounded (`weight_dtype`), which is the float32 model with rounded weights.
PACKED_DTYPES = (torch.float32,)


# oneDNN and torch's ideep layer each keep the primitives they build, one per input shape, in an
# LRU of 1,024 entries by default; an entry of a packed product holds about 0.6 MB, so a server
# that meets many batch sizes grew by ~1 GB before the LRUs evicted anything (the soak saw +17%
# RSS over 10,000 requests). A step touches five weight shapes, so 64 entries keep a dozen
# batch sizes warm; a miss rebuilds a primitive in well under a millisecond.
PRIMITIVE_CACHE_ENTRIES = "64"


def bound_primitive_caches() -> None:
    """Cap both caches unless the user set them. They read these variables on their first use,
    so this must run before the process's first oneDNN product (later it changes nothing)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", PRIMITIVE_CACHE_ENTRIES)
    os.environ.setdefault("LRU_CACHE_CAPACITY", PRIMITIVE_CACHE_ENTRIES)


def prepacking_available() -> bool:
    """Whether weights can be packed here: the panel kernel builds, or torch has oneDNN."""
    return load_cpu_kernels() is not None or onednn_available()


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and the packed-linear operators."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W packed once. x [..., in] float32.

    `panel_kernel=False` packs for oneDNN even where the panel kernel runs (comparisons, tests).
    `weight_dtype=torch.bfloat16` rounds W to bfloat16, `torch.int8` quantizes it (to `int8`
    where given, else runner/backends/cpu/quant.py's quantize_int8 of W): the panel kernel then
    stores half or a quarter of the bytes and widens each weight as it reads it; oneDNN keeps the
    rounded values as float32 (the same products, no faster). `bfloat16_dot=True` stores W as
    bfloat16 pairs and rounds x to bfloat16 too (panel kernel with AVX512-BF16 only);
    `int8_dot=True` stores `int8` (one scale per row: quant.py quantize_int8_columns) as int8
    quads and quantizes x per row to int8 too (panel kernel with AVX512-VNNI only).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        panel_kernel: bool = True,
        weight_dtype: torch.dtype = torch.float32,
        int8: Int8Weight | None = None,
        bfloat16_dot: bool = False,
        int8_dot: bool = False,
    ) -> None:
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
            raise ValueError(
                f"PackedLinear needs a CPU float32 weight, got {weight.dtype} on {weight.device}"
            )
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().contiguous().clone()
        self._kernel: CpuKernels | None = load_cpu_kernels() if panel_kernel else None
        # Not a parameter or buffer: the model never saves, moves or trains a packed weight.
        if int8_dot:
            if self._kernel is None or not self._kernel.has_quads:
                raise ValueError("int8 dot products need the C kernels and AVX512-VNNI")
            self.packed = self._kernel.pack_quads(int8 or quantize_int8_columns(weight.detach()))
            return
        if weight_dtype == torch.int8 and int8 is None:
            int8 = quantize_int8(weight.detach())
        if bfloat16_dot:
            if self._kernel is None or not self._kernel.has_pairs:
                raise ValueError("bfloat16 dot products need the C kernels and AVX512-BF16")
            self.packed = self._kernel.pack_pairs(weight.detach())
            return
        if self._kernel is not None:
            self.packed = self._kernel.pack(weight.detach(), weight_dtype, int8)
            return
        if not onednn_available():
            raise RuntimeError("no packed product here: the panel kernel and oneDNN are missing")
        bound_primitive_caches()
        if int8 is not None:
            rounded = dequantize_int8(int8)
        else:
            rounded = weight.detach().to(weight_dtype).float()  # float32: the weight itself
        self.packed = torch.ops.mkldnn._reorder_linear_weight(rounded, None)

    @property
    def backend(self) -> str:
        return "panel" if self._kernel is not None else "onednn"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return self._kernel.matmul(x, self.packed, self.bias, self.out_features)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.backend}"


def prepack_linears(
    module: nn.Module,
    panel_kernel: bool = True,
    weight_dtype: torch.dtype = torch.float32,
    int8: dict[nn.Module, Int8Weight] | None = None,
    bfloat16_dot: bool = False,
    int8_dot: bool = False,
) -> int:
    """Replace every float32 CPU nn.Linear under `module` by a PackedLinear (weights stored as
    `weight_dtype`; int8 ones as `int8[linear]` where given), in place. Returns how many were
    packed; 0 when nothing can pack here (nothing changes)."""
    if not (prepacking_available() if panel_kernel else onednn_available()):
        return 0
    targets = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and child.weight.device.type == "cpu"
        and child.weight.dtype in PACKED_DTYPES
    ]
    for parent, name, child in targets:
        quantized = (int8 or {}).get(child)
        packed = PackedLinear(
            child.weight, child.bias, panel_kernel, weight_dtype, quantized, bfloat16_dot, int8_dot
        )
        setattr(parent, name, packed)
    return len(targets)


def _compare(rows: int, out_features: int = 1536, in_features: int = 576, reps: int = 20) -> str:
    weight = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features)
    products = {"F.linear": lambda: F.linear(x, weight)}
    if onednn_available():
        onednn = PackedLinear(weight, None, panel_kernel=False)
        products["oneDNN"] = lambda: onednn(x)
    if load_cpu_kernels() is not None:
        panel = PackedLinear(weight, None)
        products["panel"] = lambda: panel(x)
    timings = []
    for name, product in products.items():
        product()
        start = time.perf_counter()
        for _ in range(reps):
            product()
        timings.append(f"{name} {(time.perf_counter() - start) / reps * 1e6:8.1f} us")
    return f"rows {rows:4d}: " + ", ".join(timings)


if __name__ == "__main__":
    print(f"panel kernel: {load_cpu_kernels() is not None}, oneDNN: {onednn_available()}")
    for n in (1, 16, 64, 512):
        print(_compare(n))
