"""The OpenAI request bodies the server takes, with OpenAI's field names (and vLLM's extra
sampling fields), and how each maps onto SamplingParams. Unknown fields are refused
(`extra="forbid"`): a misspelt option is a 400 naming it, never silently ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from runner.sampling.params import SamplingParams
from runner.sampling.structured_outputs import StructuredOutputsParams

TokenIds = list[int]


class Strict(BaseModel):
    # Python's json (which reads the body) takes NaN and Infinity: refused as not finite,
    # never compared with a range (NaN "should be <= 2" named the wrong problem).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(Strict):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class ContentPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The {role, content} dict chat templates read (text parts joined; "developer" is
        OpenAI's newer name for "system")."""
        content = self.content
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class SamplingFields(Strict):
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
    response_format: ResponseFormat | None = None
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

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
            n=self.n,
            min_tokens=self.min_tokens,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,  # type: ignore[arg-type]
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self._structure(),
        )

    def _structure(self) -> StructuredOutputsParams | None:
        """response_format as structured outputs: json_schema holds the answer to the schema,
        json_object to any JSON object; "text" (or none) leaves it free."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    def sampling_params(self) -> SamplingParams:
        """The request's SamplingParams; ValueError naming the field when one is bad."""
        raise NotImplementedError  # each endpoint's request says how its fields map

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt (text or token ids) or a list of them."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
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

    def prompts(self) -> list[str | TokenIds]:
        """The prompts, one per engine request (a flat list of ints is one prompt)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        unsupported(echo=self.echo, suffix=self.suffix is not None)
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of equal to n (or none) is supported")
        return self._sampling(self.max_tokens, self.logprobs)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: one conversation."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens  # None: the context's room
        return self._sampling(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_message() for m in self.messages]


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
