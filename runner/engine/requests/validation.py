"""Checks a request before it is queued, so bad input fails alone with a clear message."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.sampling.logit_rules import stop_ids_of
from runner.sampling.params import SamplingParams
from runner.sampling.text_checks import check_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int]
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class RequestValidator:
    vocab_size: int
    max_model_len: int
    pool_tokens: int  # KV slots in the whole pool
    block_size: int
    has_tokenizer: bool = True
    eos_ids: frozenset[int] = frozenset()

    def fit(self, token_ids: list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompt and params a request runs with: the prompt cut to its last
        `truncate_prompt_tokens`, `max_tokens` None made the room the context leaves (in a
        copy: the caller's params stay as they are); both then `check`ed."""
        if isinstance(params, SamplingParams):
            params.validate()  # before the cut, which needs a valid length
            if params.truncate_prompt_tokens is not None:
                token_ids = token_ids[-params.truncate_prompt_tokens :]
            if params.max_tokens is None:
                params = dataclasses.replace(params, max_tokens=self.room(token_ids, None))
        self.check(token_ids, params)
        return token_ids, params

    def room(self, token_ids: Sequence[object], max_tokens: int | None) -> int:
        """The new tokens a request may make: `max_tokens`, or for None the room the context
        leaves after the prompt (at least 1: a prompt that fills it fails `check`)."""
        return max_tokens if max_tokens is not None else max(1, self.max_model_len - len(token_ids))

    def check(self, token_ids: Sequence[object], params: object) -> None:
        """Raise ValueError naming the problem; returns quietly when the request can run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        self._check_token_rules(params)
        if params.bad_words and not self.has_tokenizer:
            raise ValueError(
                "bad_words need a tokenizer to spell them in tokens, and this model has none"
            )
        if params.stop_strings and not self.has_tokenizer:
            raise ValueError(
                "stop strings need a tokenizer to read the text, and this model has none: "
                "use stop_token_ids instead"
            )
        if not token_ids:
            raise ValueError("prompt is empty")
        for position, token in enumerate(token_ids):
            if not isinstance(token, int) or isinstance(token, bool):
                raise ValueError(f"prompt token {position} is not an integer: {token!r}")
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"prompt token {position} is {token}, outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the model's context holds "
                f"{self.max_model_len} (prompt plus at least one new token)"
            )
        # A request whose prompt and answer cannot fit even in an empty pool would wait forever.
        max_tokens = params.max_tokens or self.max_model_len  # None: the context's room
        total = min(len(token_ids) + max_tokens, self.max_model_len)
        blocks = -(-total // self.block_size)
        pool_blocks = self.pool_tokens // self.block_size
        if blocks > pool_blocks:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({max_tokens}) needs "
                f"{blocks} KV blocks, but the pool holds only {pool_blocks} blocks "
                f"({self.pool_tokens} tokens); raise num_kv_blocks or lower max_tokens"
            )

    def _check_token_rules(self, params: SamplingParams) -> None:
        """Token ids a request's logit rules name must be in the vocabulary, and its allowed
        tokens must leave one to sample while min_tokens bans the stop tokens."""
        named = [("allowed_token_ids", t) for t in params.allowed_token_ids or ()]
        named += [("stop_token_ids", t) for t in params.stop_token_ids or ()]
        named += [("logit_bias", t) for t, _ in params.bias_items]
        for field_name, token in named:
            if token >= self.vocab_size:
                raise ValueError(
                    f"{field_name} names token {token}, outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        if params.allowed_token_ids and params.min_tokens > 0:
            if set(params.allowed_token_ids) <= stop_ids_of(params, self.eos_ids):
                raise ValueError(
                    "allowed_token_ids holds only tokens that end the request, which "
                    "min_tokens bans: nothing would be left to sample"
                )

    @staticmethod
    def check_messages(messages: object) -> None:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
            for key in ("role", "content"):
                if message.get(key) is None and key == "content" and message.get("tool_calls"):
                    continue  # an assistant's tool calls come without content (OpenAI's null)
                if not isinstance(message.get(key), str):
                    raise ValueError(f"messages[{i}] needs a string {key!r}")
                check_text(f"messages[{i}].{key}", message[key])


def check_template_kwargs(template_kwargs: object) -> dict[str, Any]:
    """The chat template's keyword arguments, `add_generation_prompt` True unless given;
    ValueError for anything but a dict of names, or one that sets `tokenize`."""
    if template_kwargs is None:
        template_kwargs = {}
    if not isinstance(template_kwargs, Mapping) or not all(
        isinstance(k, str) and k.isidentifier() for k in template_kwargs
    ):
        raise ValueError(
            f"chat_template_kwargs must be a dict of names to values, got {template_kwargs!r}"
        )
    if "tokenize" in template_kwargs:
        raise ValueError("chat_template_kwargs cannot set tokenize: the engine tokenizes")
    return {"add_generation_prompt": True, **template_kwargs}


def prompt_token_ids(
    prompt: object, tokenizer: PreTrainedTokenizerBase | None, add_special_tokens: bool
) -> list[int]:
    """Token ids of a text prompt (through the tokenizer) or of a list/tuple of ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids instead")
        check_text("prompt", prompt)
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
    if isinstance(prompt, list | tuple):
        return [_plain_int(token) for token in prompt]
    raise ValueError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")


def _plain_int(token: object) -> Any:
    """A numpy (or other) integer as the int it is; anything else as it is, for `check`."""
    if isinstance(token, numbers.Integral) and not isinstance(token, int | bool):
        return int(token)
    return token


def prompt_batch(prompts: object) -> list[Prompt]:
    """`generate`'s prompts as a list: one text or one list of ids is a batch of one."""
    if not isinstance(prompts, str | list | tuple):
        raise ValueError(
            f"prompts must be text, token ids or a list of them, got {type(prompts).__name__}"
        )
    single = isinstance(prompts, str) or (
        bool(prompts) and isinstance(prompts[0], numbers.Integral)  # numpy's too
    )
    return [prompts] if single else list(prompts)  # type: ignore[list-item]


def conversation_batch(conversations: object) -> list[Messages]:
    """`chat`'s conversations as a list: one list of messages is a batch of one."""
    if not isinstance(conversations, list | tuple):
        raise ValueError(
            "conversations must be a list of {role, content} messages or a list of such "
            f"lists, got {type(conversations).__name__}"
        )
    single = bool(conversations) and isinstance(conversations[0], dict)
    return [list(conversations)] if single else list(conversations)


def params_per_prompt(params: object, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: None (defaults) or one for all, or a list of that length."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * num_prompts
    if not isinstance(params, Iterable) or isinstance(params, str | Mapping):
        raise ValueError(
            f"params must be SamplingParams or a list of them, got {type(params).__name__}"
        )
    param_list = list(params)
    if len(param_list) != num_prompts:
        raise ValueError(f"got {len(param_list)} SamplingParams for {num_prompts} prompts")
    return param_list


def joined_text_parts(messages: Messages) -> Messages:
    """`messages` with OpenAI's list content (`[{"type": "text", "text": ...}, ...]`) joined
    into one string by newlines, as vLLM gives it to text-only templates, and an assistant's
    missing or null content (its tool calls' message) as "", as vLLM renders it; other
    messages as they are."""
    if not isinstance(messages, list):
        return messages
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if content is None and isinstance(message, dict) and message.get("role") == "assistant":
            message = {**message, "content": ""}
        if isinstance(content, list) and all(
            isinstance(p, dict)
            and p.get("type") in ("text", "input_text")
            and isinstance(p.get("text"), str)
            for p in content
        ):
            message = {**message, "content": "\n".join(p["text"] for p in content)}
        out.append(message)
    return out


def render_chat(
    tokenizer: PreTrainedTokenizerBase | None,
    messages: Messages,
    template_kwargs: Mapping[str, object] | None = None,
) -> str:
    """The prompt text of one conversation, through the model's chat template, which also
    sees `template_kwargs` (such as Qwen3's `enable_thinking`; `add_generation_prompt`, True
    by default, may be turned off)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so no chat template: pass token ids")
    options = check_template_kwargs(template_kwargs)
    if not getattr(tokenizer, "chat_template", None) and not options.get("chat_template"):
        raise ValueError("this model has no chat template: pass prompt text instead")
    messages = joined_text_parts(messages)
    RequestValidator.check_messages(messages)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    except Exception as err:  # jinja's TemplateError: "roles must alternate", ...
        raise ValueError(f"the chat template rejected the messages: {err}") from err
    return str(text)
