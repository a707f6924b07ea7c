"""Streaming: each request's new tokens and text after every engine step.

The text a stream hands out must add up to the request's final `text` exactly, so a delta only
ever holds text that later tokens cannot change: a trailing incomplete UTF-8 character (decoded
as U+FFFD until its last byte comes), a trailing piece that could be the start of a stop string
(the final text is cut before the stop string), and, for tokenizers that clean up spaces before
punctuation, a trailing space and the few characters after it, are held back until they settle
or the request ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from runner.engine_core import Engine
from runner.outputs import RequestOutput
from runner.sequence import Sequence
from runner.stopping import StopChecker

# clean_up_tokenization_spaces rewrites " ." " ?" " !" " ," " ' " " n't" " 'm" " 's" " 've"
# " 're": a space followed by at most three characters can still lose its space.
CLEANUP_HOLD_CHARS = 4


@dataclass
class StreamDelta:
    """What one request produced in one step. `index` is its prompt's position in the call;
    `output` is set on its last delta, which may carry no new token (a stop string cut)."""

    index: int
    request_id: str
    token_ids: list[int]
    text: str
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None


class TextStream:
    """One request's text handed out so far, and the rule for how much more is settled."""

    def __init__(self, stopper: StopChecker) -> None:
        self.stopper = stopper
        self.sent = 0  # characters of the decoded output already handed out

    def settled_delta(self, seq: Sequence) -> str:
        """The new text of a running request that no later token can change."""
        text = self.stopper.decode(seq.output_token_ids)
        end = len(text.rstrip("\ufffd"))
        end -= _stop_prefix_at_end(text[:end], seq.params.stop_strings)
        if self.stopper.cleans_up_spaces:
            space = text.rfind(" ", 0, end)
            if space >= 0 and end - space <= CLEANUP_HOLD_CHARS:
                end = space
        return self._take(text, end)

    def final_delta(self, output: RequestOutput) -> str:
        """Whatever of the final text has not been handed out."""
        return self._take(output.text, len(output.text))

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


def stream_requests(llm: Engine, seqs: list[Sequence]) -> Iterator[StreamDelta]:
    """Step `llm` until every one of `seqs` has finished, yielding after each step a delta for
    each of them that produced a token or finished, in the order of `seqs`. Closing the
    iterator early (a `break` in the caller's loop) aborts the requests still running."""
    texts = {seq.seq_id: TextStream(llm.stopper) for seq in seqs}
    tokens_sent = {seq.seq_id: 0 for seq in seqs}
    pending = dict(enumerate(seqs))
    try:
        while pending:
            if not llm.has_unfinished():
                raise RuntimeError(f"engine stopped with prompts {sorted(pending)} unfinished")
            finished = {o.request_id: o for o in llm.step()}
            for index, seq in list(pending.items()):
                output = finished.get(seq.request_id)
                new_tokens = seq.output_token_ids[tokens_sent[seq.seq_id] :]
                if not new_tokens and output is None:
                    continue
                tokens_sent[seq.seq_id] += len(new_tokens)
                stream = texts[seq.seq_id]
                text = stream.final_delta(output) if output else stream.settled_delta(seq)
                if output is not None:
                    del pending[index]
                yield StreamDelta(index, seq.request_id, new_tokens, text, output)
    finally:
        for seq in pending.values():
            llm.abort_request(seq.request_id)
