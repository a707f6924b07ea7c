"""Streaming: each request's new tokens and text after every engine step.

The text a stream hands out must add up to the request's final `text` exactly, so a delta only
ever holds text that later tokens cannot change: a trailing incomplete UTF-8 character (decoded
as U+FFFD until its last byte comes), a trailing piece that could be the start of a stop string
(the final text is cut before the stop string), and, for tokenizers that clean up spaces before
punctuation, the last few characters, are held back until they settle or the request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from runner.engine.api.engine import Engine
from runner.engine.api.frozen_heap import frozen_heap
from runner.engine.requests.incremental_text import OutputText
from runner.engine.requests.outputs import RequestOutput
from runner.engine.requests.stopping import StopChecker
from runner.engine.sequence import Sequence, request_id_of

# clean_up_tokenization_spaces rewrites " ." " ?" " !" " ," " ' " " n't" " 'm" " 's" " 've"
# " 're", one rule after another over the whole text: what comes next can change the last few
# characters, and one rule's rewrite can undo another's (" ' " takes a space that " ." would
# have taken: "a ' " reads "a'", "a ' ." reads "a '."). Characters further back than this stay.
CLEANUP_HOLD_CHARS = 8


@dataclass
class StreamDelta:
    """What one sample of a request produced in one step. `index` is the prompt's position in
    the call; `finish_reason` is set on the sample's last delta, and `output` on the request's
    last (once every sample has finished), which may carry no new token (a stop string cut)."""

    index: int
    request_id: str
    token_ids: list[int]
    text: str
    sample_index: int = 0
    finish_reason: str | None = None
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        """Whether the request (every sample of it) is done."""
        return self.output is not None


class TextStream:
    """One request's text handed out so far, and the rule for how much more is settled."""

    def __init__(self, stopper: StopChecker, skip_special_tokens: bool = True) -> None:
        self.stopper = stopper
        self.output = OutputText(stopper, skip_special_tokens)
        self.sent = 0  # characters of the decoded output already handed out

    def settled_delta(self, seq: Sequence) -> str:
        """The new text of a running request that no later token can change."""
        text = self.output.of(seq.output_token_ids)
        end = min(len(text.rstrip("\ufffd")), self.output.settled_chars)
        while True:  # each hold can expose the other's case at the new end: until neither moves
            held = end - _stop_prefix_at_end(text[:end], seq.params.stop_strings)
            if self.stopper.cleans_up_spaces:  # its rules may still rewrite the last characters
                held = min(held, max(0, len(text) - CLEANUP_HOLD_CHARS))
            if held == end:
                return self._take(text, end)
            end = held

    def final_delta(self, final_text: str) -> str:
        """Whatever of the final text has not been handed out."""
        return self._take(final_text, len(final_text))

    def _take(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        piece = text[self.sent : end]
        self.sent = end
        return piece


def _stop_prefix_at_end(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins some stop string (0 if none)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop), len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def stream_requests(
    llm: Engine, queue: Callable[[], list[list[Sequence]]]
) -> Iterator[StreamDelta]:
    """Queue the requests (`queue()` returns each one's samples, in order) when iteration
    starts, then step `llm` until every one has finished, yielding after each step a delta for
    each sample that produced a token or finished, in queue order. Closing the iterator early
    (a `break` in the caller's loop) aborts the requests still running; a request aborted with
    `abort_request` meanwhile ends with deltas whose finish_reason is "abort" and no output
    (the caller got it from `abort_request`). Queueing waits for the first `next`, so a stream
    that is never iterated leaves nothing queued."""
    with llm.lock:  # queued and reserved at once: no other caller's step may finish them between
        queued = queue()
        index_of = {request_id_of(samples[0]): i for i, samples in enumerate(queued)}
        llm.reserve_outputs(set(index_of))
    running = [seq for samples in queued for seq in samples]
    texts = {seq.seq_id: TextStream(llm.stopper, seq.params.skip_special_tokens) for seq in running}
    tokens_sent = {seq.seq_id: 0 for seq in running}
    unfinished = set(index_of)  # requests whose output has not been handed out
    try:
        with frozen_heap():  # until the end, or until the caller closes the stream
            while running:
                with llm.lock:  # one view of the engine: no other thread steps meanwhile
                    # Finished in this step, or in another caller's step since the last one.
                    outputs = llm.step_for(unfinished) if unfinished else []
                    deltas: list[StreamDelta] = []
                    for seq in running:
                        new_tokens = seq.output_token_ids[tokens_sent[seq.seq_id] :]
                        if not new_tokens and not seq.is_finished:
                            continue
                        tokens_sent[seq.seq_id] += len(new_tokens)
                        stream, rid = texts[seq.seq_id], request_id_of(seq)
                        if seq.is_finished:
                            text = stream.final_delta(llm.stopper.output_text(seq))
                        else:
                            text = stream.settled_delta(seq)
                        reason = seq.finish_reason if seq.is_finished else None
                        deltas.append(
                            StreamDelta(
                                index_of[rid], rid, new_tokens, text, seq.sample_index, reason
                            )
                        )
                    running = [seq for seq in running if not seq.is_finished]
                    for output in outputs:
                        unfinished.discard(output.request_id)
                        ours = [d for d in deltas if d.request_id == output.request_id]
                        if ours:  # its last sample's final delta is in this step's
                            ours[-1].output = output
                        else:  # that delta went out before its output came back
                            index = index_of[output.request_id]
                            deltas.append(
                                StreamDelta(index, output.request_id, [], "", output=output)
                            )
                    if not deltas and not any(llm.samples_of(rid) for rid in unfinished):
                        raise RuntimeError(f"engine stopped with {sorted(unfinished)} unfinished")
                    # Aborted by the caller meanwhile: its samples' last deltas are out; no output.
                    unfinished = {
                        rid for rid in unfinished if llm.samples_of(rid) or rid in llm.kept
                    }
                yield from deltas
    finally:  # left early: what still runs is aborted, what waits is dropped
        llm.release_outputs(set(index_of))
