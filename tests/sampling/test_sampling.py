"""The batched sampler (runner/sampling/sampler.py): its filters against a plain per-row reference,
its inverse-CDF draws against the distribution they are given (the candidate path against the dense
filters: test_sampling_candidates.py). Seeded requests' reproducibility in an engine is tested in
test_reliability.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import runner.sampling.sampler as sampling
from runner.sampling.params import SamplingParams
from runner.sampling.sampler import dense_probs, draw, draw_dense, filtered_probs, sample, walk

# The draws over rows of unnormalised mass: the one-pass walk (compact rows, and the draw of old),
# and the two-level one over whole-vocabulary rows.
DRAWS = {"walk": walk, "draw_dense": draw_dense}


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
    """Batched rows with different settings each get their own filters, on candidates and on
    the dense path alike; narrow nucleus widths make rows fall through to wider searches and to
    the full sort."""
    torch.manual_seed(seed)
    logits = torch.randn(len(params), vocab) * spread
    original = sampling.NUCLEUS_WIDTHS
    sampling.NUCLEUS_WIDTHS = widths
    try:
        both = [filtered_probs(logits, params).to_dense(), dense_probs(logits, params)]
    finally:
        sampling.NUCLEUS_WIDTHS = original
    for probs in both:
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
    method=st.sampled_from(sorted(DRAWS)),
    block=st.sampled_from([256, 3, 1]),
)
def test_draw_takes_the_token_whose_interval_holds_u(
    masses: list[list[float]], u: float, method: str, block: int
) -> None:
    """Either draw, the two-level one with blocks narrower than a row too (a partial last one)."""
    width = max(len(row) for row in masses)
    probs = torch.tensor([row + [0.0] * (width - len(row)) for row in masses])
    original = sampling.DRAW_BLOCK
    sampling.DRAW_BLOCK = block
    try:
        tokens = DRAWS[method](probs, torch.full((len(masses),), u))
    finally:
        sampling.DRAW_BLOCK = original
    for row, token in zip(probs, tokens.tolist(), strict=True):
        assert row[token] > 0  # a token without mass is never drawn
        cdf = torch.cumsum(row, 0) / row.sum()
        below = float(cdf[token - 1]) if token else 0.0
        # The interval [below, cdf[token]) holds u, up to float rounding of the sums.
        assert below - 1e-6 <= u and (u < float(cdf[token]) + 1e-6)


@pytest.mark.parametrize("method", sorted(DRAWS))
def test_draw_follows_the_distribution_on_a_grid_of_uniforms(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uniforms evenly spread over [0, 1) pick each token in proportion to its mass."""
    monkeypatch.setattr(sampling, "DRAW_BLOCK", 2)  # blocks [0, 1], [2, 3], [4]
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0], [0.0, 0.0, 0.0, 2.0, 2.0]])
    grid = (torch.arange(1000) + 0.5) / 1000
    counts = torch.zeros_like(probs)
    for u in grid:
        picked = DRAWS[method](probs, torch.full((2,), float(u)))
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


def nucleus_floor(
    probs: torch.Tensor, top_p: torch.Tensor, widths: tuple[int, ...]
) -> torch.Tensor:
    """sampling._nucleus_floor with the search widths set to `widths` (() is the full sort)."""
    original = sampling.NUCLEUS_WIDTHS
    sampling.NUCLEUS_WIDTHS = widths
    try:
        return sampling._nucleus_floor(probs, top_p)
    finally:
        sampling.NUCLEUS_WIDTHS = original


@pytest.mark.parametrize("prefix", [[1 - 2**-24], [0.5, 0.5 - 2**-24], [0.5, 0.25, 0.25 - 2**-24]])
def test_a_nucleus_that_fills_the_search_width_exactly_matches_the_full_sort(
    prefix: list[float],
) -> None:
    """The first tokens' mass is p itself, one ulp under 1.0; the next token's mass before it,
    (p + b) - b in float32, rounds to below p, so the full sort lets it in. A search that stops
    at the prefix's width because the mass there reaches p must not leave it out."""
    b = 1.5 * 2**-24
    probs = torch.tensor([[*prefix, b, b / 2]])
    top_p = torch.tensor([1 - 2**-24])
    full = nucleus_floor(probs, top_p, ())
    assert float(full[0]) == pytest.approx(b)  # the token after the prefix is in
    width = len(prefix)
    for widths in [(width,), (width, width + 1), (64, 1024)]:
        assert torch.equal(nucleus_floor(probs, top_p, widths), full), widths


def kept(logits: list[float], **options: Any) -> list[int]:
    """The tokens filtered_probs leaves any mass on, for one row (the same as the dense path)."""
    params = [SamplingParams(**options)]
    probs = filtered_probs(torch.tensor([logits]), params).to_dense()
    assert torch.equal(probs > 0, dense_probs(torch.tensor([logits]), params) > 0)
    return (probs[0] > 0).nonzero()[:, 0].tolist()


def test_edge_settings_keep_the_tokens_they_define() -> None:
    logits = [3.0, 2.0, 2.0, 2.0, 1.0, -math.inf]
    assert kept(logits, top_k=2) == [0, 1, 2, 3]  # ties with the k-th logit stay
    assert kept(logits, top_k=1) == [0]
    assert kept(logits, top_k=len(logits)) == kept(logits) == [0, 1, 2, 3, 4]  # -inf: no mass
    assert kept(logits, top_k=100) == [0, 1, 2, 3, 4]
    assert kept(logits, min_p=1.0) == [0]
    assert kept([2.0, 5.0, 5.0, 1.0], min_p=1.0) == [1, 2]  # every token tied at the top
    for tiny in (1e-3, 1e-30, 1e-45):  # below float32's range too: the top token stays
        assert kept(logits, top_p=tiny) == [0]
        assert kept([2.0, 5.0, 5.0, 1.0], top_p=tiny) == [1, 2]
    # top-k past the finite logits: only -inf left to cut, which has no mass anyway
    assert kept([0.0, -math.inf, 1.0, -math.inf], top_k=3, top_p=0.999) == [0, 2]


@pytest.mark.parametrize("vocab", [1, 2])
def test_tiny_vocabularies(vocab: int) -> None:
    logits = torch.tensor([[0.5, 1.5][:vocab]] * 4)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=1, top_p=0.5),
        SamplingParams(temperature=2.0, top_k=5, min_p=1.0),
        SamplingParams(temperature=1.0, top_p=1e-9),
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    tokens = sample(logits, params, gens)
    # One token: always it; two: each setting above keeps only the likelier one but the first.
    assert tokens[1:] == [vocab - 1] * 3
    assert 0 <= tokens[0] < vocab


def test_temperatures_at_the_greedy_cutoff() -> None:
    """Just below the cutoff is greedy; at it, a sampled row whose logits differ by 1e-3 (a gap
    of 100 after scaling) still takes the top token: no overflow, no NaN."""
    below, at = SamplingParams(temperature=0.99e-5), SamplingParams(temperature=1e-5)
    assert below.greedy and not at.greedy
    assert sampling.request_generator(below, torch.Generator()) is None
    logits = torch.tensor([[30.0, 30.001, -30.0, -math.inf], [-1e4, 1e4, 1e4 - 1e-3 * 8, 0.0]])
    probs = filtered_probs(logits, [at, at]).to_dense()
    assert not probs.isnan().any()
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed)] * 2
        assert sample(logits, [at, at], gens) == [1, 1]


def test_full_sort_and_wide_nuclei_with_the_real_widths() -> None:
    """A vocabulary of 3000 with rows whose nucleus is under 64 tokens, between 64 and 1024,
    and wider than 1024 (the full sort), in one batch, against the per-row reference."""
    torch.manual_seed(3)
    spreads = torch.tensor([8.0, 2.0, 0.2, 0.01])[:, None]
    logits = torch.randn(4, 3000) * spreads
    params = [SamplingParams(temperature=1.0, top_p=0.9) for _ in range(4)]
    probs = filtered_probs(logits, params).to_dense()
    sizes = (probs > 0).sum(-1).tolist()
    assert sizes[0] < 64 < sizes[1] < 1024 < sizes[2]  # every search width is exercised
    for row, p in enumerate(params):
        expected = reference_probs(logits[row], p)
        got = probs[row] / probs[row].sum()
        assert torch.equal(got > 0, expected > 0)
        torch.testing.assert_close(got, expected, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("method", sorted(DRAWS))
def test_draw_never_picks_trailing_tokens_without_mass(method: str) -> None:
    """Uniforms at both ends take the first and the last token with mass, never a -inf one
    past it; where u x total rounds up to the total, the last token with mass too."""
    logits = torch.tensor([[0.0, 1.0, -math.inf, -math.inf], [5.0, -math.inf, 5.0, -math.inf]])
    filtered = filtered_probs(logits, [SamplingParams(), SamplingParams()])
    probs = filtered.to_dense()
    for u in (0.0, 0.5, 1 - 2**-24):
        for tokens in (
            DRAWS[method](probs, torch.full((2,), u)),
            draw(filtered, torch.full((2,), u)),
        ):
            assert bool((probs.gather(1, tokens[:, None]) > 0).all()), u
    for pick in (DRAWS[method], lambda _, u: draw(filtered, u)):
        assert pick(probs, torch.full((2,), 1 - 2**-24)).tolist() == [1, 2]
        assert pick(probs, torch.zeros(2)).tolist() == [0, 0]
    # A subnormal total: u x total rounds up to the total itself, past every token's interval.
    tiny = torch.tensor([[0.0, 1e-45, 0.0, 0.0]])
    assert DRAWS[method](tiny, torch.tensor([0.9])).tolist() == [1]
