"""Which prefill and which decode worker take a request. With the cache-aware policy (the
router's default) each is chosen as `kvcache router` chooses a replica (runner/router/policy.py):
the worker already holding most of the prompt's leading blocks (an earlier turn of the
conversation, a shared system prompt), weighed against the work it has. A prefill worker that
holds them computes only the rest; a decode worker that holds them is not sent them. The
prefill side tokenizes the prompt as `kvcache router` does (the model's tokenizer, found
through a worker's /kvcache/info, or --tokenizer); the decode side takes the token ids from
the handover's params. Without token ids, or with another policy, the least busy worker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from runner.router.policy import policy_for
from runner.router.prompt_hashes import PromptHasher, load_prompt_hasher, replica_hashes
from runner.router.proxy import RouterSettings
from runner.router.replicas import Replica

log = logging.getLogger(__name__)


class PromptTokens:
    """The token ids of request bodies for a cache-aware choice, through the model's
    tokenizer (``path``: --tokenizer, else the folder a worker's /kvcache/info names), loaded on
    first use. A tokenizer that cannot be loaded is warned once and not tried again: the
    requests then go to the least busy worker, never fail for it."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.hasher: PromptHasher | None = None
        self.failed = False

    async def load(self, workers: Sequence[Replica]) -> PromptHasher | None:
        """The hasher, loaded now if it is not yet (None: no worker has answered yet, or the
        tokenizer cannot be loaded)."""
        if self.hasher is None and not self.failed:
            try:
                self.hasher = await load_prompt_hasher(self.path, workers)
            except (OSError, ValueError, KeyError) as err:  # no tokenizer files, bad --tokenizer
                self.failed = True
                log.warning("no tokenizer for the cache-aware choice (least busy instead): %s", err)
        return self.hasher

    async def of(
        self, path: str, body: dict[str, Any], workers: Sequence[Replica]
    ) -> list[int] | None:
        hasher = await self.load(workers)
        if hasher is None:
            return None
        # Off the event loop: a 3,000-token prompt takes ~5 ms to tokenize (the tokenizer lets
        # go of the interpreter's lock), and meanwhile every stream the router relays waited.
        return await asyncio.to_thread(hasher.token_ids, path, body)


class WorkerChoice:
    """Chooses among one kind of worker (its own record of what each was sent)."""

    def __init__(self, settings: RouterSettings) -> None:
        self.policy = policy_for(settings)
        self.hasher = PromptHasher(tokenizer=None)  # hashes only: token ids come given
        self.reasons: dict[str, int] = {}

    def choose(self, candidates: list[Replica], tokens: object, cache_salt: object) -> Replica:
        """The worker among ``candidates`` (healthy, not empty) for a prompt of ``tokens``
        (token ids, or None where unknown); what it was sent is indexed as its cache's."""
        if not self.policy.uses_prefixes or not isinstance(tokens, list):
            return min(candidates, key=lambda r: (r.in_flight, r.sent))
        hashes_of = replica_hashes(self.hasher, tokens, cache_salt)

        route = self.policy.choose(candidates, hashes_of)
        route.replica.index.insert(hashes_of(route.replica))
        self.reasons[route.reason] = self.reasons.get(route.reason, 0) + 1
        return route.replica
