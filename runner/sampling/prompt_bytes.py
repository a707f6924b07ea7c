"""A bound in bytes on a text prompt that could still fit the context, checked before the
prompt is tokenized: a prompt of 700,001 tokens against a context of 2,048 was tokenized
whole on the engine's thread (2.1-2.3 s, every stream waiting) only to be refused.

No token's text holds more than the vocabulary's longest token's bytes, so a prompt of B
bytes is at least B / longest tokens once normalized. A normalizer may shorten text before
it is split (Unicode composition: Hangul jamo compose three to one), so the bound keeps a
margin of SHRINK_MARGIN: a prompt past SHRINK_MARGIN x longest x context bytes can never
fit, and is refused at once; every prompt that could fit is tokenized as before."""

from __future__ import annotations

from typing import Protocol

SHRINK_MARGIN = 4


class Decoder(Protocol):
    def __len__(self) -> int: ...

    def batch_decode(self, sequences: list[list[int]]) -> list[str]: ...


def longest_token_bytes(tokenizer: Decoder) -> int:
    """The most UTF-8 bytes one token's text holds, special tokens included (at least 1)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1) or 1


def max_prompt_bytes(tokenizer: Decoder, max_model_len: int) -> int:
    """The most bytes a text prompt may hold and still fit `max_model_len` tokens."""
    return SHRINK_MARGIN * longest_token_bytes(tokenizer) * max_model_len


def check_prompt_bytes(name: str, text: str, limit: int, max_model_len: int) -> None:
    """ValueError naming `name` and the bound when `text` is past `limit` bytes."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ValueError(
            f"{name} is {size} bytes; the model's context holds {max_model_len} tokens, which "
            f"no text over {limit} bytes can fit (refused before tokenizing)"
        )
