"""Which decode worker takes a handover. With the cache-aware policy (the router's default) it
is chosen as `kvcache router` chooses a replica: the worker already holding most of the prompt's
leading blocks (an earlier turn of the conversation, a shared system prompt), weighed against
the work it has (runner/router/policy.py). Blocks a decode worker holds are not sent, so a
conversation that stays on one decode worker hands over only its new blocks. The prompt's token
ids come with the handover's params, so no tokenizer is needed; the other policies take the
least busy worker."""

from __future__ import annotations

from typing import Any

from runner.router.policy import make_policy
from runner.router.prompt_hashes import PromptHasher
from runner.router.proxy import RouterSettings
from runner.router.replicas import Replica


class DecodeChooser:
    def __init__(self, settings: RouterSettings) -> None:
        self.policy = make_policy(
            settings.policy,
            settings.threshold,
            settings.balance_abs,
            settings.balance_rel,
            settings.load_weight,
            settings.recent_half_life_s,
        )
        self.hasher = PromptHasher(tokenizer=None)  # hashes only: the params carry token ids
        self.reasons: dict[str, int] = {}

    def choose(self, candidates: list[Replica], params: dict[str, Any]) -> Replica:
        """The decode worker among ``candidates`` (healthy, not empty) for the handover
        ``params`` describe; what it was sent is indexed as its cache's."""
        tokens = params.get("prompt_token_ids")
        if not self.policy.uses_prefixes or not isinstance(tokens, list):
            return min(candidates, key=lambda r: (r.in_flight, r.sent))
        salt = params.get("cache_salt")
        hashes: dict[str, list[int]] = {}  # per worker: each names blocks by its own model

        def hashes_of(replica: Replica) -> list[int]:
            if replica.info is None:
                return []
            if replica.url not in hashes:
                hashes[replica.url] = self.hasher.hashes(tokens, replica.info, salt)
            return hashes[replica.url]

        route = self.policy.choose(candidates, hashes_of)
        route.replica.index.insert(hashes_of(route.replica))
        self.reasons[route.reason] = self.reasons.get(route.reason, 0) + 1
        return route.replica
