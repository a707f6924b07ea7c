"""When a request is done, and the text it hands back."""

from __future__ import annotations

from typing import Any

from runner.sequence import Sequence


class StopChecker:
    """Decides after each sampled token whether its request is finished, and why."""

    def __init__(self, config: Any, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids(config, tokenizer)

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """ "stop" for a stop token, EOS or stop string (the string is cut from the text later);
        "length" at max_tokens or the end of the model's context; None to go on."""
        params = seq.params
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.eos_ids:
            return "stop"
        if params.stop_strings and self.tokenizer is not None:
            cut = first_stop(self.decode(seq.output_token_ids), params.stop_strings)
            if cut is not None:
                seq.stop_text_cut = cut
                return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def output_text(self, seq: Sequence) -> str:
        text = self.decode(seq.output_token_ids)
        return text if seq.stop_text_cut is None else text[: seq.stop_text_cut]


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index of the earliest stop string in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def eos_ids(config: Any, tokenizer: Any) -> set[int]:
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
