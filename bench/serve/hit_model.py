"""What hit rate a multi-turn run could get, from its own token counts: the ceiling (every
turn on the replica that served its conversation so far, as cache-aware routing aims for)
and what round robin over N replicas is expected to get.

Turn k of a conversation (k = 1..T) has P_k prompt tokens; the prefix it can find cached is
L_j = P_j + A_j (turn j's prompt and answer) on a replica that served turn j < k, and the
shared system prompt's S tokens on any warm replica (S: what the run's first turn of that
conversation found cached). Pools large enough that nothing is
evicted:

  ceiling:      cached_1 = S,  cached_k = L_{k-1}
  round robin:  when turns interleave across conversations, turn k lands on the replica of
                turn j with probability 1/N each, independently, so the newest earlier turn
                on its replica is j = k - m with probability (1/N)(1 - 1/N)^(m-1):
                E[cached_k] = sum_j (1/N)(1 - 1/N)^(k-1-j) L_j + (1 - 1/N)^(k-1) S

Since E[cached_k] >= L_{k-1} / N, round robin gets at least 1/N of the ceiling's hits: the
ratio ceiling / round robin is below N, and reaches N only for 2-turn conversations with no
shared prefix. (The engine computes at least one prompt token, so a turn caches at most
P_k - 1.)"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from bench.serve.client import RequestResult


class Turn(NamedTuple):
    prompt: int
    answer: int
    cached: int = 0  # what the run found cached (a first turn's: the shared prefix)


def conversations(results: list[RequestResult]) -> list[list[Turn]]:
    """Each session's turns in order, for the sessions all of whose turns succeeded."""
    by_session: dict[str, list[RequestResult]] = defaultdict(list)
    for r in results:
        by_session[r.session].append(r)
    out = []
    for turns in by_session.values():
        if all(r.ok for r in turns):
            ordered = sorted(turns, key=lambda r: r.turn)
            out.append(
                [Turn(r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in ordered]
            )
    return out


def ceiling_hit_rate(convs: list[list[Turn]]) -> float:
    """Every turn after the first finds the turn before it and its answer cached; a first
    turn, the shared prefix it found in the run (its document is new on any replica)."""
    prompt = sum(t.prompt for c in convs for t in c)
    cached = 0
    for conv in convs:
        cached += conv[0].cached
        cached += sum(min(p.prompt + p.answer, t.prompt - 1) for p, t in pairwise(conv))
    return cached / prompt if prompt else 0.0


def round_robin_hit_rate(convs: list[list[Turn]], replicas: int) -> float:
    """The expectation above, each conversation's S being what its first turn found."""
    q = 1.0 / replicas
    prompt = sum(t.prompt for c in convs for t in c)
    cached = 0.0
    for conv in convs:
        shared = conv[0].cached
        for k, turn in enumerate(conv):
            expected = (1 - q) ** k * shared
            for j in range(k):
                held = min(conv[j].prompt + conv[j].answer, turn.prompt - 1)
                expected += q * (1 - q) ** (k - 1 - j) * max(held, shared)
            cached += expected
    return cached / prompt if prompt else 0.0
