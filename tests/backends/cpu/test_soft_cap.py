"""The CPU kernels' soft cap, c * tanh(s / c) (Gemma 2's attention scores): their vector tanh
(runner/backends/cpu/csrc/vector_exp.h) against tanh in float64 over the whole float line, the
cap's order (divide, tanh, multiply), and the caps refused before a kernel runs."""

from __future__ import annotations

import math

import pytest
import torch
from cpu_attention_cases import loaded

from runner.backends.cpu.loader import load_cpu_kernels

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)

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
