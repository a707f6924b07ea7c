"""The batched sampler (runner/sampling.py): its filters against a plain per-row reference, its
inverse-CDF draw against the distribution it is given. Seeded requests' reproducibility in an
engine is tested in test_reliability.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import runner.sampling as sampling
from runner.sampling import SamplingParams, draw, filtered_probs, sample


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, the filters written out the plain way: top-k by the k-th logit, top-p over a
    full sort, min-p against the top probability. Returns normalised probabilities [vocab]."""
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.numel():
        kth = torch.sort(scaled, descending=True).values[p.top_k - 1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        ordered = torch.sort(probs, descending=True).values
        mass_before = torch.cumsum(ordered, dim=-1) - ordered
        floor = ordered[int((mass_before < p.top_p).sum()) - 1]
        probs = probs.masked_fill(probs < floor, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


row_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.05, 3.0),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 40, 500]),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1, 1e-3]),
    min_p=st.sampled_from([0.0, 0.01, 0.2, 0.9]),
)


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 300),
    params=st.lists(row_params, min_size=1, max_size=6),
    widths=st.sampled_from([(64, 1024), (2, 7), (1,)]),
    spread=st.floats(0.1, 8.0),
    seed=st.integers(0, 2**16),
)
def test_filters_match_the_per_row_reference(
    vocab: int,
    params: list[SamplingParams],
    widths: tuple[int, ...],
    spread: float,
    seed: int,
) -> None:
    """Batched rows with different settings each get their own filters; narrow nucleus widths
    make rows fall through to wider searches and to the full sort."""
    torch.manual_seed(seed)
    logits = torch.randn(len(params), vocab) * spread
    original = sampling.NUCLEUS_WIDTHS
    sampling.NUCLEUS_WIDTHS = widths
    try:
        probs = filtered_probs(logits, params)
    finally:
        sampling.NUCLEUS_WIDTHS = original
    for row, p in enumerate(params):
        expected = reference_probs(logits[row], p)
        got = probs[row] / probs[row].sum()
        assert torch.equal(got > 0, expected > 0), f"row {row}: a different set of tokens"
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    masses=st.lists(
        st.lists(
            st.sampled_from([0.0, 0.0, 1e-6, 0.01, 0.5, 1.0, 3.0]), min_size=1, max_size=40
        ).filter(lambda row: sum(row) > 0),
        min_size=1,
        max_size=5,
    ),
    u=st.floats(0.0, 1.0, exclude_max=True),
)
def test_draw_takes_the_token_whose_interval_holds_u(masses: list[list[float]], u: float) -> None:
    width = max(len(row) for row in masses)
    probs = torch.tensor([row + [0.0] * (width - len(row)) for row in masses])
    tokens = draw(probs, torch.full((len(masses),), u))
    for row, token in zip(probs, tokens.tolist(), strict=True):
        assert row[token] > 0  # a token without mass is never drawn
        cdf = torch.cumsum(row, 0) / row.sum()
        below = float(cdf[token - 1]) if token else 0.0
        # The interval [below, cdf[token]) holds u, up to float rounding of the sums.
        assert below - 1e-6 <= u and (u < float(cdf[token]) + 1e-6)


def test_draw_follows_the_distribution_on_a_grid_of_uniforms() -> None:
    """Uniforms evenly spread over [0, 1) pick each token in proportion to its mass."""
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0], [0.0, 0.0, 0.0, 2.0, 2.0]])
    grid = (torch.arange(1000) + 0.5) / 1000
    counts = torch.zeros_like(probs)
    for u in grid:
        picked = draw(probs, torch.full((2,), float(u)))
        counts[0, picked[0]] += 1
        counts[1, picked[1]] += 1
    torch.testing.assert_close(
        counts / 1000, probs / probs.sum(-1, keepdim=True), atol=2e-3, rtol=0
    )


def test_greedy_and_sampled_rows_share_a_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=1),  # top-1: sampling that must pick the argmax
        SamplingParams(temperature=0.8, top_p=1e-3),  # the nucleus is the top token alone
        SamplingParams(temperature=0),
    ]
    generators = [sampling.request_generator(p, torch.Generator().manual_seed(1)) for p in params]
    assert sample(logits, params, generators) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("seed", [0, 7])
def test_a_seeded_row_draws_the_same_whatever_shares_its_batch(seed: int) -> None:
    torch.manual_seed(seed)
    logits = torch.randn(3, 80)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    engine_rng = torch.Generator().manual_seed(0)
    alone = sample(logits[1:2], [p], [sampling.request_generator(p, engine_rng)])
    others = [SamplingParams(temperature=0.5), p, SamplingParams(temperature=0)]
    gens = [sampling.request_generator(q, engine_rng) for q in others]
    assert sample(logits, others, gens)[1] == alone[0]
