"""What a finished request hands back to the user, in vLLM's shape (RequestOutput with its
CompletionOutputs, log-probabilities as {token id: Logprob} per position) with our additions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runner.engine.sequence import Sequence as Seq
from runner.sampling.logprobs import TokenLogprobs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Logprob:
    """One token's entry at one position, as vLLM's: its log-probability, its rank in the
    step's distribution (1 = likeliest) and its text alone (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PositionLogprobs(dict[int, Logprob]):
    """One position's log-probabilities in vLLM's shape, {token id: Logprob}: the token at
    that position and the N likeliest of its step. Ours stay beside it: `logprob`, that token's
    log-probability, and `top`, the N likeliest as (token id, log-probability), likeliest first
    (what TokenLogprobs held)."""

    __slots__ = ("logprob", "top")

    def __init__(
        self, token_id: int, entry: TokenLogprobs, decoded: Mapping[int, str | None]
    ) -> None:
        # The token first, then the top-N: a token among the top-N takes its rank there, as
        # vLLM's dict does.
        super().__init__()
        self[token_id] = Logprob(entry.logprob, entry.rank, decoded.get(token_id))
        for rank, (top_id, value) in enumerate(entry.top, start=1):
            self[top_id] = Logprob(value, rank, decoded.get(top_id))
        self.logprob = entry.logprob
        self.top = entry.top


class TokenTexts:
    """Each token's text decoded alone (vLLM's `decoded_token`), remembered once decoded: an
    engine's outputs name the same tokens again and again, and the tokenizer's batch decode
    costs ~2 us of CPU a token (SmolLM2's), beside ~0.5 us to look one up here. It holds at
    most one string per vocabulary entry."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self._known: dict[int, str] = {}

    def texts(self, token_ids: set[int]) -> dict[int, str]:
        """The text of each of `token_ids` (an empty map without a tokenizer), decoding only
        those not seen before, in one call."""
        if self.tokenizer is None:
            return {}
        missing = sorted(token_ids - self._known.keys())
        if missing:
            decoded = self.tokenizer.batch_decode([[i] for i in missing], skip_special_tokens=False)
            self._known.update(zip(missing, map(str, decoded), strict=True))
        return self._known


def vllm_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs | None] | None,
    token_texts: TokenTexts | None = None,
) -> list[PositionLogprobs | None] | None:
    """Per position of `token_ids`, its entry as a PositionLogprobs (None where there is
    none: a prompt's first token), each token's text from `token_texts`."""
    if entries is None:
        return None
    decoded: Mapping[int, str | None] = {}
    if token_texts is not None:
        ids = {t for t, e in zip(token_ids, entries, strict=True) if e is not None}
        ids.update(top_id for e in entries if e is not None for top_id, _ in e.top)
        decoded = token_texts.texts(ids)
    return [
        None if e is None else PositionLogprobs(t, e, decoded)
        for t, e in zip(token_ids, entries, strict=True)
    ]


def stop_reason_of(seq: Seq) -> int | str | None:
    """vLLM's stop_reason: the stop string or the stop_token_ids entry that ended the sequence;
    None when EOS, its length or anything else did."""
    if seq.finish_reason != "stop":
        return None
    return seq.stop_reason


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's shape): a request with SamplingParams.n = k has k.

    `logprobs` is vLLM's: per output token a PositionLogprobs ({token id: Logprob}, which also
    has our `.logprob` and `.top`); `token_logprobs` holds the same figures as TokenLogprobs.
    `stop_reason` is the stop string or stop token id that ended it (None for EOS or length)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int = 0  # prompt tokens this sample found in the cache
    logprobs: list[PositionLogprobs] | None = None
    metrics: dict[str, object] = field(default_factory=dict, repr=False)  # its own timings
    stop_reason: int | str | None = None
    token_logprobs: list[TokenLogprobs] | None = field(default=None, repr=False)

    @property
    def cumulative_logprob(self) -> float | None:
        """The log-probability of the whole output under the model (None without logprobs)."""
        return None if self.logprobs is None else sum(t.logprob for t in self.logprobs)

    def finished(self) -> bool:
        """vLLM's (a method there too): whether the sample has ended, i.e. has a finish
        reason."""
        return self.finish_reason is not None

    def to_record(self) -> dict[str, object]:
        return {
            "index": self.index,
            "text": self.text,
            "token_ids": self.token_ids,
            "cached_tokens": self.num_cached_tokens,
            "output_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
            **(
                {"logprobs": logprob_records(self.token_ids, self.token_logprobs)}
                if self.token_logprobs is not None
                else {}
            ),
        }


@dataclass
class RequestOutput:
    """One request's result, as vLLM's RequestOutput (request_id, prompt, prompt_token_ids,
    prompt_logprobs, outputs, finished, num_cached_tokens) plus flat fields. `token_ids`
    include the stop token (EOS) when one ended it; `text` is cut before a matched stop string
    and leaves special tokens out.

    `outputs` holds every sample (one unless SamplingParams.n asked for more); the flat fields
    (text, token_ids, finish_reason, stop_reason, logprobs, num_cached_tokens, metrics) are
    sample 0's. A RequestOutput is made when its request ends, so `finished` is True unless
    it was made by hand to say otherwise."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_cached_tokens: int
    finish_reason: str | None  # "stop" | "length" | "error" | "abort"
    metrics: dict[str, object] = field(default_factory=dict)
    error: str | None = None  # why the request failed, when finish_reason is "error"
    # Per token of token_ids, when SamplingParams.logprobs asked for them (vLLM's shape).
    logprobs: list[PositionLogprobs] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    # Per prompt token (None for the first), when SamplingParams.prompt_logprobs asked.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    stop_reason: int | str | None = None
    finished: bool = True
    token_logprobs: list[TokenLogprobs] | None = field(default=None, repr=False)
    prompt_token_logprobs: list[TokenLogprobs | None] | None = field(default=None, repr=False)
    # Prompt tokens served from later segments' own caches (a prompt given as segments),
    # beside num_cached_tokens' prefix; a fraction of them recomputed (blend_ratio).
    num_reused_segment_tokens: int = 0

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
                    self.stop_reason,
                    self.token_logprobs,
                )
            ]

    @classmethod
    def of(
        cls, seq: Seq, text: str, metrics: dict[str, object], token_texts: TokenTexts | None = None
    ) -> RequestOutput:
        """A finished (or aborted, or failed) sequence's output, with its decoded text;
        `token_texts` gives each log-probability's token its text (vLLM's decoded_token)."""
        raw = list(seq.output_logprobs) if seq.params.logprobs is not None else None
        prompt_raw = None if seq.prompt_logprobs is None else list(seq.prompt_logprobs)
        output_ids = list(seq.output_token_ids)
        logprobs = vllm_logprobs(output_ids, raw, token_texts)
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt_text,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=output_ids,
            text=text,
            num_cached_tokens=seq.num_cached_tokens,
            finish_reason=seq.finish_reason,
            metrics=metrics,
            logprobs=None if logprobs is None else [p for p in logprobs if p is not None],
            prompt_logprobs=vllm_logprobs(seq.prompt_token_ids, prompt_raw, token_texts),
            stop_reason=stop_reason_of(seq),
            token_logprobs=raw,
            prompt_token_logprobs=prompt_raw,
            num_reused_segment_tokens=seq.num_reused_segment_tokens,
        )

    @property
    def cumulative_logprob(self) -> float | None:
        """The log-probability of the whole output under the model (None without logprobs)."""
        return self.outputs[0].cumulative_logprob

    def to_record(self) -> dict[str, object]:
        """A JSON-ready dict, the shape `kvcache generate` writes per line; a request of
        several samples also lists each under "outputs"."""
        sample = self.outputs[0].to_record()  # the flat fields are sample 0's
        del sample["index"]
        prompt_entries = self.prompt_token_logprobs
        return {
            "id": self.request_id,
            "prompt_tokens": len(self.prompt_token_ids),
            **sample,
            **self.metrics,
            **(
                {"prompt_logprobs": logprob_records(self.prompt_token_ids, prompt_entries)}
                if prompt_entries is not None
                else {}
            ),
            **({"outputs": [o.to_record() for o in self.outputs]} if len(self.outputs) > 1 else {}),
            **({"error": self.error} if self.error else {}),
            **(
                {"reused_segment_tokens": self.num_reused_segment_tokens}
                if self.num_reused_segment_tokens
                else {}
            ),
        }


def logprob_records(
    token_ids: list[int], logprobs: Sequence[TokenLogprobs | None] | None
) -> list[dict[str, object] | None]:
    """Per token: its id, its log-probability and the likeliest [id, logprob] (None where
    there is none: a prompt's first token)."""
    return [
        None
        if lp is None
        else {"token_id": token, "logprob": lp.logprob, "top_logprobs": [list(t) for t in lp.top]}
        for token, lp in zip(token_ids, logprobs or [], strict=True)
    ]
