"""Deterministic mode's Triton kernels (batch_invariant.py, batch_invariant_attention.py)
compile for Hopper (sm_90) here, without a GPU, in their GPU form (tl.dot on tensor cores,
which the interpreter tests replace by tl.sum), for Qwen3-0.6B's shapes in bfloat16 and
float32, and fit its shared memory. A subprocess with TRITON_INTERPRET=0 records the wrappers'
launches on CPU tensors and compiles each (runner/backends/triton/aot.py compile_launch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

RECORD_AND_COMPILE = """
import json, torch
from runner.attention.metadata import AttentionMetadata
from runner.backends.triton import batch_invariant as bi, batch_invariant_attention as bia
from runner.backends.triton.aot import Launch, compile_launch

launches = []


class Record:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append(Launch(self.kernel, args, kwargs))


bi._rows_matmul_kernel = Record(bi._rows_matmul_kernel)
bia._split_kernel = Record(bia._split_kernel)
bia._merge_kernel = Record(bia._merge_kernel)
for dtype in (torch.bfloat16, torch.float32):
    x, w = torch.zeros(7, 1024, dtype=dtype), torch.zeros(3072, 1024, dtype=dtype)
    bi.rows_matmul(x, w, torch.zeros(3072, dtype=dtype))
    q = torch.zeros(7, 16, 128, dtype=dtype)
    cache = torch.zeros(8, 16, 8, 128, dtype=dtype)
    meta = AttentionMetadata.build([5, 2], [40, 300], [[0, 1, 2], list(range(8)) * 3], 16)
    bia.batch_invariant_attention(q, cache, cache, meta, 0.1, window=64, softcap=30.0)
    bia.batch_invariant_attention(q, cache, cache, meta, 0.1)
for launch in launches:
    done = compile_launch(launch, 90, "deterministic")
    print(json.dumps({"kernel": done.kernel, "shared": done.shared_bytes, "fits": done.fits()}))
"""


def have_nvidia_backend() -> bool:
    """Triton with its NVIDIA compiler and the specialisation entry point aot.py mirrors the JIT
    with (Triton 3.5 and later)."""
    try:
        import triton.backends.nvidia as nvidia
        from triton._C.libtriton import native_specialize_impl  # noqa: F401
    except ImportError:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "cuobjdump").exists()


@pytest.mark.skipif(not have_nvidia_backend(), reason="no NVIDIA backend, or a Triton before 3.5")
def test_the_deterministic_kernels_compile_for_hopper() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-c", RECORD_AND_COMPILE]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 10  # per dtype: the product, and two attention calls of two kernels
    assert {r["kernel"] for r in results} == {"rows_matmul_kernel", "split_kernel", "merge_kernel"}
    assert all(r["fits"] for r in results), results
