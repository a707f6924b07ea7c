"""Request intake: what ``Engine.add_request`` does before anything is queued.

A call becomes its sequences here: the prompt tokenized and fitted
(runner/engine/requests/validation.py), its structure compiled, its id picked or checked, its
namespace root (one per ``cache_salt``) and prefix key found, and one ``Sequence`` built a sample.
Nothing is queued: the engine queues the sequences whole, or none of them
(runner/engine/api/engine.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from array import array
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvcache import block_hashes, namespace_root
from runner.engine.requests.sample_groups import SEED_RANGE, sample_params, sample_request_id
from runner.engine.requests.segmented_prompt import SegmentedPrompt
from runner.engine.requests.validation import Prompt, RequestValidator, prompt_token_ids
from runner.engine.sequence import Sequence
from runner.sampling.logit_rules import bad_word_ids
from runner.sampling.params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
from runner.sampling.prompt_bytes import check_prompt_bytes, max_prompt_bytes
from runner.sampling.sampler import request_generator
from runner.sampling.structured_outputs import GrammarBook


class Intake(NamedTuple):
    """One request's sequences (sample 0 first) and the key its report row groups it by."""

    seqs: list[Sequence]
    group: str | None  # the request id its samples share when params.n > 1
    prefix_key: str  # the first full block's hash, hex ("" for a prompt shorter than a block)


class PromptTokens(NamedTuple):
    """A prompt as the engine runs it: its token ids, its text (None for token ids), its later
    segments' [start, end) bounds and its own blend ratio (a segmented prompt's)."""

    token_ids: list[int]
    text: str | None
    segments: tuple[tuple[int, int], ...]
    blend_ratio: float | None


@dataclasses.dataclass(eq=False, kw_only=True)
class RequestIntake:
    """Builds the sequences of each request; owns the sequence numbers, the engine's seed
    stream for requests' own streams, and the namespace roots by ``cache_salt``."""

    tokenizer: PreTrainedTokenizerBase | None
    fingerprint: str
    block_size: int
    validator: RequestValidator
    grammars: GrammarBook
    seed: int
    # EngineConfig.deterministic: an unseeded sampled request's seed comes from the engine's
    # seed and its prompt (request_seed), not from how many requests came before it.
    deterministic: bool = False
    # Also numbers beam searches.
    seq_ids: Iterator[int] = dataclasses.field(init=False, default_factory=itertools.count)
    rng: torch.Generator = dataclasses.field(init=False)  # seeds requests' streams (CPU)
    roots: dict[str | None, int] = dataclasses.field(init=False, default_factory=dict)
    # Found when a text first might pass it.
    prompt_bytes_bound: int | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.rng = torch.Generator().manual_seed(self.seed)

    def root(self, cache_salt: str | None) -> int:
        """The namespace root of a ``cache_salt``'s blocks (computed once a salt). Mutates
        the cache of roots."""
        if cache_salt not in self.roots:
            self.roots[cache_salt] = namespace_root(self.fingerprint, cache_salt)
        return self.roots[cache_salt]

    def check_text_size(self, prompt: Prompt | SegmentedPrompt) -> None:
        """Refuse a text too long to fit the context by its bytes, before it is tokenized (a
        30 MB line took 47 s and 6.4 GB to be refused): ValueError naming the bound. The bound
        (runner/sampling/prompt_bytes.py) reads the vocabulary once, when a text first has
        more characters than the context has tokens (a shorter one always passes it)."""
        text = text_of(prompt)
        context = self.validator.max_model_len
        if len(text) <= context or self.tokenizer is None:
            return
        if self.prompt_bytes_bound is None:
            self.prompt_bytes_bound = max_prompt_bytes(self.tokenizer, context)
        check_prompt_bytes("prompt", text, self.prompt_bytes_bound, context)

    def sequences(
        self,
        prompt: Prompt | SegmentedPrompt,
        params: SamplingParams | None,
        *,
        request_id: str | None,
        cache_salt: str | None,
        add_special_tokens: bool,
        taken: Callable[[str], bool],
    ) -> Intake:
        """A request's sequences, one a sample; ``taken`` says whether an id is in use.
        Raises ValueError naming the problem, before anything is mutated but the sequence
        numbers. Mutates: the sequence numbers and the seed stream advance."""
        params = params if params is not None else SamplingParams()
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if request_id is not None and taken(request_id):
            raise ValueError(f"request id {request_id!r} is already running")
        tokens, params = self.prompt_tokens(prompt, params, add_special_tokens)
        token_ids = tokens.token_ids
        structured = params.structured_outputs is not None
        if structured:  # a bad structure fails here, alone
            self.grammars.check(params.structured_outputs)
        if self.deterministic and params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=request_seed(self.seed, token_ids))
        bad_words = bad_word_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
        root = self.root(cache_salt)
        first = block_hashes(token_ids[: self.block_size], self.block_size, root)
        n = params.n
        seq_id, rid = self.request_number(request_id, n, taken)
        seqs = []
        for j in range(n):
            own = sample_params(params, j) if n > 1 else params
            seqs.append(
                Sequence(
                    seq_id=seq_id if j == 0 else next(self.seq_ids),
                    request_id=sample_request_id(rid, j) if n > 1 else rid,
                    prompt_token_ids=token_ids,
                    params=own,
                    root=root,
                    generator=request_generator(own, self.rng),
                    prompt_text=tokens.text,
                    group=rid if n > 1 else None,
                    sample_index=j,
                    grammar=self.grammars.state_for(own.structured_outputs) if structured else None,
                    bad_words=bad_words,
                    segments=tokens.segments,
                    blend_ratio=tokens.blend_ratio,
                )
            )
        return Intake(seqs, rid if n > 1 else None, f"{first[0]:016x}" if first else "")

    def prompt_tokens(
        self, prompt: Prompt | SegmentedPrompt, params: SamplingParams, add_special_tokens: bool
    ) -> tuple[PromptTokens, SamplingParams]:
        """The prompt's tokens fitted to the context (the validator may cut it to its last
        tokens, moving the segments' bounds with it), and the params the fit leaves. Raises
        ValueError naming the problem."""
        self.check_text_size(prompt)
        bounds: tuple[tuple[int, int], ...] = ()
        blend_ratio = None
        if isinstance(prompt, SegmentedPrompt):
            blend_ratio = prompt.blend_ratio
            token_ids, bounds = prompt.token_ids(self.tokenizer, add_special_tokens)
            text = prompt.text
        else:
            token_ids = prompt_token_ids(prompt, self.tokenizer, add_special_tokens)
            text = prompt if isinstance(prompt, str) else None
        before = len(token_ids)
        token_ids, params = self.validator.fit(token_ids, params)
        if len(token_ids) != before:  # cut to its last tokens: the segments' starts moved
            cut = before - len(token_ids)
            bounds = tuple((s - cut, e - cut) for s, e in bounds if s >= cut)
        return PromptTokens(token_ids, text, bounds, blend_ratio), params

    def request_number(
        self, request_id: str | None, n: int, taken: Callable[[str], bool]
    ) -> tuple[int, str]:
        """The request's first sequence number, and its id: the one given, or that number
        (the next free one when a given id took it). Raises ValueError when one of a given id's
        samples is running already. Mutates: the sequence numbers advance."""
        seq_id = next(self.seq_ids)
        while request_id is None and _ids_taken(str(seq_id), n, taken):
            seq_id = next(self.seq_ids)  # a given id took this number: the next one is free
        rid = request_id if request_id is not None else str(seq_id)
        if n > 1:
            others = [i for i in _ids_taken(rid, n, taken) if i != rid]
            if others:
                raise ValueError(
                    f"request id {others[0]!r} (a sample of {rid!r}) is already running"
                )
        return seq_id, rid


def text_of(prompt: Prompt | SegmentedPrompt) -> str:
    """The text a prompt's tokenizer would read ("" for token ids)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, SegmentedPrompt):
        return "".join(s for s in prompt.segments if isinstance(s, str))
    return ""


def request_seed(engine_seed: int, token_ids: list[int]) -> int:
    """The seed of an unseeded sampled request in deterministic mode: a hash of the engine's
    seed and the prompt's tokens, below SamplingParams' 2**63. The same request then draws the
    same tokens in any batch, in any order of arrival, in any process started with that seed;
    its n samples take it plus 0 .. n - 1, as a seeded request's do."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(engine_seed.to_bytes(16, "little", signed=True))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little") % SEED_RANGE


def _ids_taken(request_id: str, n: int, taken: Callable[[str], bool]) -> list[str]:
    """The ids in use among a request's and, with n > 1, its samples' ("<id>#<j>")."""
    ids = [request_id] + [sample_request_id(request_id, j) for j in range(n) if n > 1]
    return [i for i in ids if taken(i)]
