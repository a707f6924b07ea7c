"""The CPU engine's malloc thresholds: a step-sized block comes from the heap, not from a
mapping of its own (which would be faulted in afresh on every step)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from runner.backends.cpu.allocator import keep_step_buffers_in_heap


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in blocks that have a mapping of their own
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mapped_bytes_while_holding(libc: ctypes.CDLL, size: int) -> int:
    """How much the bytes in own-mapping blocks grow while a block of `size` is held."""
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    assert block
    try:
        return int(libc.mallinfo2().hblkhd - before)
    finally:
        libc.free(block)


def test_step_sized_blocks_stay_in_the_heap() -> None:
    if not keep_step_buffers_in_heap():
        pytest.skip("the C library has no mallopt (not glibc)")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc older than 2.33 has no mallinfo2")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 40 MiB is above the most glibc's own adaptive threshold reaches (32 MiB): untuned, it
    # would be mapped on its own. Above our threshold a block still is.
    assert mapped_bytes_while_holding(libc, 40 << 20) == 0
    # Above it a block still is mapped, once no free chunk of the heap can hold it: earlier
    # tests in the same process may have left one of a few hundred MiB (1 GiB is only mapped,
    # never touched).
    assert mapped_bytes_while_holding(libc, 1 << 30) >= 1 << 30
