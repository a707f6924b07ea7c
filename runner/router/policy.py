"""Which replica gets a request.

- round_robin: each in turn.
- least_loaded: the fewest requests in flight from this router (ties: the fewest sent so far).
- cache_aware (SGLang's rule): when the replicas' loads are unbalanced (the busiest has more
  than `balance_abs` requests over the idlest and more than `balance_rel` times as many) the
  least loaded; otherwise the replica whose prefix index matches the most leading blocks of the
  prompt, if that covers at least `threshold` of the prompt's blocks, else the least loaded.
  Affinity alone would pile every conversation onto the replica that served its first turn;
  new prefixes going to the least loaded replica and the imbalance rule keep the spread.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from runner.router.replicas import Replica

POLICIES = ("cache_aware", "round_robin", "least_loaded")
HashesOf = Callable[[Replica], list[int]]


@dataclass(frozen=True)
class Route:
    replica: Replica
    reason: str  # round_robin | least_loaded | prefix_match | balance
    matched_blocks: int = 0


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
        self, threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold, self.balance_abs, self.balance_rel = threshold, balance_abs, balance_rel

    def choose(self, candidates: list[Replica], hashes_of: HashesOf) -> Route:
        loads = [r.in_flight for r in candidates]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > self.balance_abs and busiest > idlest * self.balance_rel:
            return Route(least_loaded(candidates), "balance")
        best: Replica | None = None
        best_match, best_share = 0, 0.0
        for replica in candidates:
            hashes = hashes_of(replica)
            matched = replica.index.match(hashes)
            share = matched / len(hashes) if hashes else 0.0
            better = share > best_share or (
                best is not None
                and share == best_share
                and matched > 0
                and (replica.in_flight, replica.sent) < (best.in_flight, best.sent)
            )
            if better:
                best, best_match, best_share = replica, matched, share
        if best is not None and best_share >= self.threshold and best_match > 0:
            return Route(best, "prefix_match", best_match)
        return Route(least_loaded(candidates), "least_loaded")


def make_policy(
    name: str, threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5
) -> RoundRobin | LeastLoaded | CacheAware:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "cache_aware":
        return CacheAware(threshold, balance_abs, balance_rel)
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")
