"""A prompt given as segments: `{"segments": [text or token ids, ...]}`.

The first segment is an ordinary prefix; each later one (a document, a retrieved chunk, a tool
output) may be served from its own cached K/V wherever it appears (runner/engine/step/
segments.py). The segments run as one prompt: their tokens joined, the first tokenized with the
tokenizer's special tokens (its BOS), the others without, so nothing is inserted between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.engine.requests.validation import prompt_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The most segments one prompt may have: each costs a lookup at admission.
MAX_SEGMENTS = 256


@dataclass(frozen=True)
class SegmentedPrompt:
    """The segments of one prompt, each text or a list of token ids, checked at construction."""

    segments: tuple[str | list[int], ...]
    # This prompt's own blend ratio (None: the engine's blend_ratio); 1 runs it as plain tokens.
    blend_ratio: float | None = None

    def __post_init__(self) -> None:
        ratio = self.blend_ratio
        if ratio is not None and (
            not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 <= ratio <= 1
        ):
            raise ValueError(f"blend_ratio must be a number in [0, 1], got {ratio!r}")
        if not self.segments:
            raise ValueError("segments is empty: give at least one segment")
        if len(self.segments) > MAX_SEGMENTS:
            raise ValueError(
                f"{len(self.segments)} segments: a prompt holds at most {MAX_SEGMENTS}"
            )
        for i, segment in enumerate(self.segments):
            if not isinstance(segment, str | list | tuple):
                raise ValueError(
                    f"segment {i} must be text or a list of token ids, got {type(segment).__name__}"
                )
            if not segment or (isinstance(segment, str) and not segment.strip()):
                raise ValueError(f"segment {i} is empty")

    @classmethod
    def of(cls, segments: object, blend_ratio: object = None) -> SegmentedPrompt:
        """From a prompt dict's "segments" and "blend_ratio" values; ValueError naming the
        problem."""
        if not isinstance(segments, list | tuple):
            raise ValueError(
                f"segments must be a list of texts or token-id lists, got {type(segments).__name__}"
            )
        parts = tuple(list(s) if isinstance(s, tuple) else s for s in segments)
        return cls(parts, blend_ratio)  # type: ignore[arg-type]  # checked in __post_init__

    @property
    def text(self) -> str | None:
        """The prompt's text when every segment is text, else None."""
        if all(isinstance(s, str) for s in self.segments):
            return "".join(s for s in self.segments if isinstance(s, str))
        return None

    def token_ids(
        self, tokenizer: PreTrainedTokenizerBase | None, add_special_tokens: bool
    ) -> tuple[list[int], tuple[tuple[int, int], ...]]:
        """The prompt's tokens and the [start, end) of each segment after the first."""
        tokens: list[int] = []
        bounds: list[tuple[int, int]] = []
        for i, segment in enumerate(self.segments):
            try:
                ids = prompt_token_ids(segment, tokenizer, add_special_tokens and i == 0)
            except ValueError as err:
                raise ValueError(f"segment {i}: {err}") from err
            if i:
                bounds.append((len(tokens), len(tokens) + len(ids)))
            tokens.extend(ids)
        return tokens, tuple(bounds)
