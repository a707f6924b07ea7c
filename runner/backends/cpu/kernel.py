"""The CPU kernels of runner/backends/cpu/csrc as Python calls: the panel matrix product
(panel_gemm.c), decode and prefill attention over the paged cache (decode_attention.c,
prefill_attention.c), RMSNorm and the gated SiLU and tanh GeLU (elementwise.c), and all layers of a
step in one call (layers.c, driven by runner/model/cpu_layers.py). runner/backends/cpu/loader.py
builds and loads the library, runner/backends/cpu/abi.py gives ctypes its C types; each method
checks shapes and dtypes, then hands raw pointers to C.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import torch

from runner.backends.cpu.abi import declare
from runner.backends.cpu.kernel_args import (
    check_decode_status,
    decode_groups_fit,
    decode_operands,
    heads_fit,
    softcap_arg,
    window_arg,
)
from runner.backends.cpu.panels import (
    BF16_PAIRS,
    INT8_QUADS,
    LANES,
    fits,
    pack_pairs,
    pack_panels,
    pack_quads,
    weight_type,
)

# Rows of x this many floats long (2 KB) alias in the L1 cache (see panel_gemm.c).
ALIASING_FLOATS = 512
CACHE_DTYPES = (torch.float32, torch.float16)  # the attention kernels widen float16 as they read


class CpuKernels:
    """The loaded library: products against packed weights, attention, norms, activation."""

    def __init__(self, library: ctypes.CDLL) -> None:
        declare(library)  # every entry point's C types (runner/backends/cpu/abi.py)
        self._gemm = library.panel_gemm
        # Whether the library was built with AVX512-BF16, for bfloat16 pair panels.
        self.has_pairs = bool(library.panel_gemm_has_pairs())
        # Whether it was built with AVX512-VNNI, for int8 quad panels.
        self.has_quads = bool(library.panel_gemm_has_quads())
        self._decode = library.decode_attention
        self._tiled_decode = library.tiled_decode_attention
        self._prefill = library.prefill_attention
        self._rms_norm = library.rms_norm
        self._silu_and_mul = library.silu_and_mul
        self._gelu_tanh_and_mul = library.gelu_tanh_and_mul
        self._soft_cap = library.soft_cap_rows
        # Every layer of a step in one call (layers.c; runner/model/cpu_layers.py).
        self.run_layers = library.run_layers
        self.layers_scratch = library.layers_scratch

    pack = staticmethod(pack_panels)  # the layouts live in runner/backends/cpu/panels.py
    pack_pairs = staticmethod(pack_pairs)
    pack_quads = staticmethod(pack_quads)

    def matmul(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        """x [..., K] float32 -> [..., n]: x @ W.T + bias for the W that `packed` came from."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            # The kernel reads raw float32 memory: anything else would be read as garbage.
            raise TypeError(f"the panel kernel takes CPU float32 rows, got {x.dtype} on {x.device}")
        k = x.shape[-1]
        if not fits(packed, k):
            raise ValueError(f"x rows of {k} do not fit panels {tuple(packed.shape)}")
        wtype = weight_type(packed)
        if wtype == BF16_PAIRS and not self.has_pairs:
            raise ValueError("bfloat16 pair panels need a CPU with AVX512-BF16")
        if wtype == INT8_QUADS and not self.has_quads:
            raise ValueError("int8 quad panels need a CPU with AVX512-VNNI")
        m = math.prod(x.shape[:-1])
        rows = x.reshape(m, k)
        if k % ALIASING_FLOATS == 0 and m >= LANES and wtype not in (BF16_PAIRS, INT8_QUADS):
            # 16 rows 2 KB apart share one L1 set: read them from a copy 64 bytes wider. (Pair
            # and quad panels read x from a rounded copy of their own, 16 rows to a line.)
            rows = torch.empty((m, k + LANES)).narrow(1, 0, k).copy_(rows)
        elif not (rows.stride(1) == 1 and rows.stride(0) >= k):
            rows = rows.contiguous()
        if k == 0 or m == 0:  # an empty sum: nothing for the kernel to do
            out = torch.zeros((m, n), dtype=torch.float32)
            return (out if bias is None else out + bias).view(*x.shape[:-1], n)
        panels = packed.shape[0]
        # The kernel writes whole panels: rows of panels * 16 floats, trimmed to n below.
        out = torch.empty((m, panels * LANES), dtype=torch.float32)
        self._gemm(
            rows.data_ptr(), rows.stride(0), packed.data_ptr(), wtype, out.data_ptr(), m, k, panels
        )
        if panels * LANES != n:
            out = out[:, :n].contiguous()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], n)

    @staticmethod
    def decode_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether decode_attention takes these shapes: what prefill_attention takes, with at
        most 8 query heads per KV head and blocks of at most 256 tokens."""
        return CpuKernels.prefill_supported(q, k_cache) and decode_groups_fit(q, k_cache)

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        shared_blocks: int = 0,
        window: int | None = None,
        softcap: float | None = None,
        tiled: bool = False,
    ) -> torch.Tensor:
        """One query token per sequence: q [S, Hq, D]; caches [blocks, B, Hkv, D]; block_tables
        [S, max_blocks] int32; context_lens [S] int32. Returns [S, Hq, D], sequence s attending
        to its first context_lens[s] tokens through its table, or to the last `window` of them.
        With `shared_blocks`, every table starts with those same blocks and every context is
        longer: they are scored for all rows together (unless a window starts past key 0).
        A `softcap` c makes each score s = (q . k) * scale c * tanh(s / c) (None: as it is).
        `tiled`: each row summed as prefill_attention sums a prompt's row at its position
        (tiled_decode.c, deterministic mode). Check decode_supported first."""
        num_seqs, hq, d = q.shape
        _, block_size, hkv, _ = k_cache.shape
        q, tables, lens, out = decode_operands(q, k_cache, v_cache, block_tables, context_lens)
        status = (self._tiled_decode if tiled else self._decode)(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            hq,
            hkv,
            d,
            block_size,
            tables.shape[1],
            shared_blocks,
            window_arg(window),
            scale,
            softcap_arg(softcap),
            k_cache.dtype == torch.float16,
        )
        check_decode_status(status, q, k_cache)
        return out

    @staticmethod
    def prefill_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether prefill_attention takes these shapes: CPU float32 queries over float32 or
        float16 caches, head size a multiple of 16 up to 256."""
        return (
            q.dtype == torch.float32
            and k_cache.dtype in CACHE_DTYPES
            and heads_fit(q, k_cache, LANES)
        )

    def prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start: torch.Tensor,
        query_lens: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Causal attention for S sequences whose query_lens[s] new tokens are rows
        query_start[s].. of q [T, Hq, D] and the last positions of their context_lens[s]
        tokens; each reads its keys in place through its row of block_tables [S, max_blocks],
        a query at position p those after p - `window` only (None: all up to p); scores capped
        as decode_attention caps them. Writes those rows of `out` (like q, contiguous); other
        rows are left alone. Check prefill_supported first."""
        _, hq, d = q.shape
        _, block_size, hkv, _ = k_cache.shape
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
            raise ValueError("prefill_attention reads caches and writes out in place")
        if not (q.stride(2) == 1 and q.stride(1) == d and q.stride(0) >= hq * d):
            q = q.contiguous()  # the kernel takes rows of heads d apart, tokens any distance
        ints = [
            t.to(torch.int32).contiguous()
            for t in (block_tables, query_start, query_lens, context_lens)
        ]
        status = self._prefill(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            *(t.data_ptr() for t in ints),
            out.data_ptr(),
            ints[2].shape[0],
            hq,
            hkv,
            d,
            block_size,
            ints[0].shape[1],
            window_arg(window),
            scale,
            softcap_arg(softcap),
            k_cache.dtype == torch.float16,
        )
        if status != 0:
            raise ValueError(f"prefill_attention cannot take q {tuple(q.shape)}")

    @staticmethod
    def rowwise_supported(x: torch.Tensor, width: int) -> bool:
        """Whether rms_norm and the gated activations take rows of `width` floats of x (CPU
        float32)."""
        return x.dtype == torch.float32 and x.device.type == "cpu" and width % LANES == 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim, as transformers computes
        it in float32. Check rowwise_supported first."""
        dim = x.shape[-1]
        rows = x.reshape(-1, dim).contiguous()
        out = torch.empty_like(rows)
        self._rms_norm(
            rows.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(), rows.shape[0], dim, eps
        )
        return out.view(x.shape)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2I] -> [..., I]: silu(gate) * up for gate_up = [gate | up]. Check
        rowwise_supported first (with width I)."""
        return _gated(self._silu_and_mul, gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2I] -> [..., I]: gelu(gate, approximate="tanh") * up for gate_up = [gate | up],
        within one ulp of tanh of torch's (elementwise.c says where they differ). Check
        rowwise_supported first (with width I)."""
        return _gated(self._gelu_tanh_and_mul, gate_up)

    def soft_cap(self, x: torch.Tensor, softcap: float) -> torch.Tensor:
        """softcap * tanh(x / softcap) of CPU float32 x, as the attention kernels cap each score
        (their vector tanh: runner/backends/cpu/csrc/vector_exp.h). For tests and measurements."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"soft_cap takes CPU float32, got {x.dtype} on {x.device}")
        flat = x.contiguous().view(-1)
        out = torch.empty_like(flat)
        self._soft_cap(flat.data_ptr(), out.data_ptr(), flat.numel(), softcap_arg(softcap))
        return out.view(x.shape)


def _gated(kernel: Callable[..., None], gate_up: torch.Tensor) -> torch.Tensor:
    """A gated activation's kernel (elementwise.c) over the rows of gate_up [..., 2I]."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width).contiguous()
    out = rows.new_empty((rows.shape[0], width))
    kernel(rows.data_ptr(), out.data_ptr(), rows.shape[0], width)
    return out.view(*gate_up.shape[:-1], width)
