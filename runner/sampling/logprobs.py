"""Log-probabilities of the sampled tokens and of the likeliest alternatives.

They come from the model's own distribution (log-softmax of its logits, before temperature,
penalties and filters), as vLLM reports by default: a figure that says how likely the model
found a token, the same whatever sampling settings picked it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from runner.sampling.params import SamplingParams


class TokenLogprobs(NamedTuple):
    """One generated token's log-probability, and the N likeliest tokens of its step as
    (token id, log-probability), most likely first (the generated one among them or not);
    `rank` is the generated token's place in its step's distribution, as vLLM counts it (the
    tokens at least as likely, itself included: 1 for the likeliest)."""

    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


def token_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int]
) -> list[TokenLogprobs | None]:
    """For row i of `logits` [N, vocab] and its chosen token tokens[i]: its log-probability
    and params[i].logprobs likeliest tokens, or None where the request asked for none."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if rows:
        index = torch.tensor(rows, device=logits.device)
        found = logprobs_of(
            logits.index_select(0, index),
            [tokens[i] for i in rows],
            [int(params[i].logprobs or 0) for i in rows],
        )
        for i, value in zip(rows, found, strict=True):
            result[i] = value
    return result


def logprobs_of(
    logits: torch.Tensor, targets: Sequence[int], widths: Sequence[int]
) -> list[TokenLogprobs]:
    """Row i of `logits` [n, vocab]: the log-probability of targets[i] and the widths[i]
    likeliest tokens. One log-softmax and one top-k for all rows, and two transfers."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen_ids = torch.tensor(list(targets), dtype=torch.int64, device=logits.device)[:, None]
    chosen_logp = logp.gather(1, chosen_ids)  # [n, 1]
    ranks = (logp >= chosen_logp).sum(dim=-1)  # exact in float32 for vocabularies below 2**24
    chosen, rank = torch.stack([chosen_logp[:, 0], ranks.to(logp.dtype)]).tolist()
    width = max(widths, default=0)
    top_values: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if width:
        top = torch.topk(logp, width, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprobs(
            chosen[k], list(zip(top_ids[k][:n], top_values[k][:n], strict=True)), int(rank[k])
        )
        for k, n in enumerate(widths)
    ]
