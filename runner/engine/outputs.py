"""What a finished request hands back to the user."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runner.engine.sequence import Sequence as Seq
from runner.sampling.logprobs import TokenLogprobs


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's shape): a request with SamplingParams.n = k has k."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int = 0  # prompt tokens this sample found in the cache
    logprobs: list[TokenLogprobs] | None = None
    metrics: dict[str, Any] = field(default_factory=dict, repr=False)  # its own timings

    @property
    def cumulative_logprob(self) -> float | None:
        """The log-probability of the whole output under the model (None without logprobs)."""
        return None if self.logprobs is None else sum(t.logprob for t in self.logprobs)

    def to_record(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.text,
            "token_ids": self.token_ids,
            "cached_tokens": self.num_cached_tokens,
            "output_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
            **(
                {"logprobs": logprob_records(self.token_ids, self.logprobs)}
                if self.logprobs is not None
                else {}
            ),
        }


@dataclass
class RequestOutput:
    """One request's result. `token_ids` include the stop token (EOS) when one ended it;
    `text` is cut before a matched stop string and leaves special tokens out.

    `outputs` holds every sample (one unless SamplingParams.n asked for more); the flat fields
    (text, token_ids, finish_reason, logprobs, num_cached_tokens, metrics) are sample 0's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_cached_tokens: int
    finish_reason: str | None  # "stop" | "length" | "error" | "abort"
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the request failed, when finish_reason is "error"
    # Per token of token_ids, when SamplingParams.logprobs asked for them.
    logprobs: list[TokenLogprobs] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    # Per prompt token (None for the first), when SamplingParams.prompt_logprobs asked.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [
                CompletionOutput(
                    0,
                    self.text,
                    self.token_ids,
                    self.finish_reason,
                    self.num_cached_tokens,
                    self.logprobs,
                    self.metrics,
                )
            ]

    @classmethod
    def of(cls, seq: Seq, text: str, metrics: dict[str, Any]) -> RequestOutput:
        """A finished (or aborted, or failed) sequence's output, with its decoded text."""
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt_text,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=text,
            num_cached_tokens=seq.num_cached_tokens,
            finish_reason=seq.finish_reason,
            metrics=metrics,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=None if seq.prompt_logprobs is None else list(seq.prompt_logprobs),
        )

    @property
    def cumulative_logprob(self) -> float | None:
        """The log-probability of the whole output under the model (None without logprobs)."""
        return self.outputs[0].cumulative_logprob

    def to_record(self) -> dict[str, Any]:
        """A JSON-ready dict, the shape `kvcache generate` writes per line; a request of
        several samples also lists each under "outputs"."""
        sample = self.outputs[0].to_record()  # the flat fields are sample 0's
        del sample["index"]
        return {
            "id": self.request_id,
            "prompt_tokens": len(self.prompt_token_ids),
            **sample,
            **self.metrics,
            **(
                {"prompt_logprobs": logprob_records(self.prompt_token_ids, self.prompt_logprobs)}
                if self.prompt_logprobs is not None
                else {}
            ),
            **({"outputs": [o.to_record() for o in self.outputs]} if len(self.outputs) > 1 else {}),
            **({"error": self.error} if self.error else {}),
        }


def logprob_records(
    token_ids: list[int], logprobs: Sequence[TokenLogprobs | None] | None
) -> list[dict[str, Any] | None]:
    """Per token: its id, its log-probability and the likeliest [id, logprob] (None where
    there is none: a prompt's first token)."""
    return [
        None
        if lp is None
        else {"token_id": token, "logprob": lp.logprob, "top_logprobs": [list(t) for t in lp.top]}
        for token, lp in zip(token_ids, logprobs or [], strict=True)
    ]
