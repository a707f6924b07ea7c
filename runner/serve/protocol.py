"""The OpenAI request bodies the server takes, with OpenAI's field names and vLLM's extra ones
(sampling, structured outputs, echo, prompt_logprobs, the chat template's options, tools), and
how each maps onto SamplingParams. A field the server does not know is ignored, as vLLM's
server ignores it (the app logs it once: messages' Lenient); a known field
with a bad value is a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from runner.engine.requests.segmented_prompt import SegmentedPrompt
from runner.sampling.params import SamplingParams
from runner.sampling.structured_outputs import StructuredOutputsParams
from runner.serve.messages import ChatMessage, JsonObject, Lenient, template_messages
from runner.serve.structured import StructureFields, compact_json_grammar
from runner.serve.tool_calls import chosen_function, forced_schema, tool_names

TokenIds = list[int]


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(StructureFields):
    """The fields both endpoints share. Ranges are checked here where OpenAI states them;
    SamplingParams.validate checks the rest, and its message names the field too."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    cache_salt: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's, a lower value the more urgent request: admitted first under priority scheduling,
    # its blocks kept longer under priority eviction.
    priority: int = 0

    def _sampling(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structure: StructuredOutputsParams | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """SamplingParams of this request; ValueError (naming the field) when out of range."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            n=self.n,
            min_tokens=self.min_tokens,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,  # type: ignore[arg-type]
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structure,
        )

    def sampling_params(self) -> SamplingParams:
        """The request's SamplingParams; ValueError naming the field when one is bad."""
        raise NotImplementedError  # each endpoint's request says how its fields map

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt (text or token ids) or a list of them; or, ours, one
    prompt as `segments` whose later segments are cached on their own (docs/SEGMENTS.md)."""

    prompt: str | list[str] | TokenIds | list[TokenIds] | None = None
    segments: list[str | TokenIds] | None = None
    blend_ratio: float | None = Field(None, ge=0.0, le=1.0)
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: object) -> object:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("must hold at least one prompt (an empty list asks for nothing)")
        return prompt

    @model_validator(mode="after")
    def _one_prompt_form(self) -> CompletionRequest:
        if (self.prompt is None) == (self.segments is None):
            raise ValueError("prompt is required (or segments in its place; not both)")
        if self.blend_ratio is not None and self.segments is None:
            raise ValueError("blend_ratio applies to a prompt given as segments")
        if self.segments is not None:
            try:  # a bad one is a 400 here, naming the field
                SegmentedPrompt.of(self.segments, self.blend_ratio)
            except ValueError as err:
                message = str(err)
                raise ValueError(
                    message
                    if message.startswith(("segments", "blend_ratio"))
                    else f"segments: {err}"
                ) from err
        return self

    def prompts(self) -> list[str | TokenIds | SegmentedPrompt]:
        """The prompts, one per engine request (a flat list of ints is one prompt)."""
        if self.segments is not None:
            return [SegmentedPrompt.of(self.segments, self.blend_ratio)]
        prompt = self.prompt
        assert prompt is not None  # _one_prompt_form
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        unsupported(suffix=self.suffix is not None)
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of equal to n (or none) is supported")
        # echo with logprobs: the prompt's tokens get theirs too (as vLLM's server gives them)
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        if prompt_logprobs is not None and self.prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs, self.prompt_logprobs)
        return self._sampling(self.max_tokens, self.logprobs, self.structure(), prompt_logprobs)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: one conversation, with the tools it may call."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[JsonObject] | None = None
    tool_choice: Literal["none", "auto", "required"] | JsonObject | None = None
    parallel_tool_calls: bool | None = None  # false: a required choice makes one call
    echo: bool = False  # vLLM's: the answer begins with the last message when it is the model's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _well_formed_tools(cls, tools: list[JsonObject] | None) -> list[JsonObject] | None:
        if tools is not None:
            tool_names(tools)  # ValueError naming the malformed tool
        return tools

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens  # None: the context's room
        return self._sampling(max_tokens, logprobs, self._structure_with_tools())

    def tool_mode(self) -> str | None:
        """None without tools (or with tool_choice "none"); else "auto", "required" or
        "named"; ValueError for a choice that names no offered function."""
        tools = self.tools or []
        named = chosen_function(self.tool_choice, tool_names(tools))
        if self.tool_choice == "required" or named is not None:
            return "named" if named is not None else "required"
        if not tools or self.tool_choice == "none":
            return None
        return "auto"

    def _structure_with_tools(self) -> StructuredOutputsParams | None:
        """The request's structure, or for a required or named tool choice the schema of its
        calls (so their arguments always parse), which no other structure may join."""
        structure = self.structure()
        if self.tool_mode() not in ("required", "named"):
            return structure
        if structure is not None:
            raise ValueError(
                "tool_choice: a required or named tool choice shapes the answer itself; "
                "drop response_format / structured_outputs"
            )
        parallel = self.parallel_tool_calls is not False
        schema = forced_schema(self.tools or [], self.tool_choice, parallel)
        return StructuredOutputsParams(grammar=compact_json_grammar(schema or {}, "tools"))

    def template_messages(self) -> list[JsonObject]:
        """The messages as the chat template gets them; ValueError naming a bad one."""
        return template_messages(self.messages)

    def template_options(self) -> dict[str, object]:
        """The chat template's keyword arguments, as vLLM builds them: the request's own
        options, then chat_template_kwargs over them (the tools are added by the renderer)."""
        options: dict[str, object] = {"add_generation_prompt": self.add_generation_prompt}
        if self.continue_final_message:
            options["continue_final_message"] = True
        if self.chat_template is not None:
            options["chat_template"] = self.chat_template
        options.update(self.chat_template_kwargs or {})
        if options.get("continue_final_message") and options.get("add_generation_prompt"):
            raise ValueError(
                "continue_final_message: it goes on with the last message, so it needs "
                "add_generation_prompt set to false"
            )
        return options

    def sends_template(self) -> bool:
        """Whether the client sent a template of its own (chat_template, top-level or in
        chat_template_kwargs)."""
        return self.chat_template is not None or "chat_template" in (
            self.chat_template_kwargs or {}
        )


def samples_per_prompt(body: SamplingFields) -> int:
    """The sequences each prompt of `body` becomes: n (or best_of, where larger)."""
    best_of = getattr(body, "best_of", None) or 0
    return max(body.n, best_of)


def unsupported(**given: bool) -> None:
    """ValueError naming the first OpenAI field given that this server does not implement."""
    for name, is_set in given.items():
        if is_set:
            raise ValueError(f"{name}: not supported by this server")


def field_named(message: str, default: str | None = None) -> str | None:
    """The request field an engine's ValueError is about: its first word when that is a field
    (SamplingParams' messages all start with the field's name), else `default`."""
    head = message.split(" ", 1)[0].rstrip(":").split("[", 1)[0]
    fields = CompletionRequest.model_fields.keys() | ChatCompletionRequest.model_fields.keys()
    return head if head in fields else default
