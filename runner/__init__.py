"""Everything that runs a model, one package per concern (docs/ARCHITECTURE.md has the map):
engine/ (LLM, the loop, scheduling), model/ (the decoder, loading), attention/ (the contract),
backends/ (CPU and Triton kernels), sampling/, cli/, report/, bench/. It depends on kvcache/,
never the reverse.

Without a GPU the Triton kernels (runner/backends/triton/) run, slowly, on CPU tensors in Triton's
interpreter: that is how CI tests them. Triton reads TRITON_INTERPRET when `triton` is first
imported (its own library, tl.sum and the like, is decorated then) and at each `@triton.jit`,
so it is set here, before any module of the package imports Triton. `setdefault` keeps an
explicit TRITON_INTERPRET=0/1 from the user; a program that imports Triton before this package
must set it itself.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
