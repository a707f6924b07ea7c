"""Stop strings: the tail-decoding checker stops where decoding the whole output every step
would, at the same token and with the same cut, for byte-level, real BPE and SentencePiece-style
tokenizers, alone and batched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.engine.requests.stopping import StopChecker, first_stop
from runner.engine.sequence import Sequence
from runner.sampling.params import SamplingParams
from tests.conftest import tiny_tokenizer

MAX_MODEL_LEN = 10_000


def metaspace_tokenizer(kind: str = "llama2") -> Any:
    """SentencePiece-like: pieces '▁x' / 'x' for a few letters, byte fallback for everything
        else (ids 5..260). The decoder is Llama 2's ("llama2": it drops the text's leading space),
        Gemma's ("gemma": it keeps it) or a Metaspace one ("metaspace": it drops the first token's
    leading space)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "<pad>": 4}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    for ch in "abcdeé\n":
        vocab[ch] = len(vocab)
        vocab["▁" + ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    pieces = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = {
        "llama2": decoders.Sequence([*pieces, decoders.Strip(" ", 1, 0)]),
        "gemma": decoders.Sequence(pieces),
        "metaspace": decoders.Sequence([decoders.Metaspace(prepend_scheme="first"), *pieces[1:]]),
    }[kind]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def reference_stop(tokenizer: Any, tokens: list[int], stops: list[str]) -> tuple[int, int] | None:
    """(tokens generated when it stops, text cut): the whole output decoded after each token."""
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
        found = first_stop(text, tuple(s for s in stops if s))
        if found is not None:
            return n, found[0]
    return None


def run_checker(
    tokenizer: Any, outputs: list[list[int]], stops: list[list[str]]
) -> list[tuple[int, int] | None]:
    """Feed every output one token a step, all sequences in one batch, like the engine."""
    checker = StopChecker(None, tokenizer, MAX_MODEL_LEN)
    seqs = [
        Sequence(
            seq_id=i,
            request_id=str(i),
            prompt_token_ids=[1],
            params=SamplingParams(max_tokens=len(out) + 1, stop=stop, ignore_eos=True),
            root=0,
        )
        for i, (out, stop) in enumerate(zip(outputs, stops, strict=True))
    ]
    result: list[tuple[int, int] | None] = [None] * len(seqs)
    going = list(range(len(seqs)))
    for step in range(max(map(len, outputs))):
        going = [i for i in going if step < len(outputs[i])]
        tokens = [outputs[i][step] for i in going]
        for i, token in zip(going, tokens, strict=True):
            seqs[i].record_token(token, 0.0)
        reasons = checker.finish_reasons([seqs[i] for i in going], tokens)
        for i, reason in zip(list(going), reasons, strict=True):
            assert reason in (None, "stop")  # max_tokens is out of reach, EOS ignored
            if reason == "stop":
                cut = seqs[i].stop_text_cut
                assert cut is not None
                result[i] = (step + 1, cut)
                going.remove(i)
    return result


TOKENIZERS = {"byte_level": tiny_tokenizer, "metaspace": metaspace_tokenizer}


@st.composite
def outputs_and_stops(
    draw: st.DrawFn, vocab: int, special: list[int]
) -> tuple[list[list[int]], list[list[str]]]:
    """A few outputs of random ids, special ones often (a decode drops them, so a stop string
    can span many tokens), and for each some short stop strings."""
    ids = st.one_of(st.integers(0, vocab - 1), st.sampled_from(special))
    outputs = draw(st.lists(st.lists(ids, min_size=1, max_size=40), min_size=1, max_size=4))
    stops = []
    for _ in outputs:
        texts = st.text(alphabet="abcé\n ", min_size=1, max_size=4)
        stops.append(draw(st.lists(texts, min_size=1, max_size=3)))
    return outputs, stops


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tail_check_stops_where_a_full_decode_does(name: str, data: st.DataObject) -> None:
    tokenizer = TOKENIZERS[name]()
    outputs, stops = data.draw(outputs_and_stops(len(tokenizer), tokenizer.all_special_ids))
    # Stop strings taken from the outputs' own text, so stops are actually hit.
    for out, stop in zip(outputs, stops, strict=True):
        text = tokenizer.decode(out, skip_special_tokens=True)
        if len(text) >= 2:
            start = data.draw(st.integers(0, len(text) - 2))
            stop.append(text[start : start + data.draw(st.integers(1, 6))])
    expected = [reference_stop(tokenizer, out, s) for out, s in zip(outputs, stops, strict=True)]
    assert run_checker(tokenizer, outputs, stops) == expected


def test_real_tokenizer_stops_on_multibyte_and_newline_strings(default_model_dir: Path) -> None:
    from runner.model.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    text = "Café au lait ☕ costs 3€.\n\nUser: and tea? 🍵 Also fine.\n\nUser: bye"
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    cases = [["\n\nUser:"], ["☕"], ["🍵", "tea"], ["€."], ["not there"], ["bye", "Café"]]
    outputs = [tokens] * len(cases)
    expected = [reference_stop(tokenizer, tokens, s) for s in cases]
    assert expected[4] is None and all(e is not None for i, e in enumerate(expected) if i != 4)
    assert run_checker(tokenizer, outputs, cases) == expected


def test_a_long_output_decodes_only_its_tail_each_step() -> None:
    tokenizer = tiny_tokenizer()
    decoded: list[int] = []
    batch_decode = tokenizer.batch_decode

    def counting(seqs: list[list[int]], **kw: Any) -> list[str]:
        decoded.extend(len(s) for s in seqs)
        return list(batch_decode(seqs, **kw))

    tokenizer.batch_decode = counting
    out = tokenizer("x" * 500, add_special_tokens=False)["input_ids"]
    assert run_checker(tokenizer, [out], [["STOP"]]) == [None]
    assert len(decoded) == 500 and max(decoded) == len("STOP") + 8


def test_a_stop_string_split_by_many_special_tokens_is_found() -> None:
    tokenizer = tiny_tokenizer()
    a, b = tokenizer("ab", add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    output = [a] + [bos, eos] * 20 + [b]  # decodes to "ab": the specials are skipped
    assert run_checker(tokenizer, [output], [["ab"]]) == [(len(output), 0)]


def test_a_stop_string_split_by_ids_past_the_tokenizer_is_found() -> None:
    """A model's vocabulary can be wider than its tokenizer's: those ids decode to nothing,
    and the tail must count past them as past special tokens."""
    tokenizer = tiny_tokenizer()
    a, b = tokenizer("ab", add_special_tokens=False)["input_ids"]
    x = tokenizer("X", add_special_tokens=False)["input_ids"][0]
    padding = len(tokenizer) + 5  # an id the model can emit and the tokenizer does not know
    output = [a] + [padding] * 10 + [b, x, a, b]
    assert tokenizer.decode(output, skip_special_tokens=True) == "abXab"
    assert run_checker(tokenizer, [output], [["ab"]]) == [(12, 0)]


def cleanup_tokenizer() -> Any:
    """Unigram pieces 'a', ' ', '!', fused; its decode applies clean_up_tokenization_spaces
    (transformers does for every model but BPE), so ' !' decodes to '!': a space token yields
    no text."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("a", -1.0), (" ", -1.0), ("!", -1.0)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=False))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=True,
    )


def test_stop_string_found_when_cleanup_drops_spaces() -> None:
    tokenizer = cleanup_tokenizer()
    a, space, bang = 3, 4, 5
    assert tokenizer.decode([a, space, bang, space, bang]) == "a!!"
    output = [a] + [space, bang] * 30
    for stops in (["!" * 10], ["a" + "!" * 9]):
        expected = reference_stop(tokenizer, output, stops)
        assert expected is not None
        assert run_checker(tokenizer, [output], [stops]) == [expected]


def test_distinct_stop_strings_do_not_grow_the_checker() -> None:
    tokenizer = tiny_tokenizer()
    checker = StopChecker(None, tokenizer, MAX_MODEL_LEN)
    for i in range(300):
        run_checker_with(checker, [5, 6], [f"user-{i}:"])
    sizes = [len(v) for v in vars(checker).values() if isinstance(v, dict | list)]
    assert all(n < 300 for n in sizes)  # a long-lived engine keeps no per-request state


def run_checker_with(checker: StopChecker, output: list[int], stops: list[str]) -> None:
    seq = Sequence(
        seq_id=0,
        request_id="0",
        prompt_token_ids=[1],
        params=SamplingParams(max_tokens=len(output) + 1, stop=stops, ignore_eos=True),
        root=0,
    )
    for token in output:
        seq.record_token(token, 0.0)
        checker.finish_reasons([seq], [token])
