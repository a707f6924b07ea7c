"""When a request is done, and the text it hands back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.engine.requests.incremental_text import decode_anchor
from runner.engine.sequence import Sequence
from runner.sampling.logprobs import TokenLogprobs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Tokens beyond a stop string's UTF-8 length in the tail that is decoded each step. A token
# that is not special yields at least one byte, so a stop string of n bytes that ends in the
# newest token starts within its last n such tokens; the margin covers a start-of-text artifact
# of the tail's first tokens (a dropped leading space, a character cut in half).
TAIL_MARGIN_TOKENS = 8


class StopChecker:
    """Decides after each sampled token whether its request is finished, and why."""

    def __init__(
        self,
        config: object,
        tokenizer: PreTrainedTokenizerBase | None,
        max_model_len: int,
        generation_eos: set[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # The config's and the tokenizer's EOS, and those of generation_config.json.
        self.eos_ids = eos_ids(config, tokenizer) | (generation_eos or set())
        # Cleaning up tokenization spaces drops a space before punctuation (two in " ' "), so a
        # token can yield no byte of the final text: up to 3 tokens per byte of a stop string.
        self.cleans_up_spaces = tokenizer is not None and cleans_up_spaces(tokenizer)
        # A SentencePiece-style decoder's output can be decoded piecewise after this token
        # (runner/engine/requests/incremental_text.py); cleaning up spaces rewrites across tokens.
        self.decode_anchor = (
            None if tokenizer is None or self.cleans_up_spaces else decode_anchor(tokenizer)
        )
        self._tokens_per_byte = 3 if self.cleans_up_spaces else 1
        # Tokens a decode may drop (skip_special_tokens): the tail counts past them, and past
        # ids from the tokenizer's size up (a model's vocabulary padded past its tokenizer's:
        # they decode to nothing).
        self.textless_ids: set[int] = set()
        self._text_vocab = len(tokenizer) if tokenizer is not None else 0
        if tokenizer is not None:
            self.textless_ids.update(tokenizer.all_special_ids)
            self.textless_ids.update(getattr(tokenizer, "added_tokens_decoder", {}))

    def finish_reasons(self, seqs: list[Sequence], tokens: list[int]) -> list[str | None]:
        """Per sequence, just after `record_token(token)`: "stop" for a stop token, EOS or stop
        string (the string is cut from the text later, see `output_text`); "length" at
        max_tokens or the end of the model's context; None to go on.

        Stop strings are looked for in the decoded tail of each output, all tails decoded in
        one call; only a tail that shows one has its whole output decoded, to find the cut
        where a full decode puts it. Decoding every whole output every step instead costs
        O(output length) per token: ~0.1 ms a sequence at 200 tokens, tens of ms a step."""
        reasons = [self._token_reason(seq, token) for seq, token in zip(seqs, tokens, strict=True)]
        if self.tokenizer is not None:
            going = [  # a stop string counts once it ends past the first min_tokens tokens
                i
                for i, seq in enumerate(seqs)
                if reasons[i] is None
                and seq.params.stop_strings
                and len(seq.output_token_ids) > seq.params.min_tokens
            ]
            for skip in (True, False):  # one batched decode per kind of text
                group = [i for i in going if seqs[i].params.skip_special_tokens is skip]
                if not group:
                    continue
                tails = [self._tail(seqs[i]) for i in group]
                decoded = self.tokenizer.batch_decode(tails, skip_special_tokens=skip)
                for i, tail in zip(group, decoded, strict=True):
                    if self._stopped_on_string(seqs[i], tail):
                        reasons[i] = "stop"
        for i, seq in enumerate(seqs):
            if reasons[i] is None and (
                len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len
            ):
                reasons[i] = "length"
        return reasons

    def record_tokens(
        self,
        seqs: list[Sequence],
        emitted: list[list[int]],
        logprobs: list[TokenLogprobs | None],
        now: float,
    ) -> list[tuple[Sequence, str]]:
        """Record each sequence's new tokens of a step (several when a draft was accepted, the
        first with its log-probabilities), one round at a time so each is checked as if it
        came alone; returns the (sequence, reason) of those that ended. A token after the one
        that ends a sequence is never recorded: `emitted[i]` is cut to what was."""
        finishing: list[tuple[Sequence, str]] = []
        going = list(range(len(seqs)))
        for j in range(max(map(len, emitted), default=0)):  # round j: each one's j-th token
            going = [i for i in going if j < len(emitted[i])]
            for i in going:
                seqs[i].record_token(emitted[i][j], now, logprobs[i] if j == 0 else None)
            reasons = self.finish_reasons([seqs[i] for i in going], [emitted[i][j] for i in going])
            for i, reason in zip(going, reasons, strict=True):
                if reason is not None:
                    finishing.append((seqs[i], reason))
                    emitted[i] = emitted[i][: j + 1]
        return finishing

    def _token_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if seq.grammar is not None and seq.grammar.finished:  # it took the grammar's EOS
            return "stop"
        if len(seq.output_token_ids) < params.min_tokens:  # such tokens were banned anyway
            return None
        if params.stop_token_ids and token in params.stop_token_ids:
            if params.ignore_eos or token not in self.eos_ids:  # EOS is no stop_reason (vLLM)
                seq.stop_reason = token
            return "stop"
        if not params.ignore_eos and token in self.eos_ids:
            return "stop"
        return None

    def _tail(self, seq: Sequence) -> list[int]:
        """The newest output tokens, enough of them to hold any stop string that ends in the
        last one (see TAIL_MARGIN_TOKENS)."""
        stop_bytes = max(len(s.encode()) for s in seq.params.stop_strings)
        need = stop_bytes * self._tokens_per_byte + TAIL_MARGIN_TOKENS
        out = seq.output_token_ids
        start = len(out)
        while start > 0 and need > 0:
            start -= 1
            if out[start] < self._text_vocab and out[start] not in self.textless_ids:
                need -= 1
        return out[start:]

    def _stopped_on_string(self, seq: Sequence, tail_text: str) -> bool:
        """Whether a stop string has appeared; sets the sequence's text cut when it has."""
        params = seq.params
        if first_stop(tail_text, params.stop_strings) is None:
            return False
        # Only a stop string that ends past the text of the first min_tokens tokens counts.
        # A character the first min_tokens tokens leave half-decoded (U+FFFD) ends later.
        skip = params.skip_special_tokens
        head = self.decode(seq.output_token_ids[: params.min_tokens], skip)
        floor = len(head.rstrip("\ufffd"))
        found = first_stop(self.decode(seq.output_token_ids, skip), params.stop_strings, floor)
        if found is None:  # the tail's own decode made it up (a space or character its cut
            return False  # split), or it ends within the first min_tokens tokens
        cut, stop = found
        seq.stop_text_cut = cut + len(stop) if params.include_stop_str_in_output else cut
        seq.stop_reason = stop
        return True

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def output_text(self, seq: Sequence) -> str:
        text = self.decode(seq.output_token_ids, seq.params.skip_special_tokens)
        return text if seq.stop_text_cut is None else text[: seq.stop_text_cut]


def cleans_up_spaces(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether decoding drops the space before punctuation (`clean_up_tokenization_spaces`,
    which recent transformers ignores for BPE tokenizers): asked of the decoder itself, since
    the attribute alone does not say. True when the probe fails, the cautious answer."""
    try:
        ids = tokenizer.encode("a . b", add_special_tokens=False)
        return " ." not in str(tokenizer.decode(ids, skip_special_tokens=True))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say is treated as cleaning up
        return True


def first_stop(text: str, stops: tuple[str, ...], floor: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends past `floor` characters, and where it
    starts (the first listed of those starting there), or None."""
    hits = [(text.find(s, max(0, floor - len(s) + 1)), s) for s in stops]
    found = [(i, s) for i, s in hits if i >= 0]
    return min(found, key=lambda hit: hit[0]) if found else None


def eos_ids(config: object, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """The model's end-of-sequence ids, from its config and its tokenizer."""
    ids: set[int] = set()
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list | tuple):
        ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
