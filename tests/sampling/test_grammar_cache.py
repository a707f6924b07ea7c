"""The compiled grammars a GrammarBook keeps are bounded in bytes, the least recently used
dropped first: before, every distinct structure stayed for the engine's life (250 MiB after
600 schemas against the default model's vocabulary, 665 MiB after 1,500)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.model.loader import load_tokenizer, read_config
from runner.sampling.structured_outputs import (
    GRAMMAR_CACHE_BYTES,
    GrammarBook,
    StructuredOutputsParams,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_tok_dir: Path) -> object:
    return load_tokenizer(tiny_llama_tok_dir, read_config(tiny_llama_tok_dir))


def regex(i: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"answer {i:03d}: [a-z]+")  # one size, each its own


def book_of(tokenizer: object, cache_bytes: int = GRAMMAR_CACHE_BYTES) -> GrammarBook:
    return GrammarBook(tokenizer, 320, {2}, cache_bytes=cache_bytes)


def test_the_cache_stays_within_its_bytes(tokenizer: object) -> None:
    one = book_of(tokenizer)
    one.check(regex(0))
    size = one.cached_bytes
    assert size > 0 and one.cached_count == 1
    bounded = book_of(tokenizer, cache_bytes=size * 3)
    for i in range(40):
        bounded.check(regex(i))  # compiles and checks, as a request's intake does
        assert bounded.cached_bytes <= size * 3
    assert bounded.cached_count == 3


def test_the_least_recently_used_goes_first(tokenizer: object) -> None:
    probe = book_of(tokenizer)
    probe.compile(regex(50))
    book = book_of(tokenizer, cache_bytes=probe.cached_bytes * 3 + 100)
    a, b, _ = (book.compile(regex(50 + i)) for i in range(3))
    assert book.compile(regex(50)) is a  # a hit: used again, so B is now the oldest
    book.compile(regex(53))
    assert book.cached_count == 3
    assert book.compile(regex(50)) is a  # kept
    assert book.compile(regex(51)) is not b  # dropped, and compiled again


def test_a_grammar_alone_past_the_bound_is_kept_until_the_next(tokenizer: object) -> None:
    book = book_of(tokenizer, cache_bytes=1)
    first = book.compile(regex(1))
    assert book.compile(regex(1)) is first and book.cached_count == 1
    book.compile(regex(2))
    assert book.cached_count == 1 and book.compile(regex(1)) is not first
