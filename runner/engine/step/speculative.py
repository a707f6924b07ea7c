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
wrong token, plus the model's own token there: one to k + 1 tokens a step.

A greedy request's choice is the argmax. A sampling request's choice at each position is drawn
as it would be without a draft: by inverse CDF from the next uniform number of the request's
own stream, over the position's filtered probabilities (runner/sampling/sampler.py). Since every
position before it held the token drawn there, position j sees exactly the context and the
uniform that plain decoding would give its j-th token, and the stream advances by one number
per token kept. So the output is plain decoding's token for token, greedy or sampled (a seeded
request's answer does not depend on whether, or what, it was guessed), and a guess is kept with
its probability under the request's own filters, the most any single guess can be. Only rounding
can tell the two apart: a guessed position's logits come from a longer step, which rounds
otherwise (about 1e-5), and a draw or an argmax that close to a tie may go the other way.

A request that is penalized, has logit rules or a structure, or asks for log-probabilities
decodes one token a step as before.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from kvcache import BlockManager
from runner.engine.sequence import Sequence
from runner.engine.step.next_tokens import next_tokens
from runner.sampling.logprobs import TokenLogprobs
from runner.sampling.params import SamplingParams
from runner.sampling.sampler import draw, filtered_probs

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
    draft, else the draft's accepted tokens; and the usual token's log-probabilities (None for
    a drafted sequence, which never asks for them)."""
    if not any(drafts):
        tokens, all_logprobs = next_tokens(logits, samplers, eos_ids)
        return [[t] for t in tokens], all_logprobs
    ends = (torch.cumsum(torch.tensor([1 + len(d) for d in drafts]), 0) - 1).tolist()
    plain = [i for i, d in enumerate(drafts) if not d]
    rows = torch.tensor([ends[i] for i in plain], dtype=torch.int64, device=logits.device)
    tokens, plain_logprobs = next_tokens(
        logits.index_select(0, rows), [samplers[i] for i in plain], eos_ids
    )
    emitted: list[list[int]] = [[] for _ in samplers]
    logprobs: list[TokenLogprobs | None] = [None] * len(samplers)
    for i, token, lp in zip(plain, tokens, plain_logprobs, strict=True):
        emitted[i], logprobs[i] = [token], lp
    drafted = [i for i, d in enumerate(drafts) if d]
    choices = _choices(
        logits,
        [samplers[i] for i in drafted],
        [drafts[i] for i in drafted],
        [ends[i] for i in drafted],
    )
    for i, targets in zip(drafted, choices, strict=True):
        emitted[i] = accepted(drafts[i], targets)
        stream = samplers[i].generator
        if stream is not None:
            _consume(stream, len(emitted[i]))
    return emitted, logprobs


def _choices(
    logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], ends: list[int]
) -> list[list[int]]:
    """The model's token at each of a drafted sequence's positions (len(draft) + 1 of them,
    ending at its row in `ends`): the argmax for a greedy one; for a sampling one, a draw from
    the position's filtered probabilities with the next uniforms of its stream, read without
    advancing it (`_consume` advances it by the tokens kept)."""
    greedy_rows = logits.argmax(dim=-1).tolist()
    spans = [range(end - len(draft), end + 1) for draft, end in zip(drafts, ends, strict=True)]
    sampled = [j for j, seq in enumerate(seqs) if not seq.params.greedy]
    drawn: dict[int, list[int]] = {}
    if sampled:
        rows = [r for j in sampled for r in spans[j]]
        params = [seqs[j].params for j in sampled for _ in spans[j]]
        uniforms = torch.cat([_peek(seqs[j].generator, len(spans[j])) for j in sampled])
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        probs = filtered_probs(logits.index_select(0, index), params)
        picks = draw(probs, uniforms.to(logits.device)).tolist()
        at = 0
        for j in sampled:
            drawn[j], at = picks[at : at + len(spans[j])], at + len(spans[j])
    return [drawn.get(j, [greedy_rows[r] for r in spans[j]]) for j in range(len(seqs))]


def _peek(generator: torch.Generator | None, n: int) -> torch.Tensor:
    """The next `n` uniforms of a stream, one draw each as `sample` takes them, leaving the
    stream where it was."""
    assert generator is not None, "a sampling sequence has its own stream"
    state = generator.get_state()
    uniforms = torch.cat([torch.rand(1, generator=generator) for _ in range(n)])
    generator.set_state(state)
    return uniforms


def _consume(generator: torch.Generator, n: int) -> None:
    """Advance a stream past the `n` uniforms that the kept tokens used."""
    for _ in range(n):
        torch.rand(1, generator=generator)
