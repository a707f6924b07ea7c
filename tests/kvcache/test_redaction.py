"""Credentials never shown: redact_url hides passwords and secret query values, keeps the rest."""

import pytest

from kvcache.redaction import redact_text, redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("redis://alice:hunter2@host:1", "redis://alice:***@host:1"),
        ("rediss://hunter2@host", "rediss://***@host"),
        ("redis://host:1/0?password=hunter2&db=2", "redis://host:1/0?password=***&db=2"),
        ("unix:///tmp/redis.sock?password=hunter2", "unix:///tmp/redis.sock?password=***"),
        ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
        ("/var/cache/kv", "/var/cache/kv"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "hunter2" not in redact_url(url)


def test_redact_text_hides_a_quoted_url() -> None:
    url = "redis://:hunter2@127.0.0.1:1/0"
    message = f"Error connecting to {url}: refused"
    assert redact_text(message, [url]) == "Error connecting to redis://:***@127.0.0.1:1/0: refused"
