"""SamplingParams: how a request picks its tokens (vLLM's names), checked in one place."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from runner.sampling.structured_outputs import StructuredOutputsParams
from runner.sampling.text_checks import check_text

_GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # vLLM's default cap: each costs a top-k column and a host transfer
MAX_SAMPLES = 1024  # samples per request: each is a sequence of its own, queued at once
# Per-request bounds on fields whose cost grows with their size on every step (a stop string
# is looked for in each new piece of text; each logit_bias entry is a write into the logits):
# past them one request slowed every other request's stream.
MAX_LOGIT_BIAS = 2048  # logit_bias entries
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class SamplingParams:
    """How to pick each next token; temperature 0 means greedy.

    `top_k` of -1 or 0 disables top-k; `top_p` of 1 and `min_p` of 0 disable theirs. A `seed`
    gives the request its own random stream, so its text does not depend on its batch-mates.
    The penalties are vLLM's (runner/sampling/penalties.py): `repetition_penalty` (1 = off) divides
    the positive and multiplies the negative logits of every token in the prompt or the output so
    far, as transformers does; `presence_penalty` and `frequency_penalty` (0 = off, in [-2, 2])
    subtract once per token present in the output and once per occurrence. `logprobs` = N
    returns the log-probability of each generated token and of the N likeliest (0: the
    generated token's alone), from the model's own distribution (runner/sampling/logprobs.py), and
    `prompt_logprobs` = N the same for every prompt token after the first (such a prompt is
    computed whole, never served from the cache, so every position has its logits). `n`
    samples the prompt n times (runner/engine/requests/sample_groups.py); a seeded request's samples
    take seeds seed, seed + 1, ... `truncate_prompt_tokens` = k keeps only the prompt's last k
    tokens (what a long document's end needs in a context too short for all of it).

    The request's own logit rules are vLLM's (runner/sampling/logit_rules.py), applied before the
    penalties: `allowed_token_ids` keeps only those tokens; `min_tokens` bans EOS (unless
    ignore_eos) and `stop_token_ids` until that many tokens are out, and no stop string ends
    the request before then; `logit_bias` ({token id: bias in [-100, 100]}, keys may be
    digit strings as in OpenAI's API) adds to those logits; `bad_words` (strings) are never
    generated: the last token of each word, as the tokenizer writes it alone and after a
    space, is banned wherever the output ends with its other tokens.
    `include_stop_str_in_output` keeps the stop string that ended the request at the end of
    its text. `structured_outputs` holds the answer to a JSON schema, a regex, a list of
    choices or a grammar (runner/sampling/structured_outputs.py). `skip_special_tokens=False` keeps
    special tokens (EOS, chat markers) in the text, and stop strings are looked for in it.
    """

    max_tokens: int | None = 16  # None: until the prompt and answer fill the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    # logit_bias as (token id, bias) pairs, its keys read as ints.
    bias_items: tuple[tuple[int, float], ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self.validate()

    def clone(self) -> SamplingParams:
        """A deep copy, as vLLM's `clone`: changing it leaves this one as it is."""
        return copy.deepcopy(self)

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range. The engine calls this again
        when a request is added, since a dataclass can be changed after construction."""
        self._check_sampling()
        self._check_stops()
        self._check_output()
        self._check_logit_rules()
        self._check_penalties()
        self._check_counts()

    def _check_sampling(self) -> None:
        """The length and the draw: max_tokens, temperature, top_p, top_k, min_p, seed."""
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed >= 2**63:
                raise ValueError(f"seed must be < 2**63, got {self.seed}")

    def _check_stops(self) -> None:
        """stop (kept as `stop_strings`) and stop_token_ids."""
        if self.stop is None:
            self.stop_strings = ()
        elif isinstance(self.stop, str):
            self.stop_strings = (self.stop,) if self.stop else ()
        elif isinstance(self.stop, list | tuple) and all(isinstance(s, str) for s in self.stop):
            if len(self.stop) > MAX_STOP_STRINGS:
                raise ValueError(
                    f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
                )
            if "" in self.stop:  # it would match at once, everywhere: never what was meant
                raise ValueError(f"stop must not hold an empty string, got {self.stop!r}")
            self.stop_strings = tuple(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        for i, stop in enumerate(self.stop_strings):
            if len(stop) > MAX_STOP_CHARS:
                raise ValueError(
                    f"stop[{i}] is {len(stop)} characters long; at most {MAX_STOP_CHARS} "
                    "are allowed"
                )
            check_text(f"stop[{i}]", stop)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, list | tuple) and (
                len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
            ):
                raise ValueError(
                    f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most "
                    f"{MAX_STOP_TOKEN_IDS} are allowed"
                )
            if not isinstance(self.stop_token_ids, list | tuple) or not all(
                _is_token_id(t) for t in self.stop_token_ids
            ):
                raise ValueError(
                    f"stop_token_ids must be a list of non-negative ints, got "
                    f"{self.stop_token_ids!r}"
                )

    def _check_output(self) -> None:
        """The flags of what ends a request and what its text holds, and min_tokens."""
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )

    def _check_logit_rules(self) -> None:
        """logit_bias (kept as `bias_items`), bad_words, structured_outputs, allowed_token_ids."""
        self.bias_items = _bias_items(self.logit_bias)
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list | tuple)
            or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise ValueError(
                f"bad_words must be a list of non-blank strings, got {self.bad_words!r}"
            )
        for i, word in enumerate(self.bad_words or ()):
            check_text(f"bad_words[{i}]", word)
        self._check_structure()
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list | tuple)
            or not self.allowed_token_ids
            or not all(_is_token_id(t) for t in self.allowed_token_ids)
        ):
            raise ValueError(
                f"allowed_token_ids must be a non-empty list of non-negative ints, got "
                f"{self.allowed_token_ids!r}"
            )

    def _check_penalties(self) -> None:
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")

    def _check_counts(self) -> None:
        """truncate_prompt_tokens, n, logprobs and prompt_logprobs."""
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=1)
        _check_int("n", self.n, minimum=1)
        if self.n > MAX_SAMPLES:
            raise ValueError(f"n must be <= {MAX_SAMPLES}, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")

    def _check_structure(self) -> None:
        structure = self.structured_outputs
        if structure is None:
            return
        if not isinstance(structure, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be StructuredOutputsParams, got {structure!r}"
            )
        structure.validate()
        if self.min_tokens or self.allowed_token_ids:  # either can ban all the grammar allows
            raise ValueError(
                "structured_outputs decides which tokens come and where the answer ends: it "
                "cannot be combined with min_tokens or allowed_token_ids"
            )

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes this request's logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def greedy(self) -> bool:
        # Below this a distribution is one-hot for any logit gap over ~1e-3 (the scaled gap is
        # past exp's float32 range), and far below it logits / temperature overflows: greedy.
        return self.temperature < _GREEDY_BELOW


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bias_items(logit_bias: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs; ValueError naming a bad key or bias, or more
    entries than MAX_LOGIT_BIAS. Linear in the entries (a set of the tokens seen)."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {logit_bias!r}")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(
            f"logit_bias holds {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed"
        )
    items: list[tuple[int, float]] = []
    seen: set[int] = set()
    for key, bias in logit_bias.items():
        token = int(key) if isinstance(key, str) and key.isdecimal() else key
        if not _is_token_id(token):
            raise ValueError(f"logit_bias key must be a token id, got {key!r}")
        _check_number(f"logit_bias[{key!r}]", bias)
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias[{key!r}] must be in [-100, 100], got {bias}")
        if token in seen:  # "7" and 7 are one token
            raise ValueError(f"logit_bias names token {token} twice")
        seen.add(token)
        items.append((int(token), float(bias)))
    return tuple(items)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
