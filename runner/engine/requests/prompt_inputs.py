"""What `LLM`'s calls take, in vLLM's forms beside ours: prompt dicts (vLLM's TextPrompt
`{"prompt": text}` and TokensPrompt `{"prompt_token_ids": [...]}`, each with an optional
`cache_salt`), alone or in lists mixed with plain texts and token-id lists; `sampling_params=`
beside our `params=`; and `chat`'s template keywords (`chat_template`, `add_generation_prompt`,
`continue_final_message`, `tools`) merged with `chat_template_kwargs` as vLLM merges them.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple, Required, TypedDict

from runner.engine.requests.segmented_prompt import SegmentedPrompt
from runner.engine.requests.validation import Prompt, check_template_kwargs, prompt_batch
from runner.sampling.params import SamplingParams

# The keys of a prompt dict this engine reads: vLLM's TextPrompt and TokensPrompt (a
# TokensPrompt may carry its text as "prompt" too: its token ids are what runs).
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "segments", "blend_ratio", "cache_salt"})

Params = SamplingParams | Seq[SamplingParams] | None


class TextPrompt(TypedDict, total=False):
    """vLLM's TextPrompt: a prompt's text, and optionally the cache salt it runs under."""

    prompt: Required[str]
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's TokensPrompt: a prompt's token ids (which run), optionally its text and cache
    salt."""

    prompt_token_ids: Required[list[int]]
    prompt: str
    cache_salt: str


class PromptInput(NamedTuple):
    """One prompt as the engine queues it, and the cache salt it asked for (None: the call's)."""

    prompt: Prompt | SegmentedPrompt
    cache_salt: str | None = None


def prompt_inputs(prompts: object) -> list[PromptInput]:
    """`generate`'s prompts as a list of PromptInput: one text, token-id list or prompt dict is
    a batch of one. Raises ValueError naming the prompt and the problem."""
    batch: list[Any] = [prompts] if isinstance(prompts, Mapping) else prompt_batch(prompts)
    inputs = []
    for i, prompt in enumerate(batch):
        try:
            inputs.append(prompt_input(prompt))
        except ValueError as err:
            raise ValueError(f"prompt {i}: {err}") from err
    return inputs


def prompt_input(prompt: object) -> PromptInput:
    """One prompt: text and token-id lists as they are, a prompt dict read as vLLM's."""
    if not isinstance(prompt, Mapping):
        return PromptInput(prompt)  # type: ignore[arg-type]  # checked when it is queued
    unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
    if unknown:
        raise ValueError(
            f"prompt dict key(s) {', '.join(unknown)} are not supported; a prompt dict holds "
            "'prompt' (text), 'prompt_token_ids' or 'segments', and optionally 'cache_salt' "
            "(this engine runs text models: no multi-modal data)"
        )
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
    if "segments" in prompt:  # ours: a prompt whose later segments are cached on their own
        if "prompt" in prompt or "prompt_token_ids" in prompt:
            raise ValueError("a prompt dict holds 'segments' or 'prompt' / 'prompt_token_ids'")
        return PromptInput(SegmentedPrompt.of(prompt["segments"], prompt.get("blend_ratio")), salt)
    if "blend_ratio" in prompt:
        raise ValueError("blend_ratio applies to a prompt given as 'segments'")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list | tuple):
            raise ValueError(f"prompt_token_ids must be a list of ids, got {type(ids).__name__}")
        return PromptInput(list(ids), salt)
    if "prompt" not in prompt:
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    text = prompt["prompt"]
    if not isinstance(text, str):
        raise ValueError(f"'prompt' must be text, got {type(text).__name__}")
    return PromptInput(text, salt)


def sampling_params_arg(sampling_params: Params, params: Params) -> Params:
    """The one given of vLLM's `sampling_params` and our `params` (the same argument)."""
    if sampling_params is not None and params is not None:
        raise ValueError("pass sampling_params or params (the same thing), not both")
    return sampling_params if sampling_params is not None else params


def chat_template_options(
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict[str, object]] | None,
    chat_template_kwargs: Mapping[str, object] | None,
) -> dict[str, Any]:
    """What the chat template is called with, as vLLM's `chat` builds it: its keywords, then
    `chat_template_kwargs` over them. `continue_final_message` leaves the last (assistant)
    message open for the answer to go on, so no generation prompt may follow it."""
    options: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    if chat_template is not None:
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise ValueError("chat_template must be a non-empty Jinja template text")
        options["chat_template"] = chat_template
    if continue_final_message:
        options["continue_final_message"] = True
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("tools must be a list of tool objects (JSON schema dicts)")
        options["tools"] = tools
    if chat_template_kwargs is not None:
        check_template_kwargs(chat_template_kwargs)  # refused as everywhere else
        options.update(chat_template_kwargs)
    if options.get("continue_final_message") and options.get("add_generation_prompt"):
        raise ValueError(
            "continue_final_message=True goes on with the last message, so it cannot be "
            "combined with add_generation_prompt=True: pass add_generation_prompt=False"
        )
    return options
