"""Which prefill and which decode worker take a request. With the cache-aware policy (the
router's default) each is chosen as `kvcache router` chooses a replica (runner/router/policy.py):
the worker already holding most of the prompt's leading blocks (an earlier turn of the
conversation, a shared system prompt), weighed against the work it has. A prefill worker that
holds them computes only the rest; a decode worker that holds them is not sent them. The
prefill side tokenizes the prompt as `kvcache router` does (the model's tokenizer, found
through a worker's /kvcache/info, or --tokenizer); the decode side takes the token ids from
the handover's params. Without token ids, or with another policy, the least busy worker."""

from __future__ import annotations

from typing import Any

from runner.router.policy import make_policy
from runner.router.prompt_hashes import PromptHasher
from runner.router.proxy import RouterSettings
from runner.router.replicas import Replica


class WorkerChoice:
    """Chooses among one kind of worker (its own record of what each was sent)."""

    def __init__(self, settings: RouterSettings) -> None:
        self.policy = make_policy(
            settings.policy,
            settings.threshold,
            settings.balance_abs,
            settings.balance_rel,
            settings.load_weight,
            settings.recent_half_life_s,
        )
        self.hasher = PromptHasher(tokenizer=None)  # hashes only: token ids come given
        self.reasons: dict[str, int] = {}

    def choose(self, candidates: list[Replica], tokens: Any, cache_salt: Any) -> Replica:
        """The worker among ``candidates`` (healthy, not empty) for a prompt of ``tokens``
        (token ids, or None where unknown); what it was sent is indexed as its cache's."""
        if not self.policy.uses_prefixes or not isinstance(tokens, list):
            return min(candidates, key=lambda r: (r.in_flight, r.sent))
        hashes: dict[str, list[int]] = {}  # per worker: each names blocks by its own model

        def hashes_of(replica: Replica) -> list[int]:
            if replica.info is None:
                return []
            if replica.url not in hashes:
                hashes[replica.url] = self.hasher.hashes(tokens, replica.info, cache_salt)
            return hashes[replica.url]

        route = self.policy.choose(candidates, hashes_of)
        route.replica.index.insert(hashes_of(route.replica))
        self.reasons[route.reason] = self.reasons.get(route.reason, 0) + 1
        return route.replica
