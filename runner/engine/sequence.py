"""One request as the scheduler sees it: tokens, progress through the KV cache, timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from runner.sampling.logprobs import TokenLogprobs
from runner.sampling.params import SamplingParams
from runner.sampling.penalties import TokenHistory
from runner.sampling.structured_outputs import GrammarState

# The value in token_ids of a token sampled on the device and not read back yet (see
# Sequence.pending_token, which alone says where one is): out of every vocabulary, so that a
# forward pass fed it by mistake fails instead of computing on a wrong token.
PENDING_TOKEN = -1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ReusedSegment:
    """A later segment of a prompt whose first `num_tokens` tokens' K/V are cached alone in
    `blocks`, held for the sequence under the block manager's id `reader`
    (runner/engine/step/segments.py)."""

    start: int  # its first position in the prompt
    num_tokens: int
    blocks: list[int]
    reader: int


@dataclass
class BlendPlan:
    """One admission's blend: positions [start, end) are written from the `reused` segments'
    cached K/V and blended, once the prompt is computed up to `start`."""

    start: int
    end: int
    reused: list[ReusedSegment]


@dataclass(eq=False)  # an entity: equal only to itself (value equality compared every field)
class Sequence:
    """A request's state. Invariant: tokens [0, num_computed_tokens) have K/V in the store.

    `token_ids` is prompt + generated so far; the newest sampled token is not computed yet, so a
    decoding sequence always has exactly one token to feed. The fields are grouped by who
    writes them: the intake, the scheduler, the step's settling, the model and sampler.
    """

    # Set when the request is queued (runner/engine/requests/intake.py), never changed after.
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    root: int  # hash-chain root: model fingerprint + cache salt
    generator: torch.Generator | None = None
    prompt_text: str | None = None
    group: str | None = None  # the request id of its SampleGroup, when SamplingParams.n > 1
    sample_index: int = 0
    # params.bad_words as token sequences (runner/sampling/logit_rules.py), tokenized once.
    bad_words: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # [start, end) of each segment after the first, when the prompt came as segments: K/V
    # that may come from the segment's own cache (runner/engine/step/segments.py).
    segments: tuple[tuple[int, int], ...] = ()
    blend_ratio: float | None = None  # the prompt's own (None: the engine's)
    # vLLM's request priority: a lower value is the more urgent request, admitted first under
    # priority scheduling, and its blocks kept longer under priority eviction.
    priority: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)

    # Written by the scheduler (runner/engine/step/scheduler.py; its two memos by
    # admission.py): where the request is, and its progress through the KV cache.
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # cached tokens found at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    arrival_step: int = 0
    wait_since_step: int = 0
    first_scheduled_time: float | None = None  # its first admission to the batch
    admitted: bool = False  # admitted at least once (later admissions are re-admissions)
    # (num_tokens, full-block hashes of token_ids) as of that count; the scheduler's memo.
    block_hash_cache: tuple[int, list[int]] | None = field(default=None, repr=False)
    # (cache version, num_tokens, cached prefix length) as of that version and count.
    cached_prefix_memo: tuple[int, int, int] | None = field(default=None, repr=False)
    # With segments reused (runner/engine/step/segments.py): the blend still to run, the
    # positions from which K/V are approximate (never published as a prefix; None: all exact)
    # and the prompt tokens served from segments' caches at first admission.
    blend: BlendPlan | None = field(default=None, repr=False)
    exact_limit: int | None = None
    num_reused_segment_tokens: int = 0

    # Written as a step is settled (runner/engine/step/settle.py): `record_token` appends each
    # token (called by runner/engine/requests/stopping.py, which also sets the stop fields), and
    # the settler stamps the finish time.
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when params.logprobs
    # Its place in params.structured_outputs' grammar (made by the intake), fed each token.
    grammar: GrammarState | None = field(default=None, repr=False)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    stop_text_cut: int | None = None  # chars of the text kept when a stop string matched
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    finish_time: float | None = None
    # prompt + output, kept in step by record_token: every step reads a decoding sequence's
    # tokens a few times, and joining the two lists each time cost ~1 ms a step at 256 of them.
    _tokens: list[int] = field(init=False, repr=False, compare=False)
    # Whether the last of token_ids holds the place of a token a step still running on the
    # device sampled (runner/engine/step/overlap.py, by `hold_pending_token`): the next step is
    # scheduled around it, its input read on the device; never part of the output. At most one
    # at a time.
    pending_token: bool = field(default=False, init=False, repr=False, compare=False)

    # Written by the model and the sampler as a step runs.
    # When params.prompt_logprobs: per prompt position (None for the first), set by the runner
    # (runner/engine/step/model_runner.py) as each chunk is computed (a recomputed chunk sets
    # the same values again).
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None, repr=False)
    # Its token ids as tensors, made on the first step that penalizes it (tokens.py,
    # runner/sampling/penalties.py).
    token_history: TokenHistory | None = field(default=None, repr=False)
    _plain_logits: bool | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._tokens = self.prompt_token_ids + self.output_token_ids
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt + generated so far. The sequence's own list: read it, never change it."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def cache_retention(self) -> int:
        """What the priority eviction policy ranks this request's blocks by, a higher value
        kept longer (SGLang's sense): vLLM's priority turned around, so the more urgent request
        (the lower priority value) keeps its blocks longer."""
        return -self.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        """params.max_tokens: a number once queued (add_request turns None into the room the
        context leaves)."""
        assert self.params.max_tokens is not None, "max_tokens is resolved when queued"
        return self.params.max_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_exact_tokens(self) -> int:
        """Computed tokens whose K/V are exact (a prefix others may be served)."""
        limit = self.exact_limit
        computed = self.num_computed_tokens
        return computed if limit is None else min(computed, limit)

    @property
    def in_prefill(self) -> bool:
        """True while more than the single newest token is left to compute."""
        return self.num_uncomputed_tokens > 1 or not (self.output_token_ids or self.pending_token)

    @property
    def reuses_cache(self) -> bool:
        """False for a prompt whose every position must be computed (its log-probabilities
        were asked for): it is served nothing from the cache, though it still fills it."""
        return self.params.prompt_logprobs is None

    @property
    def plain_logits(self) -> bool:
        """Whether sampling takes the model's logits as they are: no grammar, logit rule,
        penalty or log-probabilities, so a step of such sequences skips that machinery. Settled
        when first asked (at a step), after add_request has set the grammar and bad words."""
        if self._plain_logits is None:
            p = self.params
            self._plain_logits = not (
                self.grammar is not None
                or self.bad_words
                or p.allowed_token_ids
                or p.min_tokens
                or p.bias_items
                or p.penalized
                or p.logprobs is not None
            )
        return self._plain_logits

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def hold_pending_token(self) -> None:
        """Hold the place of the token a step still on the device sampled for this sequence:
        token_ids grows by one whose value is PENDING_TOKEN (never read: the next step takes it
        from the device), so the scheduler sees the sequence as if it had the token."""
        assert not self.pending_token, "one step at a time is in flight"
        self._tokens.append(PENDING_TOKEN)
        self.pending_token = True

    def record_token(
        self, token_id: int, now: float, logprobs: TokenLogprobs | None = None
    ) -> None:
        if self.pending_token:  # the token whose place was held: its value is known now
            self._tokens.pop()
            self.pending_token = False
            # Memos of token_ids taken while the place was held hashed the placeholder.
            self.block_hash_cache = self.cached_prefix_memo = None
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        self._tokens.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)


def request_id_of(seq: Sequence) -> str:
    """The id of the request a sequence belongs to: its own, or its sample group's."""
    return seq.group if seq.group is not None else seq.request_id
