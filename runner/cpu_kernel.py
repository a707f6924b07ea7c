"""Builds and loads the panel matrix-product kernel (runner/csrc/panel_gemm.c) for the CPU.

The kernel is plain C compiled once per machine with the system C compiler (`$CC`, else `cc`)
and `-march=native`, cached under the kvcache cache directory by a hash of its source, flags
and the CPU's feature flags (a cache shared between machines never hands one CPU another's
instructions). It is loaded with ctypes after torch, so its OpenMP threads are torch's own.

Where there is no compiler, no AVX-512 or the build fails, `load_panel_gemm()` returns None
and the caller keeps oneDNN's product; nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from runner.gguf import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "panel_gemm.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LANES = 16  # output columns per panel; the library reports its own and must agree


class PanelGemm:
    """The loaded kernel: pack a weight once, then multiply float32 rows by it."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._gemm = library.panel_gemm
        self._gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
        self._gemm.restype = None

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] float32 -> panels [ceil(N / 16), K, 16], zero-padded past N."""
        n, k = weight.shape
        panels = -(-n // LANES)
        padded = weight.new_zeros((panels * LANES, k))
        padded[:n] = weight
        return padded.view(panels, LANES, k).transpose(1, 2).contiguous()

    def matmul(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        """x [..., K] float32 -> [..., n]: x @ W.T + bias for the W that `packed` came from."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            # The kernel reads raw float32 memory: anything else would be read as garbage.
            raise TypeError(f"the panel kernel takes CPU float32 rows, got {x.dtype} on {x.device}")
        k = packed.shape[1]
        m = math.prod(x.shape[:-1])
        rows = x.reshape(m, k).contiguous()
        if k == 0 or m == 0:  # an empty sum: nothing for the kernel to do
            out = torch.zeros((m, n), dtype=torch.float32)
            return (out if bias is None else out + bias).view(*x.shape[:-1], n)
        out = torch.empty((m, n), dtype=torch.float32)
        self._gemm(
            rows.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            k,
            n,
        )
        return out.view(*x.shape[:-1], n)


def _cpu_fingerprint() -> str:
    """The CPU's feature flags (what -march=native compiles for), or its model where the flags
    cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return torch.backends.cpu.get_cpu_capability()


def library_path(cpu: str) -> Path:
    """Where the build for a CPU with fingerprint `cpu` is cached: one file per source, flags
    and CPU."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + cpu.encode())
    return cache_root() / "kernels" / f"panel_gemm-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename: a process that loads the
    library never sees half of it, whoever builds concurrently."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_panel_gemm() -> PanelGemm | None:
    """The kernel, built on first use; None where it cannot run here (reason logged)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        log.info("panel kernel skipped: the CPU has no AVX-512")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("panel kernel skipped: no C compiler (set CC); using oneDNN products")
        return None
    target = library_path(_cpu_fingerprint())
    try:
        if not target.exists():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        log.warning("panel kernel unavailable (%s); using oneDNN products", detail)
        return None
    if library.panel_gemm_lanes() != LANES:
        log.warning("panel kernel at %s packs differently; using oneDNN products", target)
        return None
    return PanelGemm(library)
