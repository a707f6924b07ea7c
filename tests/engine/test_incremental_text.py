"""Output text extended token by token (runner/engine/requests/incremental_text.py) equals the whole
output's decode after every token, for SentencePiece-style decoders (Llama 2's, Gemma's, a Metaspace
one): random outputs with special tokens, lone spaces, byte runs that are valid UTF-8 and
runs that are not, and ids past the tokenizer."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stopping import cleanup_tokenizer, metaspace_tokenizer

from kvcache import LLM, SamplingParams
from runner.engine.api.streaming import TextStream
from runner.engine.requests.incremental_text import OutputText, decode_anchor
from runner.engine.requests.stopping import StopChecker
from runner.engine.sequence import Sequence

KINDS = ("llama2", "gemma", "metaspace")
_TOKENIZERS = {kind: metaspace_tokenizer(kind) for kind in KINDS}
EURO = [5 + 0xE2, 5 + 0x82, 5 + 0xAC]  # "€" in byte tokens


def checker(tokenizer: Any) -> StopChecker:
    return StopChecker(SimpleNamespace(eos_token_id=2), tokenizer, 10_000)


output_ids = st.lists(
    st.one_of(
        st.integers(0, 4),  # <unk> <s> </s> (special), "▁" alone, <pad>
        st.integers(5, 260),  # byte tokens: ASCII, halves of characters, stray continuations
        st.sampled_from(EURO),
        st.integers(261, 274),  # "a" "▁a" ... "\n" "▁\n"
        st.integers(275, 290),  # past the tokenizer
    ),
    min_size=1,
    max_size=30,
)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=150, deadline=None)
@given(token_ids=output_ids, skip_special_tokens=st.booleans())
def test_extended_text_equals_the_whole_decode(
    kind: str, token_ids: list[int], skip_special_tokens: bool
) -> None:
    stopper = checker(_TOKENIZERS[kind])
    output = OutputText(stopper, skip_special_tokens)
    assert output.incremental
    for n in range(1, len(token_ids) + 1):
        assert output.of(token_ids[:n]) == stopper.decode(token_ids[:n], skip_special_tokens)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=100, deadline=None)
@given(token_ids=output_ids)
def test_streamed_deltas_never_take_text_back(kind: str, token_ids: list[int]) -> None:
    """Fed one token at a time, a stream's deltas always add up to a prefix of the final text:
    no text of a byte run is handed out before the run closes (it may turn into U+FFFDs)."""
    stopper = checker(_TOKENIZERS[kind])
    params = SamplingParams(max_tokens=10_000)
    seq = Sequence(seq_id=0, request_id="0", prompt_token_ids=[1], params=params, root=0)
    stream, sent = TextStream(stopper), ""
    for token in token_ids:
        seq.record_token(token, 0.0)
        sent += stream.settled_delta(seq)
        assert stopper.decode(seq.output_token_ids).startswith(sent)
    final = stopper.output_text(seq)
    assert final.startswith(sent)
    assert sent + stream.final_delta(final) == final


def test_a_byte_run_is_open_until_a_token_that_is_not_a_byte() -> None:
    """'€' then a stray continuation byte: the whole run is not UTF-8, so it decodes to one
    U+FFFD a byte and the '€' already seen goes; the text must follow, not keep the '€'."""
    stopper = checker(_TOKENIZERS["gemma"])
    output = OutputText(stopper)
    a = stopper.tokenizer.convert_tokens_to_ids("▁a")
    ids = [a, *EURO]
    assert output.of(ids) == " a€"
    assert output.of([*ids, 5 + 0x82]) == " a" + "\ufffd" * 4
    assert output.of([*ids, 5 + 0x82, a]) == " a" + "\ufffd" * 4 + " a"


def test_which_tokenizers_decode_piecewise() -> None:
    assert all(decode_anchor(tok) is not None for tok in _TOKENIZERS.values())
    assert checker(cleanup_tokenizer()).decode_anchor is None  # cleanup rewrites across tokens
    from tokenizers import decoders

    trailing = metaspace_tokenizer("gemma")
    trailing.backend_tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 0, 1)]
    )
    assert decode_anchor(trailing) is None  # a strip of the text's end is not piecewise
    assert not OutputText(checker(trailing)).incremental


def test_streaming_with_a_sentencepiece_tokenizer_decodes_whole_only_at_the_end(
    make_tiny_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed text adds up to the output's text (never handing out a byte run's text
    before the run closes), and long outputs are not decoded whole at each step: only the
    short anchored tails are."""
    folder = tmp_path / "with_tokenizer"
    folder.mkdir()
    for item in make_tiny_model("llama").iterdir():
        (folder / item.name).symlink_to(item)
    _TOKENIZERS["gemma"].save_pretrained(folder)
    llm = LLM(str(folder))
    decoded_lengths: list[int] = []
    decode = llm.stopper.decode

    def counted(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        decoded_lengths.append(len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(llm.stopper, "decode", counted)
    # Letters, and the bytes of a '€' now and then: runs open and close, as in real text.
    pieces = list(range(261, 275)) + EURO
    params = SamplingParams(
        max_tokens=60, temperature=1.0, seed=5, ignore_eos=True, allowed_token_ids=pieces
    )
    texts = {0: "", 1: ""}
    outputs = {}
    for delta in llm.stream(["ab", "cd"], params):
        texts[delta.index] += delta.text
        if delta.output is not None:
            outputs[delta.index] = delta.output
    assert texts == {i: outputs[i].text for i in (0, 1)}
    long_decodes = [n for n in decoded_lengths if n > 20]
    assert len(long_decodes) <= 8, long_decodes  # the final texts, not one per step
