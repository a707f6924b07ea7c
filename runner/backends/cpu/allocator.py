"""glibc's malloc thresholds for the CPU engine, so a step's temporaries stay in the heap.

A CPU step allocates and frees temporaries of a few to tens of MiB (gathered K/V, a prefill
chunk's activations). Above glibc's mmap threshold each one is a fresh mapping that the kernel
zeroes page by page on first touch and unmaps on free: page faults on every step. glibc raises
that threshold on its own after a big mapping is freed (up to 32 MiB), so the engine's speed
depended on what the process had happened to allocate before: 2.5x on the decode forward of a
small model, between reading the weights' files in 16 MiB chunks or in 1 MiB ones. Fixing the
thresholds makes it the same every time. They are per process, like any allocator setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap (and are reused); above it, from their own mapping.
MMAP_THRESHOLD_BYTES = 64 << 20
# Free memory at the heap's top is returned to the system only beyond this much.
TRIM_THRESHOLD_BYTES = 128 << 20


def keep_step_buffers_in_heap() -> bool:
    """Set the thresholds; False where the C library has no `mallopt` (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
