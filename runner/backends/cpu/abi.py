"""The C interface of the CPU kernels' library (runner/backends/cpu/csrc) as ctypes sees it: each
entry point's argument and result types, and layers.c's struct step_split. ctypes converts every
Python argument by these tables, so each must follow its C prototype
(runner/backends/cpu/csrc/kernels.h and the files it names) argument for argument: a float passed
where C reads a long is garbage."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from runner.backends.cpu.split import CpuSplit

_long, _int, _float, _ptr = ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class StepSplit(ctypes.Structure):
    """layers.c's struct step_split: a step's decodes and longer queries, as pointers into the
    tensors of runner/backends/cpu/attention.py's CpuSplit (which must outlive the call)."""

    _fields_ = [
        ("num_decodes", _long),
        ("decode_rows", _ptr),
        ("decode_tables", _ptr),
        ("decode_max_blocks", _long),
        ("decode_lens", _ptr),
        ("shared_blocks", _long),
        ("num_longer", _long),
        ("longer_tables", _ptr),
        ("longer_max_blocks", _long),
        ("longer_starts", _ptr),
        ("longer_lens", _ptr),
        ("longer_contexts", _ptr),
        ("tiled_decodes", _long),
    ]


def step_split(split: CpuSplit) -> StepSplit:
    """The C view of `split`; its tensors are contiguous (CpuSplit.of makes them so)."""
    out = StepSplit()
    if split.decodes is not None:
        rows, tables, contexts = split.decodes
        out.num_decodes = rows.numel()
        out.decode_rows = rows.data_ptr()
        out.decode_tables = tables.data_ptr()
        out.decode_max_blocks = tables.shape[1]
        out.decode_lens = contexts.data_ptr()
        out.shared_blocks = split.shared_blocks
        out.tiled_decodes = split.tiled_decodes
    if split.longer is not None:
        tables, starts, lens, contexts = split.longer
        out.num_longer = lens.numel()
        out.longer_tables = tables.data_ptr()
        out.longer_max_blocks = tables.shape[1]
        out.longer_starts = starts.data_ptr()
        out.longer_lens = lens.data_ptr()
        out.longer_contexts = contexts.data_ptr()
    return out


# name: (argument types, result type), in the order of the C prototypes.
SIGNATURES: dict[str, tuple[Sequence[type], type | None]] = {
    # x, ldx, packed, weight type, y, M, K, panels
    "panel_gemm": ([_ptr, _long, _ptr, _int, _ptr, _long, _long, _long], None),
    "panel_gemm_has_pairs": ([], _long),
    "panel_gemm_has_quads": ([], _long),
    # q, caches, tables, context lengths, out; S, Hq, Hkv, D, block size, max blocks, shared
    # blocks, window (0: none); scale, soft cap (0: none); float16 caches
    "decode_attention": ([_ptr] * 6 + [_long] * 8 + [_float] * 2 + [_int], _int),
    # decode_attention's, each row summed as prefill_attention sums it (deterministic mode)
    "tiled_decode_attention": ([_ptr] * 6 + [_long] * 8 + [_float] * 2 + [_int], _int),
    # q, its token stride; caches, tables, query starts and lengths, context lengths, out; S, Hq,
    # Hkv, D, block size, max blocks, window (0: none); scale, soft cap (0: none); float16 caches
    "prefill_attention": ([_ptr, _long] + [_ptr] * 7 + [_long] * 7 + [_float] * 2 + [_int], _int),
    # x, weight, y, rows, dim, eps
    "rms_norm": ([_ptr] * 3 + [_long] * 2 + [_float], None),
    "silu_and_mul": ([_ptr] * 2 + [_long] * 2, None),
    "gelu_tanh_and_mul": ([_ptr] * 2 + [_long] * 2, None),
    # x, y, n, soft cap: the attention kernels' cap on its own (for tests)
    "soft_cap_rows": ([_ptr, _ptr, _long, _float], None),
    # Every layer of a step in one call (layers.c; runner/model/cpu_layers.py).
    "run_layers": (
        [_ptr]  # h
        + [_long] * 6  # rows, hidden, intermediate, Hq, Hkv, D
        + [_ptr, _long]  # weights, layers
        + [_ptr, _long, _long]  # KV store, elements of one layer's keys, block size
        + [ctypes.POINTER(StepSplit)]
        + [_ptr] * 4  # cos, sin, and a second table's (NULL: none)
        + [_long]  # rotary dims of a head
        # each layer's RoPE table (NULL: all the first), windows (NULL: none), slots
        + [_ptr] * 3
        + [_float] * 4  # eps, attention scale, soft cap (0: none), residual multiplier
        + [_ptr]  # scratch
        + [ctypes.POINTER(ctypes.c_double)]  # seconds in the products and in attention
        + [_int] * 3,  # weight type, float16 caches, tanh GeLU (not SiLU)
        _int,
    ),
    # rows, hidden, intermediate, Hq, Hkv, D
    "layers_scratch": ([_long] * 6, _long),
}


def declare(library: ctypes.CDLL) -> None:
    """Give every entry point of SIGNATURES its types: ctypes then converts (and checks) each
    argument, and reads results of the right width."""
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = list(argtypes)
        function.restype = restype
