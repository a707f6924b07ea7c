"""Which replica gets a request.

- round_robin: each in turn.
- least_loaded: the fewest requests in flight from this router (ties: the fewest sent so far).
- cache_aware: the replica where the request is estimated to cost least, in KV blocks of
  prompt to compute:

      cost(r) = sum over the prompt's blocks r lacks of 1 / k_i
                + load_weight * (load(r) + recent(r))

  k_i is how many conversations share block i (runner/router/shared_prefix.py: 1 for a
  conversation's own history, k for a system prompt k conversations opened with); load(r) is
  the work r has in flight from this router (runner/router/load.py): the uncached prompt
  blocks of its requests that have not produced a token yet, and the answer blocks of those
  still running; recent(r) is the conversations started on r lately (requests whose prompt
  continues no earlier prompt but for shared prefixes), each counting RECENT_BLOCKS
  and half as much every `recent_half_life_s` (runner/router/load.py RecentWork). Ties go
  to the longer match, then (with --kv-events) the more of it in the replica's device pool
  rather than its host or disk tier, then the fewer requests in flight. SGLang's imbalance
  rule stays as a guard: when the busiest replica has more than `balance_abs` requests in
  flight over the idlest and more than `balance_rel` times as many, the least loaded gets
  the request whatever the prefixes say. A match shorter than `threshold` of the prompt's
  blocks counts as none (SGLang's cache threshold; 0 by default).

Why a cost and not SGLang's rule (the longest match once it covers `threshold` of the prompt,
else the least loaded, unless loads are unbalanced): a system prompt every conversation opens
with passes any threshold on the replica that served the first conversation, so with the
imbalance rule at its defaults (64 requests) every new conversation followed the first onto
one replica (the multi-turn bench: all 32 requests on one of 2 replicas). Counting both sides
in blocks of work tells a replica that holds this conversation (it saves the whole history, on
every turn) from one that holds a prefix every replica will soon hold: NVIDIA Dynamo's KV
router weighs prefill blocks against blocks active on a worker the same way. Two choices are
ours. A shared block costs a replica without it 1 / k: computing it there is paid once and
serves every later conversation that opens with it, so a system prompt seen by k
conversations weighs 1 / k of its size against load, and new conversations spread, while a
long document shared by two questions still weighs half its size and stays where it is
unless that replica is that much busier. And the load is the work not yet done (prompt
blocks until the first token, answer blocks until the end), not the blocks held: a replica
that has only finished prefills in flight costs a newcomer little, so a conversation's next
turn stays on its replica unless a backlog of more blocks than its history waits there.
The recent term is for an idle cluster: with nothing in flight anywhere, the replica that
served the last conversations is always the cheapest for the next one (it holds the system
prompt), so conversations arriving slowly all gathered there (27 of 36 requests on one of 4
replicas in the bench at a rate), and each of them brings its later turns with it. A
conversation started lately stands for a turn of it still to come (a short follow-up and its
answer: RECENT_BLOCKS), whatever its own prompt cost: a replica that just computed a long
document is not made to look busy by it, so the next question on that document stays there,
while new conversations spread at idle. It fades, and a conversation's own history (its
whole length) still outweighs a difference of a request or two.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from runner.kv_events.schema import MEDIUM_POOL
from runner.router.event_index import EventIndex
from runner.router.load import RecentWork
from runner.router.proxy import RouterSettings
from runner.router.replicas import Replica
from runner.router.shared_prefix import SharedPrefixes

POLICIES = ("cache_aware", "round_robin", "least_loaded")
RECENT_BLOCKS = 8  # what a request sent lately weighs: a follow-up turn of ~100 tokens + answer
HashesOf = Callable[[Replica], list[int]]


@dataclass(frozen=True)
class Route:
    replica: Replica
    reason: str  # round_robin | least_loaded | prefix_match | load | balance
    matched_blocks: int = 0
    prefill_blocks: int = 0  # the prompt's full blocks the replica is expected to compute


def least_loaded(candidates: list[Replica]) -> Replica:
    return min(candidates, key=lambda r: (r.in_flight, r.sent))


class RoundRobin:
    uses_prefixes = False

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list[Replica], hashes_of: HashesOf) -> Route:
        return Route(candidates[next(self._turn) % len(candidates)], "round_robin")


class LeastLoaded:
    uses_prefixes = False

    def choose(self, candidates: list[Replica], hashes_of: HashesOf) -> Route:
        return Route(least_loaded(candidates), "least_loaded")


class CacheAware:
    uses_prefixes = True

    def __init__(
        self,
        threshold: float = 0.0,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        load_weight: float = 1.0,
        recent_half_life_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        self.threshold, self.balance_abs, self.balance_rel = threshold, balance_abs, balance_rel
        if recent_half_life_s < 0:
            raise ValueError(f"recent_half_life_s must be >= 0, got {recent_half_life_s}")
        self.load_weight = load_weight
        self.shared = SharedPrefixes()
        self.recent_half_life_s, self.clock = recent_half_life_s, clock
        self.recent: dict[str, RecentWork] = {}

    def choose(self, candidates: list[Replica], hashes_of: HashesOf) -> Route:
        prompts = [hashes_of(r) for r in candidates]
        matches = [self._matched(r, h) for r, h in zip(candidates, prompts, strict=True)]
        # The prompt's blocks as the first replica whose naming is known sees them; one whose
        # naming is not (no hashes: its /kvcache/info lacks a usable fingerprint or block
        # size) holds no known prefix: the whole prompt is its to compute, not nothing.
        known = next((h for h in prompts if h), [])
        blocks = [len(h) if h else len(known) for h in prompts]
        # Block i's cost to a replica without it: 1 / (conversations sharing it).
        costs = [1.0 / k for k in self.shared.observe(known)]
        missing = [
            sum(costs[m:]) if len(costs) == n else n - m
            for m, n in zip(matches, blocks, strict=True)
        ]
        busiest, idlest = max(r.in_flight for r in candidates), min(r.in_flight for r in candidates)
        if busiest - idlest > self.balance_abs and busiest > idlest * self.balance_rel:
            i = candidates.index(least_loaded(candidates))
            return Route(candidates[i], "balance", matches[i], blocks[i] - matches[i])

        now = self.clock()
        recent = [RECENT_BLOCKS * self._recent(r).value(now) for r in candidates]

        def cost(i: int) -> tuple[float, int, int, int, int]:
            r = candidates[i]
            work = missing[i] + self.load_weight * (r.load_blocks + recent[i])
            return (work, -matches[i], -_in_pool(r, prompts[i]), r.in_flight, r.sent)

        i = min(range(len(candidates)), key=cost)
        # Only a new conversation adds: a conversation's next turn is the work its first turn
        # stood for (counting it too, a replica whose conversations ran quicker would look
        # busy and push their later turns away from their history).
        continues = any(c == 1.0 for c in costs[: max(matches)])
        if not continues:
            self._recent(candidates[i]).add(1.0, now)
        if matches[i] == 0:
            reason = "least_loaded" if max(matches) == 0 else "load"
        else:
            reason = "prefix_match" if matches[i] == max(matches) else "load"
        return Route(candidates[i], reason, matches[i], blocks[i] - matches[i])

    def _recent(self, replica: Replica) -> RecentWork:
        return self.recent.setdefault(replica.url, RecentWork(self.recent_half_life_s))

    def _matched(self, replica: Replica, hashes: list[int]) -> int:
        """The prompt's leading blocks `replica` was sent, or 0 below the threshold's share."""
        matched = replica.index.match(hashes)
        return matched if hashes and matched >= self.threshold * len(hashes) else 0


def _in_pool(replica: Replica, hashes: list[int]) -> int:
    """The prompt's leading blocks the replica's device pool holds, as its KV events say
    (--kv-events); without events, every block it was sent counts as in its pool. Pure."""
    index = replica.index
    if isinstance(index, EventIndex):
        return index.match(hashes, MEDIUM_POOL)
    return index.match(hashes)


def make_policy(
    name: str,
    threshold: float = 0.0,
    balance_abs: int = 64,
    balance_rel: float = 1.5,
    load_weight: float = 1.0,
    recent_half_life_s: float = 120.0,
) -> RoundRobin | LeastLoaded | CacheAware:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "cache_aware":
        return CacheAware(threshold, balance_abs, balance_rel, load_weight, recent_half_life_s)
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")


def policy_for(settings: RouterSettings) -> RoundRobin | LeastLoaded | CacheAware:
    """The policy a router's settings name, with their parameters."""
    return make_policy(
        settings.policy,
        settings.threshold,
        settings.balance_abs,
        settings.balance_rel,
        settings.load_weight,
        settings.recent_half_life_s,
    )
