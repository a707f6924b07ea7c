"""Deterministic mode's Triton kernels (runner/backends/triton/batch_invariant.py): a row's
product, and its log-softmax, the same bits whatever the rows beside it and however many. On
the CPU they run in Triton's interpreter on CPU tensors; on a GPU the same cases run there."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runner.backends.triton.batch_invariant import rows_log_softmax, rows_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(40, 24), (96, 80)])
def test_a_rows_product_is_the_same_for_1_3_and_17_rows(dtype: torch.dtype, k: int, n: int) -> None:
    torch.manual_seed(k + n)
    x = torch.randn(17, k).to(dtype).to(DEVICE)
    w = torch.randn(n, k).to(dtype).to(DEVICE)
    bias = torch.randn(n).to(dtype).to(DEVICE)
    batch = rows_matmul(x, w, bias)
    for m in (1, 3):
        for start in range(0, 17 - m + 1, 5):
            assert torch.equal(rows_matmul(x[start : start + m], w, bias), batch[start : start + m])
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(
        batch.float(),
        ref,
        rtol=2e-2 if dtype != torch.float32 else 1e-5,
        atol=1e-2 if dtype != torch.float32 else 1e-5,
    )
    three_d = rows_matmul(x.reshape(1, 17, k), w)
    assert three_d.shape == (1, 17, n) and torch.equal(three_d[0], rows_matmul(x, w))


def test_a_rows_log_softmax_is_the_same_alone_and_in_a_batch() -> None:
    torch.manual_seed(0)
    logits = (5 * torch.randn(17, 2500)).to(DEVICE)
    batch = rows_log_softmax(logits)
    for i in (0, 5, 16):
        assert torch.equal(rows_log_softmax(logits[i : i + 1]), batch[i : i + 1])
    torch.testing.assert_close(batch, torch.log_softmax(logits, dim=-1), rtol=1e-5, atol=1e-5)


def test_a_misfit_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="does not fit weight"):
        rows_matmul(torch.zeros(2, 5), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="one dtype"):
        rows_matmul(torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.float64))
