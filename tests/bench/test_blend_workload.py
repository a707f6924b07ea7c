"""The blend bench's workload (bench/blend_workload.py): passages of 200 to 400 tokens from
Python's own help topics, queries of 6 distinct passages drawn by a Zipf law in shuffled orders,
as segments that join into the chat-templated prompt; and its KL figure."""

from __future__ import annotations

import collections

import torch

from bench.blend import mean_kl
from bench.blend_workload import (
    DOCS_PER_QUERY,
    MAX_TOKENS,
    MIN_TOKENS,
    header,
    passages,
    queries,
)
from tests.conftest import tiny_tokenizer


def test_passages_and_queries() -> None:
    tokenizer = tiny_tokenizer()
    docs = passages(tokenizer)
    assert len(docs) >= 200
    for d in docs:  # the passage's text, after its header line
        assert MIN_TOKENS <= len(d.token_ids) - len(header(tokenizer, d.topic)) <= MAX_TOKENS
    asked = queries(tokenizer, docs, 300, seed=0)
    assert queries(tokenizer, docs, 300, seed=0) == asked  # deterministic
    counts = collections.Counter(i for q in asked for i in q.passages)
    for q in asked:
        assert len(set(q.passages)) == DOCS_PER_QUERY
        assert q.segments[1:-1] == [docs[i].token_ids for i in q.passages]
    hottest = counts.most_common(1)[0][1]
    assert hottest > 10 * 300 * DOCS_PER_QUERY / len(docs) / 4  # skewed, not uniform
    assert len(counts) > 60  # but with a long tail
    orders = {tuple(q.passages) for q in asked}
    assert len(orders) == len(asked)  # no two queries alike


def test_mean_kl() -> None:
    p = torch.log_softmax(torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]), -1)
    assert mean_kl(p, p) == 0.0
    q = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0], [0.0, 0.0, 0.0]]), -1)
    expected = float((p[0].exp() * (p[0] - q[0])).sum()) / 2
    assert abs(mean_kl(p, q) - expected) < 1e-6
