"""Credentials kept out of what the server returns and logs: the URLs it was given (a Redis
tier's, a handover's) shown with their passwords masked, and its own API key never shown. An
exception's text from a client library may quote the URL it was given, so every error text a
client or a log gets passes through `Masker.mask`."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.redaction import REDACTED, redact_text


@dataclass(frozen=True)
class Masker:
    """The secrets one server knows: `urls` (masked as kvcache.redaction does) and `literals`
    (API keys: replaced whole)."""

    urls: tuple[str, ...] = ()
    literals: tuple[str, ...] = ()

    def mask(self, text: str) -> str:
        text = redact_text(text, list(self.urls))
        for secret in self.literals:
            if secret:
                text = text.replace(secret, REDACTED)
        return text
