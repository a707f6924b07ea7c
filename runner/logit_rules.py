"""A request's own rules on its logits, applied before penalties and sampling, as vLLM
defines them: `allowed_token_ids` keeps only those tokens, `min_tokens` bans every token that
would end the request (EOS unless `ignore_eos`, and `stop_token_ids`) until it has that many
output tokens, and `logit_bias` adds its bias to given tokens' logits, in that order.

Like the penalties, only the named logits are touched, by flat index into one copy of the
logits (the model's own stay as they are: log-probabilities read them, and on CUDA they may be
a graph's static buffer); a step whose requests have no rules costs nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from runner.sampling_params import SamplingParams


def stop_ids_of(params: SamplingParams, eos_ids: Collection[int]) -> set[int]:
    """The tokens that end a request with these params: what `min_tokens` bans."""
    ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        ids.update(eos_ids)
    return ids


def apply_rules(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_lengths: Sequence[int],
    eos_ids: Collection[int],
) -> torch.Tensor:
    """`logits` [N, vocab] with row i under params[i]'s rules, its request having
    output_lengths[i] tokens out. Returns `logits` itself when no row has a rule in force,
    else a new float32 tensor."""
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
    banned = [i for i, p in enumerate(params) if output_lengths[i] < p.min_tokens]
    biased = [i for i, p in enumerate(params) if p.bias_items]
    if not (allowed or banned or biased):
        return logits
    vocab = logits.shape[1]
    ruled = logits.float()
    if ruled is logits:
        ruled = logits.clone()
    dev = ruled.device
    for i in allowed:  # token ids were checked against the vocabulary when the request came
        ids = torch.tensor(sorted(set(params[i].allowed_token_ids or ())), device=dev)
        kept = ruled[i].index_select(0, ids)
        ruled[i].fill_(-torch.inf)
        ruled[i].index_copy_(0, ids, kept)
    flat = ruled.view(-1)
    bans = [t + i * vocab for i in banned for t in stop_ids_of(params[i], eos_ids) if t < vocab]
    if bans:  # an EOS id may lie past a model's logits: it can never be sampled anyway
        flat[torch.tensor(bans, device=dev)] = -torch.inf
    if biased:
        index = [t + i * vocab for i in biased for t, _ in params[i].bias_items]
        bias = [b for i in biased for _, b in params[i].bias_items]
        flat.index_add_(0, torch.tensor(index, device=dev), torch.tensor(bias, device=dev))
    return ruled
