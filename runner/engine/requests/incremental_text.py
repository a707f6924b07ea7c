"""A running output's text, extended token by token instead of decoded whole at every step.

Decoding the whole output again each step costs O(length) a token: 0.4 s over a 2,000-token
answer with SmolLM2's tokenizer, and more with a 262k-token SentencePiece vocabulary (Gemma),
for every request that streams. Two tokenizer families extend in O(new tokens) instead, with
the whole decode's result:

- Byte-level decoders (GPT-2, Llama 3, Qwen, SmolLM) decode to the UTF-8 of their tokens' bytes
  joined: the tokenizers library's DecodeStream, which holds a character back until its last
  byte comes.
- SentencePiece-style decoders (Llama 2, Mistral, Gemma): a `Sequence` of per-token rewrites
  (`Replace`, `Metaspace`), `ByteFallback`, `Fuse` and a `Strip` of the text's start. Two
  things in them are not token by token. The start of the text may lose its first space, so
  the text is decoded whole until it has a first character. And a run of byte tokens
  (`<0xE2>`...) decodes all at once, as UTF-8, or as one U+FFFD per byte if the run is not
  valid UTF-8 as a whole: a run is open until a token that is not a byte comes (and is not
  dropped from the text: a special token skipped, an id past the tokenizer, which the run goes
  on across). So the text of the tokens up to the last one that closes a run is settled, and
  later tokens are decoded after an anchor token (a piece such as "a" that decodes to itself
  anywhere), which keeps the text's-start rules off them, and the anchor's text is cut off.

Other decoders, and tokenizers that clean up spaces after decoding (a rewrite across tokens),
decode whole, as does a text whose incremental decode goes wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from tokenizers import decoders

try:  # tokenizers 0.21+; an older one decodes byte-level outputs whole
    from tokenizers.decoders import DecodeStream
except ImportError:
    DecodeStream = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The decoder steps whose output is each token's own, except at the text's start and inside
# runs of byte tokens (see above). A Strip that cuts the text's end is not among them.
PIECEWISE_STEPS = {"Replace", "Metaspace", "ByteFallback", "Fuse", "Strip"}
ANCHOR_PIECES = ("a", "x", "0", "!")


class TextDecoder(Protocol):
    """What the running text needs of the stop checker (runner/engine/requests/stopping.py): the
    tokenizer and how it decodes. A Protocol, so that the checker may import this module."""

    tokenizer: PreTrainedTokenizerBase | None
    cleans_up_spaces: bool
    decode_anchor: int | None
    textless_ids: set[int]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class OutputText:
    """A running sample's output decoded so far; each call passes the ids of the last call
    extended by the new tokens."""

    def __init__(self, stopper: TextDecoder, skip_special_tokens: bool = True) -> None:
        self.stopper = stopper
        self.skip_special_tokens = skip_special_tokens
        self._backend = _byte_level_backend(stopper)
        self._stream = (
            DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend else None
        )
        self._pieces = (
            PiecewiseText(
                stopper.tokenizer, self._decode, stopper.decode_anchor, stopper.textless_ids
            )
            if self._stream is None and stopper.decode_anchor is not None
            else None
        )
        self._fed = 0  # tokens given to the DecodeStream
        self._text = ""
        self._last_length = 0

    @property
    def incremental(self) -> bool:
        """Whether new tokens extend the text (else each call decodes the whole output)."""
        return self._stream is not None or self._pieces is not None

    @property
    def settled_chars(self) -> int:
        """How much of the last text returned no later token can change: all of it, except a
        SentencePiece-style decoder's text after its last closed byte run (a trailing
        character still incomplete is the caller's to hold back)."""
        return self._pieces.settled_chars if self._pieces is not None else self._last_length

    def of(self, token_ids: list[int]) -> str:
        """The decoded text of `token_ids`."""
        text = self._text_of(token_ids)
        self._last_length = len(text)
        return text

    def _text_of(self, token_ids: list[int]) -> str:
        try:
            if self._stream is not None:
                for token in token_ids[self._fed :]:
                    piece = self._stream.step(self._backend, token)
                    self._fed += 1
                    if piece:
                        self._text += piece
                return self._text
            if self._pieces is not None:
                return self._pieces.of(token_ids)
        except Exception:  # noqa: BLE001 - an output the decoder refuses: decode whole from now
            self._stream = self._pieces = None
        return self._decode(token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.stopper.decode(token_ids, self.skip_special_tokens)


class PiecewiseText:
    """The text of a SentencePiece-style decoder's output, settled up to the last token that
    closes a byte run (the module's docstring says why that is enough)."""

    def __init__(
        self,
        tokenizer: Any,
        decode: Callable[[list[int]], str],
        anchor: int,
        textless_ids: set[int],
    ) -> None:
        self._tokenizer = tokenizer
        # Special and added tokens: a decode may drop them (skip_special_tokens), and a byte run
        # goes on across a dropped token. Taking them all as open is the cautious side.
        self._textless_ids = textless_ids
        self._decode = decode
        self._anchor = anchor
        self._anchor_text = decode([anchor])
        self._settled_text = ""
        self._settled = 0  # tokens whose text is settled_text

    @property
    def settled_chars(self) -> int:
        """Length of the text that later tokens cannot change."""
        return len(self._settled_text)

    def of(self, token_ids: list[int]) -> str:
        tail_ids = token_ids[self._settled :]
        if not tail_ids:
            return self._settled_text
        if self._settled == 0:  # the text's start: its first space may go
            tail = self._decode(tail_ids)
        else:
            anchored = self._decode([self._anchor, *tail_ids])
            if not anchored.startswith(self._anchor_text):
                raise ValueError("the anchor token does not decode to itself here")
            tail = anchored[len(self._anchor_text) :]
        if (self._settled or tail) and self._closes_a_run(tail_ids[-1]):
            self._settled_text += tail
            self._settled = len(token_ids)
            return self._settled_text
        return self._settled_text + tail

    def _closes_a_run(self, token: int) -> bool:
        """Whether `token` ends any byte run before it: a piece of text that is not a byte."""
        if token in self._textless_ids:
            return False
        piece = self._tokenizer.convert_ids_to_tokens(token)  # None past the tokenizer
        return isinstance(piece, str) and not (len(piece) == 6 and piece.startswith("<0x"))


def decode_anchor(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """A token that lets a SentencePiece-style tokenizer's output be decoded piecewise: one
    whose text is its own piece, alone and repeated. None for another kind of decoder (or a
    tokenizer without one), where PiecewiseText would not give the whole decode's text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 - a decoder that cannot say what it is: not piecewise
        return None
    steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
    for step in steps:
        if step.get("type") not in PIECEWISE_STEPS or step.get("stop", 0) != 0:
            return None
    for piece in ANCHOR_PIECES:
        token = tokenizer.convert_tokens_to_ids(piece)
        if not isinstance(token, int) or token == tokenizer.unk_token_id:
            continue
        once = tokenizer.decode([token], skip_special_tokens=False)
        if once == piece and tokenizer.decode([token] * 3, skip_special_tokens=False) == piece * 3:
            return token
    return None


def _byte_level_backend(stopper: TextDecoder) -> Any:
    """The tokenizers Tokenizer behind a fast tokenizer with a byte-level decoder and no space
    cleanup, or None."""
    backend = getattr(stopper.tokenizer, "backend_tokenizer", None)
    if backend is None or stopper.cleans_up_spaces or DecodeStream is None:
        return None
    return backend if isinstance(backend.decoder, decoders.ByteLevel) else None
