"""A request's prompt as the replica's engine will see it (its token ids, through the model's
tokenizer and chat template, as runner/serve does it), and the chained block hashes the engine
will name its blocks by (kvcache.block_hashes, rooted in the replica's model fingerprint and
the request's cache_salt)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvcache import block_hashes, namespace_root
from runner.engine.requests.validation import render_chat
from runner.router.replicas import BlockNaming, Replica
from runner.serve.json_types import JSONObject
from runner.serve.protocol import ChatMessage

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class PromptHasher:
    """Token ids and block hashes of request bodies; None where a body has no prompt this can
    read, or asks for its own chat template (the replica then answers it, with its 400 if it
    is bad)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self._roots: dict[tuple[str, str | None], int] = {}

    def token_ids(self, path: str, body: JSONObject) -> list[int] | None:
        try:
            if path.endswith("/chat/completions"):
                template_kwargs = body.get("chat_template_kwargs")
                if template_kwargs is not None and not isinstance(template_kwargs, dict):
                    return None  # not a dict of names: the replica refuses it
                if "chat_template" in (template_kwargs or {}):
                    # A client's own template is code the router does not run: a loop in it
                    # could hold a thread for minutes (issue 42). The request is routed by
                    # load alone, and the replica renders it, or refuses it.
                    return None
                given = body["messages"]
                if not isinstance(given, list):
                    return None  # no conversation: the replica refuses it
                messages = [ChatMessage.model_validate(m).as_template_message() for m in given]
                text = render_chat(self.tokenizer, messages, template_kwargs)
                assert self.tokenizer is not None  # render_chat needs one
                return list(self.tokenizer(text, add_special_tokens=False).input_ids)
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a batch is routed by its first prompt
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    return None  # hashes only: no text is tokenized
                return list(self.tokenizer(prompt, add_special_tokens=True).input_ids)
            if isinstance(prompt, list):
                ids = [t for t in prompt if isinstance(t, int)]
                return ids if len(ids) == len(prompt) else None
        except (KeyError, TypeError, ValueError):
            return None
        return None

    def hashes(self, token_ids: list[int], naming: BlockNaming, cache_salt: object) -> list[int]:
        """The chained hashes of the prompt's full blocks on a replica that names its blocks
        by `naming`."""
        salt = cache_salt if isinstance(cache_salt, str) else None
        key = (naming.fingerprint, salt)
        if key not in self._roots:
            self._roots[key] = namespace_root(key[0], salt)
        return block_hashes(token_ids, naming.block_size, self._roots[key])


def replica_hashes(
    hasher: PromptHasher | None, token_ids: list[int] | None, cache_salt: object
) -> Callable[[Replica], list[int]]:
    """A replica -> the prompt's block hashes as it names them (computed once per replica:
    replicas may name blocks otherwise); [] where the prompt or the replica's naming is not
    known (a replica without a usable fingerprint and block size holds no known prefix)."""
    hashes: dict[str, list[int]] = {}

    def hashes_of(replica: Replica) -> list[int]:
        naming = replica.naming
        if token_ids is None or hasher is None or naming is None:
            return []
        if replica.url not in hashes:
            hashes[replica.url] = hasher.hashes(token_ids, naming, cache_salt)
        return hashes[replica.url]

    return hashes_of


async def load_prompt_hasher(path: str | None, replicas: Sequence[Replica]) -> PromptHasher | None:
    """A hasher with the prompts' tokenizer: ``path`` (--tokenizer), else the folder the first
    replica that answered with a usable naming reports for its model (same machine); None
    while none has."""
    if path is None:
        reported = (r.info.get("model_path") for r in replicas if r.info and r.naming)
        path = next((p for p in reported if isinstance(p, str) and p), None)
    if path is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
    return PromptHasher(tokenizer)
