"""A step's tokens from its logits, for each sequence that samples: a plain row's next token
(grammars, the requests' logit rules, penalties, then sampling, plus the log-probabilities that
requests asked for: `next_tokens`), and a drafted row's check (`step_tokens`: the draft's
guesses kept up to the model's first other choice; the guesses come from
runner/engine/step/speculative.py).

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
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq

import torch

from runner.engine.sequence import Sequence
from runner.sampling.logit_rules import apply_rules
from runner.sampling.logprobs import TokenLogprobs, token_logprobs
from runner.sampling.penalties import TokenHistory, penalize
from runner.sampling.sampler import draw, filtered_probs, sample
from runner.sampling.structured_outputs import mask_logits


def next_tokens(
    logits: torch.Tensor, samplers: Seq[Sequence], eos_ids: Collection[int]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The next token of each sequence from its row of `logits` [len(samplers), vocab], and
    its log-probabilities (None where not asked). The logits are left as they are: the
    log-probabilities read the model's own, and on CUDA they may be a graph's static buffer."""
    if not samplers:
        return [], []
    params = [s.params for s in samplers]
    if all(s.plain_logits for s in samplers):  # the common step: ~0.1 ms less at 256 rows
        return sample(logits, params, [s.generator for s in samplers]), [None] * len(samplers)
    histories = [_history(s) if s.params.penalized else None for s in samplers]
    outputs = [s.output_token_ids for s in samplers]
    structured = mask_logits(logits, [s.grammar for s in samplers])
    ruled = apply_rules(structured, params, outputs, eos_ids, [s.bad_words for s in samplers])
    tokens = sample(
        penalize(ruled, params, histories, outputs), params, [s.generator for s in samplers]
    )
    return tokens, token_logprobs(logits, params, tokens)


def _history(seq: Sequence) -> TokenHistory:
    if seq.token_history is None:
        seq.token_history = TokenHistory(seq.prompt_token_ids)
    return seq.token_history


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
