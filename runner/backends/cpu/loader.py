"""Builds and loads the CPU kernels of runner/backends/cpu/csrc (their Python calls:
runner/backends/cpu/kernel.py).

They are plain C compiled once per machine with the system C compiler (`$CC`, else `cc`)
and `-march=native`, cached under the kvcache cache directory by a hash of its source, flags
and the CPU's feature flags (a cache shared between machines never hands one CPU another's
instructions). The library is loaded with ctypes after torch, so its OpenMP threads are torch's.

Where there is no compiler, no AVX-512 or the build fails, `load_cpu_kernels()` returns None
and callers keep torch's own paths (oneDNN products, SDPA attention); nothing else changes,
but for decode attention, which has a kernel of its own for any CPU (runner/backends/cpu/
portable.py, built here too).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from runner.backends.cpu.kernel import LANES, CpuKernels

log = logging.getLogger(__name__)


# The project's cache directory: compiled kernels here, converted GGUF models beside them.
def cache_root() -> Path:
    """$KVCACHE_CACHE_DIR, else $XDG_CACHE_HOME/kvcache, else ~/.cache/kvcache."""
    if os.environ.get("KVCACHE_CACHE_DIR"):
        return Path(os.environ["KVCACHE_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvcache"
    return Path.home() / ".cache" / "kvcache"


SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "panel_gemm.c",
        "pair_gemm.c",
        "quad_gemm.c",
        "decode_attention.c",
        "prefill_attention.c",
        "tiled_decode.c",
        "elementwise.c",
        "rope_store.c",
        "layers.c",
    )
)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def _cpu_fingerprint() -> str:
    """The CPU's feature flags (what -march=native compiles for), or its model where the flags
    cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return torch.backends.cpu.get_cpu_capability()


def library_path(cpu: str, name: str = "cpu_kernels") -> Path:
    """Where the build of library `name` for a CPU with fingerprint `cpu` is cached: one file
    per source, flags and CPU."""
    # Every file under csrc/, headers included: a changed header must rebuild the library.
    files = sorted(path for path in SOURCES[0].parent.rglob("*") if path.is_file())
    sources = b"".join(path.read_bytes() for path in files)
    digest = hashlib.sha256(sources + " ".join(FLAGS).encode() + cpu.encode())
    return cache_root() / "kernels" / f"{name}-{digest.hexdigest()[:16]}.so"


def build_library(name: str, sources: tuple[Path, ...]) -> ctypes.CDLL | None:
    """Library `name` of `sources`, built on first use (and cached by library_path) and
    loaded; None where there is no compiler or the build fails (the reason logged)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("CPU kernels skipped: no C compiler (set CC); using torch's own paths")
        return None
    target = library_path(_cpu_fingerprint(), name)
    try:
        if not target.exists():
            _build(compiler, target, sources)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        log.warning("CPU kernels %s unavailable (%s); using torch's own paths", name, detail)
        return None


def _build(compiler: str, target: Path, sources: tuple[Path, ...] = SOURCES) -> None:
    """Compile into a temporary file beside `target`, then rename: a process that loads the
    library never sees half of it, whoever builds concurrently."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, *map(str, sources), "-o", tmp, "-lm"],
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
def load_cpu_kernels() -> CpuKernels | None:
    """The kernels, built on first use; None where they cannot run here (reason logged)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        log.info("CPU kernels skipped: the CPU has no AVX-512")
        return None
    library = build_library("cpu_kernels", SOURCES)
    if library is None:
        return None
    if library.panel_gemm_lanes() != LANES:
        log.warning("CPU kernels at %s pack differently; using torch's own paths", library._name)
        return None
    return CpuKernels(library)
