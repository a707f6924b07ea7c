"""Structured outputs (vLLM's `StructuredOutputsParams`): an answer held to a JSON schema, any
JSON object, a regular expression, one of a list of choices, or an EBNF grammar.

The grammar engine is xgrammar: it compiles the constraint once against the tokenizer's
vocabulary, and a matcher per sequence gives, before each token, the bitmask of tokens that
keep the output inside the grammar (~0.1 ms a row), then takes in the token chosen. When the
grammar is complete only the end-of-sequence token is allowed; once it is taken the matcher
is terminated and the request ends with "stop" (even with ignore_eos, where EOS is text).

xgrammar takes ~1.7 s to import, so nothing here imports it until a request asks for a
structure: an engine that never sees one starts as fast as before.

Compiled grammars are kept for the next request that asks for the same structure, within
GRAMMAR_CACHE_BYTES, the least recently used dropped first: each distinct schema holds about
0.32 MiB against a 49k-token vocabulary, and any API client can send a new one each request.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarMatcher

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
GRAMMAR_CACHE_BYTES = 64 * 2**20  # compiled grammars kept, with their structures' text


@dataclass
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or its text), `json_object=True` (any
    JSON object), `regex`, `choice` (a list of strings, the answer is one of them) or `grammar`
    (EBNF, as xgrammar and llama.cpp's GBNF read it: `root ::= ...`)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(_KINDS)}; got "
                f"{', '.join(given) or 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError(f"json must be a JSON schema (dict or text), got {self.json!r}")
        if isinstance(self.json, dict):
            try:
                json.dumps(self.json)
            except (TypeError, ValueError) as err:
                raise ValueError(f"json schema is not JSON: {err}") from err
            except RecursionError:  # a dict nested past the stack: no schema is that deep
                raise ValueError("json schema is nested too deeply") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"choice must be a non-empty list of non-empty strings, got {self.choice!r}"
            )

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): what a compiled grammar is cached under. A schema's text keeps
        its properties' order: the answer's object follows it, as vLLM's does (a record's
        readers expect the schema's order, not the alphabet's)."""
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", spec
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "grammar", choice_grammar(self.choice)
        return "grammar", str(self.grammar)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    literals = [json.dumps(c, ensure_ascii=False) for c in choices]  # quoted, \\ \" \n escaped
    return "root ::= " + " | ".join(literals)


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: GrammarMatcher) -> None:
        self.matcher = matcher
        # Set when a token had to be taken that the grammar refuses: its mask allowed none
        # (a dead end no answer leads out of), so the request ends there.
        self.dead_end = False

    def accept(self, token: int) -> None:
        """Take in the token chosen; every token is chosen under this grammar's mask."""
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            self.dead_end = True

    @property
    def finished(self) -> bool:
        """The grammar is complete and its end-of-sequence token has been taken, or it came
        to a dead end."""
        return self.dead_end or bool(self.matcher.is_terminated())


@dataclass
class _Compiled:
    """A compiled grammar as the book keeps it: its size, and whether its structure has an
    answer that ends once that has been read (`finite`, None: it could not be read)."""

    grammar: CompiledGrammar
    nbytes: int
    finite: bool | None = None
    finite_read: bool = False


class GrammarBook:
    """An engine's compiler: the tokenizer's vocabulary read once (on the first structured
    request), and each constraint compiled once while it stays in the cache (at most
    `cache_bytes` of compiled grammars and their keys, the least recently used dropped first;
    the newest is kept even when it alone is larger). Safe to call from several threads: no
    lock is held while a grammar compiles."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: set[int],
        cache_bytes: int = GRAMMAR_CACHE_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.cache_bytes = cache_bytes
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, str], _Compiled] = OrderedDict()
        self._held_bytes = 0
        self._lock = threading.Lock()  # the cache's books and the compiler's creation

    @property
    def cached_bytes(self) -> int:
        """What the kept grammars hold, their keys' text included."""
        return self._held_bytes

    @property
    def cached_count(self) -> int:
        return len(self._compiled)

    def compile(self, params: StructuredOutputsParams | None) -> CompiledGrammar | None:
        """The compiled grammar of `params` (None for none), compiled on first use. Raises
        ValueError naming the problem for a schema, expression or grammar that does not
        compile, or a model without a tokenizer."""
        if params is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer, and this model has none")
        return self._entry(params.key).grammar

    def _entry(self, key: tuple[str, str]) -> _Compiled:
        """The kept grammar of `key`, compiled (and kept, older ones dropped past the bound)
        when it is not kept."""
        with self._lock:
            held = self._compiled.get(key)
            if held is not None:
                self._compiled.move_to_end(key)
                return held
        grammar = self._compile(key)  # without the lock: a long compile holds up no other
        # The key's text is held twice: in this cache and in the grammar's own print.
        entry = _Compiled(grammar, int(grammar.memory_size_bytes) + 2 * len(key[1]))
        with self._lock:
            held = self._compiled.get(key)
            if held is not None:  # compiled meanwhile on another thread
                self._compiled.move_to_end(key)
                return held
            self._compiled[key] = entry
            self._held_bytes += entry.nbytes
            while self._held_bytes > self.cache_bytes and len(self._compiled) > 1:
                _, dropped = self._compiled.popitem(last=False)
                self._held_bytes -= dropped.nbytes
        return entry

    def check(self, params: StructuredOutputsParams | None) -> None:
        """Compile `params` (see `compile`), and refuse a structure no answer can satisfy
        (`root ::= root "a"`): its first mask would allow no token at all."""
        state = self.state_for(params)
        if state is None or params is None:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        state.matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise ValueError("structured_outputs: the structure admits no answer at all")
        if not self._finite(params):
            raise ValueError(
                "structured_outputs: the structure admits no finite answer (a part of it "
                "always needs another copy of itself, as a required property whose schema "
                "is the whole schema)"
            )

    def _finite(self, params: StructuredOutputsParams) -> bool:
        """Whether the structure has an answer that ends (runner/sampling/grammar_finite.py), read
        once per structure; True when its grammar's print cannot be read."""
        from runner.sampling.grammar_finite import has_finite_answer

        entry = self._entry(params.key)
        if not entry.finite_read:  # two threads may both read it: the same answer
            entry.finite = has_finite_answer(str(entry.grammar.grammar))
            entry.finite_read = True
        return entry.finite is not False

    def state_for(self, params: StructuredOutputsParams | None) -> GrammarState | None:
        """A fresh matcher for one sequence under `params` (None for none)."""
        compiled = self.compile(params)
        if compiled is None:
            return None
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled))

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        try:
            import xgrammar as xgr
        except ImportError as err:
            raise ValueError("structured outputs need the xgrammar package installed") from err

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids
                )
                # Its own cache off: it would keep every grammar, past this book's bound.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            compiler = self._compiler
        kind, spec = key
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec)
            if kind == "json_object":  # the builtin JSON grammar takes any value, arrays too
                return compiler.compile_json_schema('{"type": "object"}')
            if kind == "regex":
                return compiler.compile_regex(spec)
            return compiler.compile_grammar(spec)
        except Exception as err:  # xgrammar raises RuntimeError or its own types, by kind
            raise ValueError(f"structured_outputs: the {kind} does not compile: {err}") from err


def mask_logits(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> torch.Tensor:
    """`logits` [N, vocab] with each row under a grammar limited to the tokens it allows next
    (the rest -inf). Returns `logits` itself when no row has a grammar, else a float32 copy:
    the model's own logits stay as they are."""
    live = [(i, g) for i, g in enumerate(grammars) if g is not None and not g.finished]
    if not live:
        return logits
    import xgrammar as xgr

    masked = logits.float()
    if masked is logits:
        masked = logits.clone()
    bitmask = xgr.allocate_token_bitmask(len(grammars), masked.shape[1])  # int32 [N, words]
    for i, grammar in live:
        grammar.matcher.fill_next_token_bitmask(bitmask, i)
    rows = [i for i, _ in live]
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device), indices=rows)
    return masked
