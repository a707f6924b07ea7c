"""A request's own rules on its logits, applied before penalties and sampling, as vLLM
defines them: `allowed_token_ids` keeps only those tokens, `min_tokens` bans every token that
would end the request (EOS unless `ignore_eos`, and `stop_token_ids`) until it has that many
output tokens, `bad_words` bans the token that would complete a bad word (its token sequence
minus the last token ends the output so far), and `logit_bias` adds its bias to given tokens'
logits, in that order.

Like the penalties, only the named logits are touched, by flat index into one copy of the
logits (the model's own stay as they are: log-probabilities read them, and on CUDA they may be
a graph's static buffer); a step whose requests have no rules costs nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from runner.sampling.params import SamplingParams


def stop_ids_of(params: SamplingParams, eos_ids: Collection[int]) -> set[int]:
    """The tokens that end a request with these params: what `min_tokens` bans."""
    ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        ids.update(eos_ids)
    return ids


BadWords = tuple[tuple[int, ...], ...]  # each bad word's token sequences


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> BadWords:
    """Each word's token sequences as vLLM forms them: the word alone and after a space (a
    word inside a sentence is written with its space), each once."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


def completing_tokens(bad_words: BadWords, output: Sequence[int]) -> set[int]:
    """The tokens that would complete a bad word after `output`: a one-token word's token
    always, a longer one's last token when the output ends with its others."""
    out = set()
    for word in bad_words:
        *head, last = word
        if not head or (len(output) >= len(head) and list(output[-len(head) :]) == head):
            out.add(last)
    return out


def apply_rules(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    eos_ids: Collection[int],
    bad_words: Sequence[BadWords],
) -> torch.Tensor:
    """`logits` [N, vocab] with row i under params[i]'s rules, its request having
    outputs[i] out so far, and bad_words[i] its bad words' token sequences. Returns `logits`
    itself when no row has a rule in force, else a new float32 tensor."""
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
    banned = [i for i, p in enumerate(params) if len(outputs[i]) < p.min_tokens]
    biased = [i for i, p in enumerate(params) if p.bias_items]
    completing = [
        (i, tokens)
        for i in range(len(params))
        if bad_words[i] and (tokens := completing_tokens(bad_words[i], outputs[i]))
    ]
    if not (allowed or banned or biased or completing):
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
    bans += [t + i * vocab for i, tokens in completing for t in tokens if t < vocab]
    if bans:  # an EOS id may lie past a model's logits: it can never be sampled anyway
        flat[torch.tensor(bans, device=dev)] = -torch.inf
    if biased:
        index = [t + i * vocab for i in biased for t, _ in params[i].bias_items]
        bias = [b for i in biased for _, b in params[i].bias_items]
        flat.index_add_(0, torch.tensor(index, device=dev), torch.tensor(bias, device=dev))
    return ruled
