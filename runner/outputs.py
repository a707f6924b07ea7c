"""What a finished request hands back to the user."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runner.logprobs import TokenLogprobs


@dataclass
class RequestOutput:
    """One request's result. `token_ids` include the stop token (EOS) when one ended it;
    `text` is cut before a matched stop string and leaves special tokens out."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_cached_tokens: int
    finish_reason: str | None  # "stop" | "length" | "error"
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the request failed, when finish_reason is "error"
    # Per token of token_ids, when SamplingParams.logprobs asked for them.
    logprobs: list[TokenLogprobs] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The log-probability of the whole output under the model (None without logprobs)."""
        return None if self.logprobs is None else sum(t.logprob for t in self.logprobs)

    def to_record(self) -> dict[str, Any]:
        """A JSON-ready dict, the shape `kvcache generate` writes per line."""
        return {
            "id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": len(self.prompt_token_ids),
            "cached_tokens": self.num_cached_tokens,
            "output_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
            **self.metrics,
            **({"logprobs": self._logprob_records()} if self.logprobs is not None else {}),
            **({"error": self.error} if self.error else {}),
        }

    def _logprob_records(self) -> list[dict[str, Any]]:
        return [
            {"token_id": token, "logprob": lp.logprob, "top_logprobs": [list(t) for t in lp.top]}
            for token, lp in zip(self.token_ids, self.logprobs or [], strict=True)
        ]
