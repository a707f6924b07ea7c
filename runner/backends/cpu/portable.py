"""Decode attention for any CPU (runner/backends/cpu/csrc/portable/decode_attention_vec.c), as a
Python call: where the AVX-512 library cannot run, the torch path (runner/backends/torch/paged.py)
hands it the step's decodes.

Why a kernel of its own: on such a machine a decode reads its context through torch's CPU flash
kernel, whose strided walk over each KV head's rows made a 2,000-token context cost 20 ms a step
in the default model's 30 layers; this reads each block once for all the heads of a sequence.
It is built with the other kernels' flags (-march=native) by runner/backends/cpu/loader.py.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from runner.backends.cpu.kernel_args import (
    check_decode_status,
    decode_groups_fit,
    decode_operands,
    heads_fit,
    window_arg,
)
from runner.backends.cpu.loader import SOURCES, build_library

PORTABLE_SOURCES = (SOURCES[0].parent / "portable" / "decode_attention_vec.c",)
WIDTH = 8  # the kernel's vector width (decode_attention_vec.c): head sizes are multiples of it

_ptr, _long, _float = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class PortableDecode:
    """The loaded library's decode attention."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._decode = library.decode_attention_vec
        # q, caches, tables, context lengths, out; S, Hq, Hkv, D, block size, max blocks,
        # window (0: none); scale
        self._decode.argtypes = [_ptr] * 6 + [_long] * 7 + [_float]
        self._decode.restype = ctypes.c_int

    @staticmethod
    def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether these shapes are the kernel's: CPU float32 queries and caches (contiguous),
        head size a multiple of 8 up to 256, at most 8 query heads per KV head, blocks of at
        most 256 tokens."""
        return (
            q.dtype == k_cache.dtype == torch.float32
            and k_cache.is_contiguous()
            and heads_fit(q, k_cache, WIDTH)
            and decode_groups_fit(q, k_cache)
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """One query token per sequence: q [S, Hq, D]; caches [blocks, B, Hkv, D]; block_tables
        [S, max_blocks]; context_lens [S]. Returns [S, Hq, D], sequence s attending to its first
        context_lens[s] keys through its table, or to the last `window` of them. Check
        supported first."""
        num_seqs, hq, d = q.shape
        _, block_size, hkv, _ = k_cache.shape
        q, tables, lens, out = decode_operands(q, k_cache, v_cache, block_tables, context_lens)
        if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
            raise ValueError("the key and value caches must have one shape and dtype")
        if tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
            raise ValueError(f"{num_seqs} queries, but tables {tuple(tables.shape)} and "
                             f"context lengths {tuple(lens.shape)}")  # fmt: skip
        status = self._decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), num_seqs, hq, hkv, d, block_size, tables.shape[1],
            window_arg(window), scale,
        )  # fmt: skip
        check_decode_status(status, q, k_cache)
        return out


@functools.cache
def load_portable_decode() -> PortableDecode | None:
    """The kernel, built on first use; None where there is no compiler or the build fails."""
    library = build_library("portable_decode", PORTABLE_SOURCES)
    return PortableDecode(library) if library is not None else None
