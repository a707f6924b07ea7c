"""The Triton kernels compile for Hopper (sm_90) and Ampere (sm_80), here, without a GPU.

The interpreter tests (tests/backends/triton/test_triton_attention.py) check what the kernels
compute; this checks that the same launches compile to a cubin for real chips and fit their shared
memory, which the interpreter never does (it accepts tile shapes and dtypes that the compiler
rejects).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from runner.backends.triton.aot import (  # noqa: E402
    SHARED_MEMORY_LIMIT,
    recorded_launches,
    step_launches,
)

ROOT = Path(__file__).resolve().parents[3]
# The default model's shape in bf16 (the CUDA default) and fp16, the benchmark's Qwen3-0.6B
# shape in bf16, and fp32 with head dim 128: the largest tiles, so the most shared memory.
CASES = {
    90: ["smollm2-135m:bfloat16", "smollm2-135m:float16", "qwen3-0.6b:bfloat16"],
    80: ["qwen3-0.6b:float32"],
}
KERNELS = {
    "store_kv_kernel",
    "rope_store_kernel",
    "prefill_kernel",
    "decode_partition_kernel",
    "decode_reduce_kernel",
    "prefix_partition_kernel",
}
# In every dtype: the fused residual-add norm and SiLU-times-up (exact math in float32).
FUSED = {"add_rms_norm_kernel", "silu_mul_kernel"}
# 16-bit cases only: in float32 a norm alone is torch's own kernel
NORM = {"rms_norm_kernel"} | FUSED


def _have_nvidia_backend() -> bool:
    """Triton with its NVIDIA compiler, and the specialisation entry point the tool mirrors the
    JIT with (Triton 3.5 and later)."""
    try:
        import triton.backends.nvidia as nvidia
        from triton._C.libtriton import native_specialize_impl  # noqa: F401
    except ImportError:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "cuobjdump").exists()


def test_step_launches_cover_every_kernel() -> None:
    launches = step_launches("smollm2-135m", torch.float32)
    names = [launch.kernel.fn.__name__.lstrip("_") for launch in launches]
    assert set(names) == KERNELS | FUSED
    in_16_bits = step_launches("smollm2-135m", torch.bfloat16)
    assert {launch.kernel.fn.__name__.lstrip("_") for launch in in_16_bits} == KERNELS | NORM
    # Three decode launches: one partition (writes the output itself), several (then a reduce),
    # and several with a shared prefix read once (its own pass, the prefix pass, the reduce).
    split = [launch.kwargs["WRITE_LSE"] for launch in launches if "WRITE_LSE" in launch.kwargs]
    assert split == [False, True, True]


def test_recorded_launches_restores_the_kernels() -> None:
    import runner.backends.triton.prefill as prefill_mod

    kernel = prefill_mod._prefill_kernel
    with recorded_launches():
        assert prefill_mod._prefill_kernel is not kernel
    assert prefill_mod._prefill_kernel is kernel


@pytest.mark.skipif(not _have_nvidia_backend(), reason="no NVIDIA backend, or a Triton before 3.5")
@pytest.mark.parametrize("arch", sorted(CASES))
def test_kernels_compile_and_fit(arch: int) -> None:
    cases = [arg for case in CASES[arch] for arg in ("--case", case)]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [
        sys.executable,
        "-m",
        "runner.backends.triton.aot",
        "--json",
        "--arch",
        str(arch),
        *cases,
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    for case in CASES[arch]:
        compiled = {r["kernel"] for r in results if r["case"] == case.replace(":", " ")}
        assert compiled == (KERNELS | FUSED if case.endswith("float32") else KERNELS | NORM), case
    for r in results:
        assert r["arch"] == arch
        assert 0 <= r["shared_bytes"] <= SHARED_MEMORY_LIMIT[arch], r
        assert 0 < r["registers"] <= 255, r


@pytest.mark.skipif(not _have_nvidia_backend(), reason="no NVIDIA backend, or a Triton before 3.5")
def test_fused_kernels_use_exact_math_in_float32() -> None:
    """Compiled for sm_80 and sm_90, the fused kernels' float32 PTX holds no approximate square
    root, division or exponential (Triton's defaults: sqrt.approx.ftz.f32, div.full.f32,
    ex2.approx.f32), while their 16-bit PTX, rounded to 16 bits afterwards, keeps the fast ones:
    which shows the PTX reader finds them."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "runner.backends.triton.aot", "--json"]
    cmd += ["--arch", "80", "--arch", "90"]
    cmd += ["--case", "smollm2-135m:float32", "--case", "smollm2-135m:bfloat16"]
    for kernel in sorted(FUSED):
        cmd += ["--kernel", kernel]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2 * 2 * len(FUSED)  # two dtypes, two chips, each kernel
    for r in results:
        if r["case"].endswith("float32"):
            assert r["approximate"] == [], r
        else:
            assert r["approximate"], r
