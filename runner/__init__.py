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

The CPU's OpenMP threads (torch's and the C kernels', one libgomp pool) spin at the end of
every parallel region for GOMP_SPINCOUNT turns before they sleep: 300,000 by default, about
10 ms here, longer than a scheduler tick. On a busy machine a spinning thread then holds a core
that the thread it waits for needs, at each of a step's hundreds of regions. libgomp reads the
count once, when torch loads it, so it is set here, before torch is imported: 1,000 turns
(libgomp's own count for more threads than cores), tens of microseconds, which still covers
the gap between one region and the next of a step (docs/BENCHMARKS.md, "CPU threads and
precision"). An OMP_WAIT_POLICY or GOMP_SPINCOUNT of the user's is kept as it is.
"""

import os

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import torch  # noqa: E402  (after the OpenMP setting above: libgomp reads it as it loads)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
