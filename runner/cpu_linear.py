"""Prepacked CPU matrix products through oneDNN.

A plain `F.linear` on the CPU hands the weight to the BLAS in its stored layout, and the BLAS
repacks it into cache-friendly panels on every call. For a decode step, whose activations are
a handful of rows, that repacking costs as much as the product itself: a 16-row product over
SmolLM2's weights ran at about 8 GB/s of weight reads on a machine that streams 38 GB/s.
Packing each weight once at load time into oneDNN's blocked layout removes the repacking, which
makes decode-shaped products about 1.9x faster and prefill-shaped ones about 1.2x
(`python -m runner.cpu_linear` prints the comparison on the machine at hand).

The packed weight is an opaque oneDNN tensor: the module keeps it instead of the plain weight
(no second copy) and the model only ever calls forward().
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

# Only float32 is packed: it is the dtype whose greedy output is proven equal to transformers'
# on the CPU, and oneDNN's bf16 path needs CPU features a machine may lack.
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
    """Whether this torch build has oneDNN and the packed-linear operators."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W packed once into oneDNN's layout. x [..., in] float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
            raise ValueError(
                f"PackedLinear needs a CPU float32 weight, got {weight.dtype} on {weight.device}"
            )
        self.out_features, self.in_features = weight.shape
        bound_primitive_caches()
        # Not a parameter or buffer: an opaque oneDNN tensor has no storage to save or move.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def prepack_linears(module: nn.Module) -> int:
    """Replace every float32 CPU nn.Linear under `module` by a PackedLinear, in place.
    Returns how many were packed; 0 when oneDNN is not available (nothing changes)."""
    if not prepacking_available():
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
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    return len(targets)


def _compare(rows: int, out_features: int = 1536, in_features: int = 576, reps: int = 20) -> str:
    weight = torch.randn(out_features, in_features)
    packed = PackedLinear(weight, None)
    x = torch.randn(rows, in_features)
    timings = []
    for fn in (lambda: F.linear(x, weight), lambda: packed(x)):
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        timings.append((time.perf_counter() - start) / reps)
    return f"rows {rows:4d}: F.linear {timings[0] * 1e6:8.1f} us, packed {timings[1] * 1e6:8.1f} us"


if __name__ == "__main__":
    print(f"oneDNN packed linear available: {prepacking_available()}")
    if prepacking_available():
        for n in (1, 16, 64, 512):
            print(_compare(n))
