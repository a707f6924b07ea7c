"""Speculative decoding: guess a sequence's next tokens, and check the guesses in one forward
pass. The guesses come from the prefix cache (what an earlier request with this very prefix
went on with, still cached in the radix tree) or else by n-gram lookup in the sequence's own
text (vLLM's "ngram" method, transformers' prompt lookup).

A decode step streams every weight of the model from memory to compute one token a sequence;
computing a few more positions in the same pass costs little (on the CPU, a step of 5 tokens
takes about as long as one of 1). When the text repeats itself (quoting or rewriting the
prompt, code, lists, structured answers), the tokens after the newest n-gram's last earlier
occurrence are often what comes next. The step feeds them as a draft after the newest token;
the model's choice at each position is then known, and the draft is kept up to its first
wrong token, plus the model's own token there: one to k + 1 tokens a step (the check:
runner/engine/step/tokens.py, `step_tokens`).

A request that is penalized, has logit rules or a structure, or asks for log-probabilities
decodes one token a step as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcache import BlockManager
from runner.engine.sequence import Sequence
from runner.sampling.params import SamplingParams

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
    """Whether a request's next tokens depend on the model's logits and its own random stream
    alone (argmax or a filtered draw), which a draft can check position by position."""
    return (
        not params.penalized
        and params.logprobs is None
        and params.min_tokens == 0
        and not params.bias_items
        and not params.allowed_token_ids
        and not params.bad_words
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
    (like any growth it may evict least recently used cached blocks). Mutates: the sequence's
    block table grows to hold the draft it returns."""
    k = min(k, seq.max_tokens - len(seq.output_token_ids) - 1)
    k = min(k, max_model_len - seq.num_tokens - 1)
    if k < 1 or not draftable(seq.params):
        return []
    # What an earlier request with this very prefix went on with (its blocks are cached),
    # else what followed this text's newest n-gram in itself.
    draft = bm.cached_continuation(seq.seq_id, seq.token_ids, k) or propose(seq.token_ids, k)
    while draft and not bm.grow(seq.seq_id, seq.num_tokens + len(draft)):
        draft.pop()
    return draft
