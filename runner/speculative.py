"""Speculative decoding: guess a sequence's next tokens, and check the guesses in one forward
pass. The guesses come from the prefix cache (what an earlier request with this very prefix
went on with, still cached in the radix tree) or else by n-gram lookup in the sequence's own
text (vLLM's "ngram" method, transformers' prompt lookup).

A decode step streams every weight of the model from memory to compute one token a sequence;
computing a few more positions in the same pass costs little (on the CPU, a step of 5 tokens
takes about as long as one of 1). When the text repeats itself (quoting or rewriting the
prompt, code, lists, structured answers), the tokens after the newest n-gram's last earlier
occurrence are often what comes next. The step feeds them as a draft after the newest token;
the model's greedy choice at each position is then known, and the draft is kept up to its
first wrong token, plus the model's own token there: the output is exactly greedy decoding's,
one to k + 1 tokens a step.

Only plain greedy requests are drafted for: a request that samples, is penalized, has logit
rules or a structure, or asks for log-probabilities decodes one token a step as before.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from kvcache import BlockManager
from runner.logprobs import TokenLogprobs
from runner.next_tokens import next_tokens
from runner.sampling_params import SamplingParams
from runner.sequence import Sequence

NGRAM_MAX = 4  # the longest n-gram looked up first: a longer match predicts better
NGRAM_MIN = 2  # a single token recurs too often to say much about what follows it


@dataclass
class SpecStats:
    """Guessed tokens checked so far, and those the model agreed with."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def update(self, drafted: int, accepted: int) -> None:
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted


def draftable(params: SamplingParams) -> bool:
    """Whether a request's next tokens are its model's plain argmax, which a draft can check."""
    return (
        params.greedy
        and not params.penalized
        and params.logprobs is None
        and params.min_tokens == 0
        and not params.bias_items
        and not params.allowed_token_ids
        and params.structured_outputs is None
    )


def propose(token_ids: list[int], k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the sequence's
    newest n-gram (n from NGRAM_MAX down to NGRAM_MIN); empty when none occurred before."""
    if k < 1 or len(token_ids) <= NGRAM_MIN:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(NGRAM_MAX, len(tokens) - 1), NGRAM_MIN - 1, -1):
        # [len - n, n]: every n-gram but the newest itself; a match at i is followed by i + n.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in tokens[start : start + k]]
    return []


def draft_for(seq: Sequence, k: int, max_model_len: int, bm: BlockManager) -> list[int]:
    """A decoding sequence's guessed next tokens: at most `k`, as many as max_tokens and the
    context leave room for, and as the pool can give blocks for without preempting anyone
    (like any growth it may evict least recently used cached blocks)."""
    k = min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1)
    k = min(k, max_model_len - seq.num_tokens - 1)
    if k < 1 or not draftable(seq.params):
        return []
    # What an earlier request with this very prefix went on with (its blocks are cached),
    # else what followed this text's newest n-gram in itself.
    draft = bm.cached_continuation(seq.seq_id, seq.token_ids, k) or propose(seq.token_ids, k)
    while draft and not bm.can_append(seq.seq_id, seq.num_tokens + len(draft)):
        draft.pop()
    return draft


def accepted(draft: list[int], targets: list[int]) -> list[int]:
    """The tokens a step produces: the draft up to its first token that differs from the
    model's choice there, then the model's choice at that position (targets[i] is the model's
    token after the newest token and draft[:i]; len(targets) == len(draft) + 1)."""
    kept = 0
    while kept < len(draft) and draft[kept] == targets[kept]:
        kept += 1
    return targets[: kept + 1]


def step_tokens(
    logits: torch.Tensor,
    samplers: list[Sequence],
    drafts: list[list[int]],
    eos_ids: Collection[int],
) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
    """Each sampling sequence's new tokens from a step's logits (1 + len(drafts[i]) rows for
    sampler i, in order): its usual next token (sampled, penalized, ...) where it had no
    draft, else the draft's accepted tokens; and the usual token's log-probabilities."""
    if not any(drafts):
        tokens, logprobs = next_tokens(logits, samplers, eos_ids)
        return [[t] for t in tokens], logprobs
    sizes = torch.tensor([1 + len(d) for d in drafts])
    ends = torch.cumsum(sizes, 0) - 1  # each sampler's last row: its usual next-token row
    tokens, logprobs = next_tokens(
        logits.index_select(0, ends.to(logits.device)), samplers, eos_ids
    )
    choices = logits.argmax(dim=-1).tolist()  # a drafted request is plain greedy: argmax
    emitted = []
    for draft, end, token in zip(drafts, ends.tolist(), tokens, strict=True):
        emitted.append(accepted(draft, choices[end - len(draft) : end + 1]) if draft else [token])
    return emitted, logprobs
