"""The C kernels build wherever they can run: on a CPU with AVX-512 and a C compiler a failed
build fails here, with the compiler's own message, instead of every kernel test skipping and
the engine quietly falling back to torch's slower paths. Where the CPU has AVX512-VNNI (or
AVX512-BF16), the library must offer the int8 quad (or bfloat16 pair) products too."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from runner.backends.cpu import loader as cpu_kernel_loader
from runner.backends.cpu.loader import load_cpu_kernels


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


can_build = pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512") or _compiler() is None,
    reason="no AVX-512 or no C compiler: the engine runs on torch's own paths by design",
)


@can_build
def test_the_kernels_compile_on_this_cpu(tmp_path: Path) -> None:
    """A build from scratch (not the cached library) succeeds; its error text is the failure."""
    compiler = _compiler()
    assert compiler is not None
    target = tmp_path / "cpu_kernels.so"
    try:
        cpu_kernel_loader._build(compiler, target)
    except subprocess.CalledProcessError as err:
        pytest.fail(f"the CPU kernels do not build with {compiler}:\n{err.stderr}")
    assert target.stat().st_size > 0


@can_build
def test_the_engine_loads_the_kernels_and_their_dot_products() -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None, "load_cpu_kernels() fell back to torch on an AVX-512 CPU"
    flags = _cpu_flags()
    if "avx512_vnni" in flags:
        assert kernels.has_quads, "AVX512-VNNI CPU, but the library has no int8 quad products"
    if "avx512_bf16" in flags:
        assert kernels.has_pairs, "AVX512-BF16 CPU, but the library has no bfloat16 pairs"
