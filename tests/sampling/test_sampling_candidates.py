"""The sampler's candidate path (runner/sampling/candidates.py) against the dense filters that
define what is kept (runner/sampling/sampler.py dense_probs): the same sets, proportional masses,
the same draws whatever shares a batch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import runner.sampling.sampler as sampling
from runner.sampling.candidates import top_candidates
from runner.sampling.params import SamplingParams
from runner.sampling.sampler import dense_probs, filtered_probs, sample

# The candidate path against the dense one. Vocabularies from 1 token to past 16,384 (where the
# candidate search takes block maxima); logits peaked, flat, tied (few distinct values) or
# partly -inf; widths under and over each top-k's candidate width (64, 128, ... 1024).
candidate_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([1e-5, 0.05, 0.7, 1.0, 1.3, 100.0, 1e4]),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 40, 63, 64, 65, 500, 1023, 1024, 3000]),
    top_p=st.sampled_from([1.0, 0.999999, 0.99, 0.9, 0.5, 0.1, 1e-3, 1e-40]),
    min_p=st.sampled_from([0.0, 1e-30, 0.01, 0.2, 0.9, 1.0]),
)


def random_logits(rows: int, vocab: int, shape: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if shape == "tied":  # a handful of values: ties at every threshold
        return torch.randint(-3, 3, (rows, vocab), generator=gen).float()
    logits = torch.randn(rows, vocab, generator=gen) * {"peaked": 8.0, "flat": 0.3}.get(shape, 2.0)
    if shape == "masked":  # most tokens banned, as a grammar or allowed_token_ids leaves them
        logits.masked_fill_(torch.rand(rows, vocab, generator=gen) < 0.9, -math.inf)
        logits[:, 0] = 0.0
    return logits


def assert_same_filters(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """The candidate path keeps each row's dense set, with proportional masses: bit for bit
    where the row has no top-k (it takes the dense softmax itself)."""
    got, expected = filtered_probs(logits, params).to_dense(), dense_probs(logits, params)
    vocab = logits.shape[1]
    for row, p in enumerate(params):
        assert torch.equal(got[row] > 0, expected[row] > 0), f"row {row} {p}: another set"
        if not 0 < p.top_k < vocab:
            assert torch.equal(got[row], expected[row]), f"row {row} {p}"
        a, b = got[row] / got[row].sum(), expected[row] / expected[row].sum()
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-6)


@settings(max_examples=120, deadline=None)
@given(
    vocab=st.sampled_from([1, 2, 3, 17, 64, 65, 129, 300, 2000, 16384, 20000]),
    params=st.lists(candidate_params, min_size=1, max_size=5),
    shape=st.sampled_from(["peaked", "normal", "flat", "tied", "masked"]),
    seed=st.integers(0, 2**16),
)
def test_candidates_keep_what_the_dense_path_keeps(
    vocab: int, params: list[SamplingParams], shape: str, seed: int
) -> None:
    assert_same_filters(random_logits(len(params), vocab, shape, seed), params)


@pytest.mark.parametrize("top_k", [0, 40, 300])
def test_decisions_on_their_threshold_match_the_dense_path(top_k: int) -> None:
    """top_p set to the dense path's own mass before a token, or min_p to a token's share of the
    top one, give each way of rounding its one chance to decide otherwise: a candidate softmax
    that sums in another order must not (it hands such rows to the dense softmax)."""
    torch.manual_seed(top_k)
    logits = torch.randn(24, 20000) * 3
    base = [SamplingParams(temperature=0.8, top_k=top_k) for _ in range(24)]
    probs = dense_probs(logits, base).sort(dim=-1, descending=True).values
    before = torch.cumsum(probs, dim=-1) - probs
    params = []
    for row in range(24):
        j = 1 + row % 8
        edge = float(before[row, j])
        shifts = [edge, float(torch.nextafter(before[row, j], torch.tensor(1.0))), edge * 0.9999]
        share = float(probs[row, j] / probs[row, 0])
        params.append(SamplingParams(temperature=0.8, top_k=top_k, top_p=shifts[row % 3]))
        params.append(SamplingParams(temperature=0.8, top_k=top_k, min_p=share))
    assert_same_filters(logits.repeat_interleave(2, dim=0), params)


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.sampled_from([5, 64, 4096, 16384, 16390, 20000]),
    width=st.sampled_from([1, 2, 64, 128, 1024]),
    shape=st.sampled_from(["peaked", "tied", "masked"]),
    seed=st.integers(0, 2**16),
)
def test_block_candidates_are_a_top_k(vocab: int, width: int, shape: str, seed: int) -> None:
    """The block-maxima search finds the same top values as a top-k, at ids holding them."""
    x = random_logits(3, vocab, shape, seed)
    values, ids = top_candidates(x, width)
    expected = torch.topk(x, min(width, vocab), dim=-1).values
    assert torch.equal(values, expected)
    assert torch.equal(x.gather(1, ids), values)
    assert all(len(set(row)) == len(row) for row in ids.tolist())


def test_each_row_draws_the_same_in_any_batch() -> None:
    """Rows that end compact, dense, or on the dense path's fallback draw the same token alone,
    in any order, and beside any other rows: nothing a row gets hangs on its batch."""
    torch.manual_seed(0)
    logits = torch.cat([torch.randn(4, 20000) * 8, torch.randn(4, 20000) * 0.3])
    options = [{"top_p": 0.9}, {"top_k": 50}, {"top_k": 2000, "top_p": 0.95}, {"min_p": 0.1}, {}]
    params = [SamplingParams(temperature=0.9, seed=i, **options[i % 5]) for i in range(8)]
    rng = torch.Generator().manual_seed(0)
    for trial in range(3):
        order = torch.randperm(8).tolist() if trial else list(range(8))
        batch = sample(
            logits[order],
            [params[i] for i in order],
            [sampling.request_generator(params[i], rng) for i in order],
        )
        for i, token in zip(order, batch, strict=True):
            alone = sample(
                logits[i : i + 1], [params[i]], [sampling.request_generator(params[i], rng)]
            )
            assert alone == [token], (i, params[i])


def test_groups_cover_each_row_once() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 20000) * torch.tensor([8.0, 8.0, 0.3, 0.3, 8.0, 2.0])[:, None]
    params = [
        SamplingParams(top_p=0.9),  # compact, 64 candidates
        SamplingParams(top_k=40, top_p=0.5),  # compact, 64 candidates of the logits
        SamplingParams(top_p=0.9),  # a nucleus past 8192: the full sort, dense
        SamplingParams(),  # every token: dense
        SamplingParams(top_k=5000),  # over TOP_K_WIDEST: the dense path
        SamplingParams(top_k=500, min_p=0.01),  # 512 candidates
    ]
    filtered = filtered_probs(logits, params)
    rows = [r for g in [*filtered.compact, *filtered.dense] for r in g.rows.tolist()]
    assert sorted(rows) == list(range(6))
    widths = {
        r: g.probs.shape[1] for g in [*filtered.compact, *filtered.dense] for r in g.rows.tolist()
    }
    assert widths == {0: 64, 1: 64, 2: 20000, 3: 20000, 4: 20000, 5: 512}
