"""Where the Triton tests run: on the CPU in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports Triton), and on a CUDA device where there is one."""

from __future__ import annotations

import pytest
import torch

from runner.backends.triton.common import interpreting

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1"),
    ),
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]
# How far a kernel's output may stand from the torch reference's, by dtype.
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
