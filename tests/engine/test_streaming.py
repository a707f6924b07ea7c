"""Streaming: a request's deltas add up to exactly the text and tokens `generate` returns, every
partial sum is a prefix of that text (nothing handed out is ever taken back: not half a
character, not the start of a stop string, not a space that cleanup removes), and leaving the
loop early frees everything."""

from __future__ import annotations

import dataclasses
import itertools
import signal
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcache import LLM, SamplingParams
from runner.engine.api.streaming import TextStream
from runner.engine.requests import intake as engine_intake
from runner.engine.requests.incremental_text import OutputText
from runner.engine.requests.stopping import StopChecker
from runner.engine.sequence import Sequence
from tests.conftest import tiny_tokenizer

# Byte tokens of the tiny tokenizer are id = 3 + position in ByteLevel's alphabet; these texts
# give spaces before punctuation, a three-byte character and pieces of stop strings.
PIECES = [" ", ".", ",", "'", "s", "n", "t", "a", "\n", "€", "ab"]


def collect(stream: Any, count: int) -> tuple[list[str], list[list[int]], list[Any]]:
    texts, tokens, outputs = [""] * count, [[] for _ in range(count)], [None] * count
    for delta in stream:
        assert outputs[delta.index] is None, "a delta after the request finished"
        texts[delta.index] += delta.text
        tokens[delta.index] += delta.token_ids
        if delta.output is not None:
            outputs[delta.index] = delta.output
        else:  # what is out so far can only grow into the final text
            assert delta.token_ids, "a running request's delta without a token"
    return texts, tokens, outputs


@pytest.mark.parametrize("cleanup", [False, True])
def test_stream_adds_up_to_generate(tiny_llama_tok_dir: Path, cleanup: bool) -> None:
    llm = LLM(str(tiny_llama_tok_dir))
    if cleanup:
        _force_cleanup(llm.tokenizer)
        llm.stopper = StopChecker(llm.hf_config, llm.tokenizer, llm.max_model_len)
    prompts = ["Hello there", "A list: one, two", "x" * 40, "Caches'"]
    params = [
        SamplingParams(max_tokens=40, temperature=1.3, seed=i, ignore_eos=i % 2 == 0)
        for i in range(len(prompts))
    ]
    reference = llm.generate(prompts, params)
    # Stop strings taken from the middle of each reference text, so they do cut.
    stops = [ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 2] for ref in reference]
    stopped = [
        dataclasses.replace(p, stop=[s, "zz"]) if s.strip("\ufffd") else p
        for p, s in zip(params, stops, strict=True)
    ]
    for run_params in (params, stopped):
        expected = llm.generate(prompts, run_params)
        texts, tokens, outputs = collect(llm.stream(prompts, run_params), len(prompts))
        for text, toks, out, ref in zip(texts, tokens, outputs, expected, strict=True):
            assert out is not None and out.text == ref.text and out.token_ids == ref.token_ids
            assert text == ref.text
            assert toks == ref.token_ids
    assert any(len(r.text) < len(p.text) for r, p in zip(expected, reference, strict=True))


def test_text_arrives_as_it_is_generated(default_model_dir: Path) -> None:
    """With a real tokenizer, almost every token's text is out in its own step."""
    llm = LLM(str(default_model_dir))
    conversation = [{"role": "user", "content": "Write a haiku about caches."}]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    deltas = list(llm.stream_chat(conversation, params))
    assert len(deltas) == 30
    assert sum(1 for d in deltas if d.text) >= 25
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == llm.chat([conversation], params)[0].text


def test_stream_chat_equals_chat(tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir))
    conversation = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = llm.chat([conversation], params)[0]
    texts, tokens, _ = collect(llm.stream_chat(conversation, params), 1)
    assert (texts[0], tokens[0]) == (expected.text, expected.token_ids)


def test_leaving_the_loop_early_frees_everything(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    prompts = [[5 + i] * (20 + i) for i in range(3)]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    for delta in llm.stream(prompts, params):
        if delta.index == 1:
            break
    # The generator is closed when the loop leaves it (CPython frees it at once).
    assert not llm.has_unfinished()
    llm.block_manager.check_integrity()
    assert llm.block_manager.stats.blocks_in_use == 0
    fresh = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4).generate(prompts, params)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in fresh]


def test_abort_request(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    llm.add_request([5, 6, 7], params, request_id="a")
    llm.add_request([8, 9], params, request_id="b")
    llm.step()
    llm.step()
    out = llm.abort_request("a")
    assert out is not None and out.finish_reason == "abort" and len(out.token_ids) == 2
    assert llm.abort_request("a") is None and llm.abort_request("nope") is None
    rest = llm.run_until_done()
    assert [o.request_id for o in rest] == ["b"] and len(rest[0].token_ids) == 50
    llm.block_manager.check_integrity()


@settings(max_examples=300, deadline=None)
# Cleanup turns "t ' b" into "t'b": the space held back before "'" joins "t", sent before it,
# to a stop string.
@example(pieces=["a", " ", "t", " ", "'", " ", "b"], stop="t'", cleanup=True)
# " ' " takes the space that " ." gives back once the "." comes: "a'" becomes "a '.".
@example(pieces=["a", " ", "'", " ", "."], stop="", cleanup=True)
@given(
    pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=25),
    stop=st.lists(st.sampled_from(PIECES), min_size=0, max_size=3).map("".join),
    cleanup=st.booleans(),
)
def test_deltas_never_take_text_back(pieces: list[str], stop: str, cleanup: bool) -> None:
    """Byte tokens fed one at a time through the real stop checker: every partial sum of the
    deltas is a prefix of the final text, and the last delta completes it."""
    tokenizer = _byte_tokenizer(cleanup)
    stopper = StopChecker(SimpleNamespace(eos_token_id=2), tokenizer, max_model_len=10_000)
    assert stopper.cleans_up_spaces == cleanup
    token_ids = tokenizer.encode("".join(pieces), add_special_tokens=False)
    params = SamplingParams(max_tokens=10_000, stop=stop or None)
    seq = Sequence(seq_id=0, request_id="0", prompt_token_ids=[1], params=params, root=0)
    stream, sent = TextStream(stopper), ""
    for token in token_ids:
        seq.record_token(token, 0.0)
        if stopper.finish_reasons([seq], [token])[0] is not None:
            break
        sent += stream.settled_delta(seq)
    final = stopper.output_text(seq)
    assert final.startswith(sent)
    sent += stream.final_delta(final)
    assert sent == final


@settings(max_examples=300, deadline=None)
@given(
    token_ids=st.lists(
        st.one_of(
            st.integers(0, 2),  # <unk> <s> </s>: special, dropped from the text
            st.integers(3, 258),  # single bytes: invalid UTF-8 and halves of characters
            st.sampled_from([3 + 0xE2, 3 + 0x82, 3 + 0xAC]),  # pieces of a 3-byte character
            st.integers(259, 300),  # past the tokenizer: a padded vocabulary's ids
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_output_text_equals_a_whole_decode(token_ids: list[int]) -> None:
    """Extended one token at a time (the byte-level tokenizer's DecodeStream), the decoded
    output is always the whole output's decode less a trailing incomplete character (held
    back either way)."""
    stopper = StopChecker(SimpleNamespace(eos_token_id=2), _byte_tokenizer(False), 10_000)
    output = OutputText(stopper)
    assert output.incremental
    for n in range(1, len(token_ids) + 1):
        whole = stopper.decode(token_ids[:n])
        assert output.of(token_ids[:n]).rstrip("\ufffd") == whole.rstrip("\ufffd")


def test_streaming_does_not_decode_the_whole_output_each_step(
    tiny_llama_tok_dir: Path, monkeypatch: Any
) -> None:
    """With a byte-level tokenizer a stream extends each sample's text by its new tokens:
    whole outputs are decoded only when they finish (for the output and the last delta)."""
    llm = LLM(str(tiny_llama_tok_dir))
    whole_decodes = {"n": 0}
    decode = llm.stopper.decode

    def counted(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        whole_decodes["n"] += 1
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(llm.stopper, "decode", counted)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    texts, _, outputs = collect(llm.stream(["Hello", "there"], params), 2)
    assert texts == [o.text for o in outputs]
    assert whole_decodes["n"] <= 4  # 80 tokens streamed


def on_call(real: Callable[..., Any], n: int, action: Callable[[], None]) -> Callable[..., Any]:
    """`real`, but its n-th call first does `action` (raises KeyboardInterrupt, or sends a
    real SIGINT), as a Ctrl-C landing there would."""
    calls = {"n": 0}

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == n:
            action()
        return real(*args, **kwargs)

    return wrapped


def raise_interrupt() -> None:
    raise KeyboardInterrupt


_TOKENIZERS: dict[bool, Any] = {}


def _byte_tokenizer(cleanup: bool) -> Any:
    if cleanup not in _TOKENIZERS:
        tokenizer = tiny_tokenizer()
        if cleanup:
            _force_cleanup(tokenizer)
        _TOKENIZERS[cleanup] = tokenizer
    return _TOKENIZERS[cleanup]


def _force_cleanup(tokenizer: Any) -> None:
    """Make a BPE tokenizer clean up spaces before punctuation, which transformers now skips
    for BPE but older versions and WordPiece tokenizers do."""
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert tokenizer.decode(tokenizer.encode("a .", add_special_tokens=False)) == "a."


def test_aborting_inside_the_loop_ends_that_request_only(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reasons: dict[int, str | None] = {}
    outputs = {}
    aborted = None
    for delta in llm.stream([[5, 6, 7], [8, 9, 10]], params):
        if delta.index == 0 and aborted is None:
            aborted = llm.abort_request(delta.request_id)
        reasons[delta.index] = delta.finish_reason
        if delta.output is not None:
            outputs[delta.index] = delta.output
    assert aborted is not None and aborted.finish_reason == "abort"
    assert reasons == {0: "abort", 1: "length"} and list(outputs) == [1]
    assert len(outputs[1].token_ids) == 12 and not llm.has_unfinished()


def test_a_stream_never_iterated_queues_nothing(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=3, temperature=0)
    stream = llm.stream([[5, 6, 7]], params)
    assert not llm.has_unfinished()
    del stream
    assert len(llm.generate([[8, 9]], params)) == 1


def test_generate_keeps_other_requests_outputs_for_step(tiny_llama_dir: Path) -> None:
    """A request added with add_request that finishes while generate runs is not lost: the
    next step() hands it back; an automatic id never takes one a caller gave."""
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.add_request([5, 6, 7], params, request_id="1")
    llm.add_request([5, 6, 8], params, request_id="2")
    outs = llm.generate([[8, 9], [10, 11]], dataclasses.replace(params, max_tokens=6))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert {o.request_id for o in outs}.isdisjoint({"1", "2"})
    kept = llm.step()
    assert sorted(o.request_id for o in kept) == ["1", "2"]
    assert not llm.has_unfinished()


def test_static_batch_goes_on_after_an_abort(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), batching="static")
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.add_request([5, 6, 7], short, request_id="short")
    llm.add_request([8, 9, 10], dataclasses.replace(short, max_tokens=30), request_id="long")
    while not any(o.request_id == "short" for o in llm.step()):
        pass
    assert llm.abort_request("long") is not None
    assert llm.block_manager.stats.blocks_in_use == 0
    assert len(llm.generate([[11, 12]], short)[0].token_ids) == 2
    for _delta in llm.stream([[11, 12], [13, 14, 15]], dataclasses.replace(short, max_tokens=9)):
        break  # a stream left early aborts its batch, which must not jam the next one
    assert len(llm.generate([[11, 12]], short)[0].token_ids) == 2
    llm.block_manager.check_integrity()


def test_kept_outputs_are_never_lost(tiny_llama_dir: Path, monkeypatch: Any) -> None:
    """Outputs of requests that finish while generate or a stream run the engine for others:
    run_until_done hands them back; an interrupted step keeps them; an interrupted generate
    aborts what it queued instead of leaving it to run."""
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.add_request([5, 6, 7], params, request_id="x")
    llm.generate([[8, 9]], dataclasses.replace(params, max_tokens=6))
    assert llm.has_unfinished()  # x finished, its output not yet handed back
    run = llm.runner.run

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    llm.add_request([5, 6, 8], params, request_id="y")
    monkeypatch.setattr(llm.runner, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    monkeypatch.setattr(llm.runner, "run", run)
    assert sorted(o.request_id for o in llm.run_until_done()) == ["x", "y"]
    monkeypatch.setattr(llm.runner, "run", on_call(run, 2, raise_interrupt))
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[10, 11], [12, 13]], params)
    assert not llm.has_unfinished()
    llm.block_manager.check_integrity()


# Where a Ctrl-C may land while a step finishes requests: (object on the engine, method).
INTERRUPT_POINTS = [
    ("scheduler", "schedule"),
    ("block_manager", "commit"),
    ("stopper", "finish_reasons"),
    ("stopper", "output_text"),
    ("scheduler", "finish"),
    ("block_manager", "free"),
    ("recorder", "on_step"),
    ("recorder", "on_finish"),
]


@pytest.mark.parametrize("where", INTERRUPT_POINTS, ids=lambda w: ".".join(w))
@pytest.mark.parametrize("mode", ["continuous", "static", "samples"])
def test_a_ctrl_c_while_a_step_finishes_requests_loses_nothing(
    tiny_llama_dir: Path, monkeypatch: Any, where: tuple[str, str], mode: str
) -> None:
    """A real SIGINT arriving inside the step where two requests finish (while it schedules,
    commits blocks, checks stops, decodes text, frees blocks or records the step): step()
    raises KeyboardInterrupt only once its books are whole, so both outputs come back with no
    token more than asked for, every block is accounted for, and the engine goes on."""
    batching = "static" if mode == "static" else "continuous"
    llm = LLM(str(tiny_llama_dir), record_metrics=True, batching=batching)
    params = SamplingParams(max_tokens=2, temperature=0.8, seed=1, ignore_eos=True)
    params = dataclasses.replace(params, n=2) if mode == "samples" else params
    llm.add_request([5, 6, 7], params, request_id="a")
    llm.add_request([8, 9], params, request_id="b")
    llm.step()  # prefill: one token each; both finish in the next step
    target = getattr(llm, where[0])
    ctrl_c = on_call(getattr(target, where[1]), 1, lambda: signal.raise_signal(signal.SIGINT))
    monkeypatch.setattr(target, where[1], ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(3):  # the patched call may come in a later step (free, in static mode)
            llm.step()
    outputs = {o.request_id: o for o in llm.run_until_done()}
    assert sorted(outputs) == ["a", "b"]
    for output in outputs.values():
        assert [len(s.token_ids) for s in output.outputs] == [2] * params.n
        assert {s.finish_reason for s in output.outputs} == {"length"}
    assert not llm.has_unfinished()
    llm.block_manager.check_integrity()
    assert llm.block_manager.stats.blocks_in_use == 0
    again = llm.generate([[5, 6, 7]], dataclasses.replace(params, max_tokens=3))
    assert len(again[0].token_ids) == 3


@pytest.mark.parametrize("call", ["generate", "stream"])
def test_a_ctrl_c_while_prompts_are_queued_leaves_none_behind(
    tiny_llama_dir: Path, monkeypatch: Any, call: str
) -> None:
    """Ctrl-C while the third of four prompts is being tokenized: the two already queued are
    taken back, and nothing is left waiting for a step() that nobody calls."""
    llm = LLM(str(tiny_llama_dir))
    real = engine_intake.prompt_token_ids
    monkeypatch.setattr(engine_intake, "prompt_token_ids", on_call(real, 3, raise_interrupt))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[5, 6], [7, 8], [9, 10], [11, 12]]
    with pytest.raises(KeyboardInterrupt):
        if call == "generate":
            llm.generate(prompts, params)
        else:
            list(llm.stream(prompts, params))
    assert not llm.has_unfinished() and llm.block_manager.stats.blocks_in_use == 0
    monkeypatch.setattr(engine_intake, "prompt_token_ids", real)
    assert [len(o.token_ids) for o in llm.generate(prompts, params)] == [4] * 4


@pytest.mark.parametrize("lengths", [(2, 6), (6, 2), (3, 3)])
def test_two_streams_side_by_side_both_get_their_outputs(
    tiny_llama_dir: Path, lengths: tuple[int, int]
) -> None:
    """Each stream's steps also run the other's request, which may finish in them."""
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(temperature=0, ignore_eos=True)
    first = llm.stream([[5, 6, 7]], dataclasses.replace(params, max_tokens=lengths[0]))
    second = llm.stream([[8, 9, 10]], dataclasses.replace(params, max_tokens=lengths[1]))
    outputs: dict[str, list[Any]] = {"first": [], "second": []}
    for a, b in itertools.zip_longest(first, second):
        for name, delta in (("first", a), ("second", b)):
            if delta is not None and delta.output is not None:
                outputs[name].append(delta.output)
    assert [len(o.token_ids) for o in outputs["first"]] == [lengths[0]]
    assert [len(o.token_ids) for o in outputs["second"]] == [lengths[1]]
    assert not llm.has_unfinished()


def test_outputs_go_only_to_the_caller_that_queued_them(tiny_llama_dir: Path) -> None:
    """A waiting output keeps its id (an automatic id never takes it), step() inside a
    stream's loop does not take the stream's outputs, and a stream closed while its output
    waits leaves nothing behind."""
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.add_request([5, 6, 7], dataclasses.replace(params, max_tokens=1), request_id="3")
    fresh = LLM(str(tiny_llama_dir))
    for prompt in ([8, 9], [10, 11], [12, 13]):  # automatic ids run past "3"
        assert (
            llm.generate([prompt], params)[0].token_ids
            == fresh.generate([prompt], params)[0].token_ids
        )
    assert [o.request_id for o in llm.step()] == ["3"]

    finals = []
    for delta in llm.stream([[5, 6, 7]], dataclasses.replace(params, max_tokens=4)):
        assert llm.step() == []  # runs a step, but the stream's output is the stream's
        if delta.output is not None:
            finals.append(delta.output)
    assert len(finals) == 1 and len(finals[0].token_ids) == 4

    stream = llm.stream([[5, 6, 8]], dataclasses.replace(params, max_tokens=3))
    next(stream)
    llm.generate([[9, 10]], dataclasses.replace(params, max_tokens=8))  # finishes the stream's
    stream.close()
    assert not llm.has_unfinished() and llm.step() == []


def test_a_paused_stream_neither_blocks_nor_lends_its_ids(tiny_llama_dir: Path) -> None:
    """While a stream waits between deltas: a step() loop drains everything else and ends
    (the stream's waiting outputs are not step()'s to wait for), its ids cannot be given to
    new requests, and automatic ids of several samples skip ids given before."""
    llm = LLM(str(tiny_llama_dir))
    short = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    stream = llm.stream([[5, 6, 7], [8, 9, 10]], [short, dataclasses.replace(short, max_tokens=4)])
    delta = next(stream)
    while delta.output is None:
        delta = next(stream)
    with pytest.raises(ValueError, match="already running"):
        llm.add_request([11, 12], short, request_id=delta.output.request_id)
    llm.add_request([11, 12], short, request_id="mine")
    steps = 0
    while llm.has_unfinished() and steps < 20:
        llm.step()
        steps += 1
    assert steps < 20
    rest = list(stream)
    assert rest[-1].output is not None and len(rest[-1].output.token_ids) == 4
    llm.add_request([5, 6], short, request_id="1#0")
    llm.add_request([5, 6], dataclasses.replace(short, n=2))  # its automatic id skips "1"
    assert len(llm.run_until_done()) == 2
