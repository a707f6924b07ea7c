"""The CPU C kernels' own paths under a sliding window and a soft cap (the backend x feature
matrix, every backend against the dense reference: tests/attention/test_feature_matrix.py). The
cap itself, c * tanh(s / c) (Gemma 2's attention scores): the kernels' vector tanh
(runner/backends/cpu/csrc/vector_exp.h) against tanh in float64 over the whole float line, the
cap's order (divide, tanh, multiply), and the caps and windows refused before a kernel runs.
The decode kernel's shared pass asked for outright: it caps as each task does, and a window
that cuts into the shared blocks drops it. Heads the kernels cannot take go to the torch path,
window and cap with them."""

from __future__ import annotations

import math
import random

import pytest
import torch

from runner.attention.metadata import AttentionMetadata
from runner.backends.cpu.loader import load_cpu_kernels
from tests.cpu_attention_cases import Seq, backend_step, dense_reference, loaded, random_tables

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)

# Queries this many times a unit normal, at scale 1: q . k over D = 32..64 dims has a standard
# deviation of 28-40, so scores of 10-100 in magnitude, which caps of 5 and 50 bend.
Q_GAIN = 5.0
# Scores of ~50 carry ~5e-6 of float32 rounding, which the softmax passes on as relative error
# in the weights; the outputs are weighted means of unit normals.
TOLERANCE = 1e-4

# The vector tanh's error bounds, measured over every float in [1e-6, 100] (the worst: 2.37
# ulp near |x| = 0.53, where (1 - e) / (1 + e) takes over from the series; 9e-8 absolute).
TANH_MAX_ULP = 3.0
TANH_MAX_ABS = 1.2e-7


def floats_between(low: float, high: float, step: int = 1) -> torch.Tensor:
    """Every `step`-th float32 in [low, high) (both positive), by bit pattern."""
    bits = torch.tensor([low, high], dtype=torch.float32).view(torch.int32).tolist()
    return torch.arange(bits[0], bits[1], step, dtype=torch.int32).view(torch.float32)


def ulps_off(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in float32 ulps of the exact value (float64), as float64."""
    magnitude = exact.abs().float()
    ulp = (torch.nextafter(magnitude, torch.tensor(math.inf)) - magnitude).double()
    return (got.double() - exact).abs() / ulp


def test_the_vector_tanh_matches_torch_over_the_float_line() -> None:
    """soft_cap with c = 1 is the kernels' tanh alone (x / 1 and 1 * t are exact): within a few
    ulp of tanh in float64 from subnormal to saturated arguments, both signs; exactly odd."""
    kernels = loaded()
    x = torch.cat(
        [
            floats_between(1e-38, 1e-3, 997),  # tanh(x) = x to the last bit
            floats_between(1e-3, 0.3, 31),  # the series
            floats_between(0.2, 1.0, 3),  # where the series hands over
            floats_between(1.0, 9.0, 7),
            floats_between(9.0, 100.0, 101),  # saturated: exactly 1
            torch.tensor([0.0, 1e-45, 0.3, 43.5, 87.0, 1e30, 3e38]),
        ]
    )
    x = torch.cat([x, -x])
    got = kernels.soft_cap(x, 1.0)
    exact = torch.tanh(x.double())
    assert ulps_off(got, exact).max() <= TANH_MAX_ULP
    assert (got.double() - exact).abs().max() <= TANH_MAX_ABS
    # torch's own float32 tanh, to the same bounds (it is correctly rounded to ~0.5 ulp)
    assert (got - torch.tanh(x)).abs().max() <= TANH_MAX_ABS
    half = x.numel() // 2
    assert torch.equal(got[half:], -got[:half])  # the sign is the argument's
    specials = kernels.soft_cap(torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan]), 1.0)
    assert specials[:4].tolist() == [0.0, -0.0, 1.0, -1.0] and specials[4].isnan()
    assert torch.signbit(specials[1])


@pytest.mark.parametrize("softcap", [5.0, 30.0, 50.0])
def test_the_cap_is_divide_tanh_multiply(softcap: float) -> None:
    """c * tanh(s / c) against float64 over scores of -2000 .. 2000: within a few ulp of c
    (never past it), and s itself where s is far under c."""
    kernels = loaded()
    s = torch.linspace(-2000.0, 2000.0, 400_001)
    got = kernels.soft_cap(s, softcap)
    exact = softcap * torch.tanh(s.double() / softcap)
    # tanh's error, and half an ulp each from the division and the product
    torch.testing.assert_close(got.double(), exact, atol=softcap * 2.5e-7, rtol=0)
    assert got.abs().max() <= softcap
    small = s.abs() < 1e-3 * softcap
    torch.testing.assert_close(got[small], s[small], atol=0, rtol=1e-6)


@pytest.mark.parametrize("softcap", [0.0, -1.0, math.nan, math.inf, 1e-50])
def test_caps_that_are_not_positive_float32s_are_refused(softcap: float) -> None:
    """0, negative, NaN, infinite, or positive but 0 as a float32 (no cap, silently): refused
    before the kernel runs."""
    kernels = loaded()
    q, cache, one = torch.zeros(1, 2, 16), torch.zeros(2, 4, 2, 16), torch.ones(1, 1)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="soft cap"):
        kernels.decode_attention(q, cache, cache, one, lens, 1.0, softcap=softcap)
    with pytest.raises(ValueError, match="soft cap"):
        kernels.prefill_attention(q, cache, cache, one, lens - 1, lens, lens, q, 1.0, None, softcap)


def test_a_window_under_one_is_refused() -> None:
    q, cache, one = torch.zeros(1, 2, 16), torch.zeros(2, 4, 2, 16), torch.ones(1, 1)
    with pytest.raises(ValueError, match="at least 1"):
        loaded().prefill_attention(q, cache, cache, one, one[0] - 1, one[0], one[0], q, 1.0, 0)


def assert_matches(out: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), reference, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_the_shared_pass_caps_as_each_task_does(cache_dtype: torch.dtype) -> None:
    """The decode kernel asked outright with and without its shared pass (16 decodes x 2 query
    heads a KV head over 3 shared blocks): both the capped reference, far from the uncapped."""
    kernels = loaded()
    seqs: list[Seq] = [(1, 49 + 5 * s) for s in range(16)]
    gen = torch.Generator().manual_seed(11)
    tables, num_blocks = random_tables(seqs, 16, 3, random.Random(11))
    k_cache, v_cache = (torch.randn(num_blocks, 16, 2, 48, generator=gen) for _ in range(2))
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = torch.randn(len(seqs), 4, 48, generator=gen) * Q_GAIN
    meta = AttentionMetadata.build([1] * len(seqs), [ctx for _, ctx in seqs], tables, 16)
    reference = dense_reference(q, k_cache, v_cache, tables, seqs, 1.0, None, 5.0)
    for shared in (0, 3):
        out = kernels.decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, 1.0, shared, None, 5.0
        )
        assert_matches(out, reference)
    uncapped = dense_reference(q, k_cache, v_cache, tables, seqs, 1.0, None, None)
    assert (out.double() - uncapped).abs().max() > 50 * TOLERANCE


@pytest.mark.parametrize("window", [20, 70, 100, 200])
def test_the_decode_kernel_drops_a_shared_pass_a_window_cuts_into(window: int) -> None:
    """Asked for the shared pass outright: with any window starting past key 0 it reads each
    sequence's window instead; with windows reaching key 0 it may use the pass."""
    kernels = loaded()
    seqs: list[Seq] = [(1, 81 + 3 * s) for s in range(8)]
    gen = torch.Generator().manual_seed(7)
    tables, num_blocks = random_tables(seqs, 16, 5, random.Random(7))
    k_cache, v_cache = (torch.randn(num_blocks, 16, 1, 32, generator=gen) for _ in range(2))
    q = torch.randn(len(seqs), 2, 32, generator=gen)
    meta = AttentionMetadata.build([1] * len(seqs), [ctx for _, ctx in seqs], tables, 16)
    out = kernels.decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.2, 5, window
    )
    assert_matches(out, dense_reference(q, k_cache, v_cache, tables, seqs, 0.2, window))


def test_heads_the_kernels_cannot_take_go_to_the_torch_path() -> None:
    """A head size of 24 (not a multiple of 16): cpu_paged_attention hands window and cap to
    the torch path, which caps as the reference does."""
    assert not loaded().prefill_supported(torch.empty(0, 2, 24), torch.empty(0, 4, 2, 24))
    seqs: list[Seq] = [(1, 30), (9, 40)]
    step = backend_step("cpu", seqs, 4, 4, 2, 24, 11, 5.0, scale=1.0, q_gain=Q_GAIN, seed=4)
    assert_matches(step.out, step.reference(5.0))
    assert (step.out.double() - step.reference(None)).abs().max() > 50 * TOLERANCE
