"""Log-probabilities of the sampled tokens and of the likeliest alternatives.

They come from the model's own distribution (log-softmax of its logits, before temperature,
penalties and filters), as vLLM reports by default: a figure that says how likely the model
found a token, the same whatever sampling settings picked it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from runner.sampling import SamplingParams


class TokenLogprobs(NamedTuple):
    """One generated token's log-probability, and the N likeliest tokens of its step as
    (token id, log-probability), most likely first (the generated one among them or not)."""

    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int]
) -> list[TokenLogprobs | None]:
    """For row i of `logits` [N, vocab] and its chosen token tokens[i]: its log-probability
    and params[i].logprobs likeliest tokens, or None where the request asked for none. One
    log-softmax and one top-k over the rows that ask, whatever their number."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    dev = logits.device
    index = torch.tensor(rows, device=dev)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [n, vocab]
    chosen_ids = torch.tensor([tokens[i] for i in rows], device=dev)[:, None]
    chosen = logp.gather(1, chosen_ids)[:, 0].tolist()
    width = max(int(params[i].logprobs or 0) for i in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if width:
        top = torch.topk(logp, width, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for k, i in enumerate(rows):
        n = int(params[i].logprobs or 0)
        result[i] = TokenLogprobs(
            chosen[k], list(zip(top_ids[k][:n], top_values[k][:n], strict=True))
        )
    return result
