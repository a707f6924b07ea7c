"""Credentials kept out of what is printed, logged or returned.

A tier or handover URL such as ``redis://:hunter2@host:6379/0`` carries the password that lets
its holder write K/V blocks; anything that shows such a URL to a person or a client shows
``redact_url(url)`` instead, which keeps the scheme, user, host, port and path (enough to tell
which server is meant) and replaces the password and any secret-looking query value by ``***``.
"""

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "***"

# Query parameters that carry a secret in the URL forms the tiers accept (redis-py's
# ``?password=``), matched case-insensitively.
_SECRET_QUERY_KEYS = frozenset({"password", "pass", "pwd", "token", "secret", "key", "api_key"})


def redact_url(url: str) -> str:
    """``url`` with its password (and secret query values) replaced by ``***``.

    Text that does not parse as a URL with a network location is returned unchanged, so this is
    safe to apply to anything that may or may not be a URL (a file path, a host:port)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, hostinfo = netloc.rsplit("@", 1)
            if ":" in userinfo:
                user = userinfo.split(":", 1)[0]
                userinfo = f"{user}:{REDACTED}"
            elif parts.scheme.startswith(("redis", "rediss", "unix")):
                # redis://secret@host means the password alone (redis-py reads it so).
                userinfo = REDACTED
            netloc = f"{userinfo}@{hostinfo}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode(
                [(k, REDACTED if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs],
                safe="*",
            )
        if netloc == parts.netloc and query == parts.query:
            return url
        if not netloc and url.startswith(f"{parts.scheme}://"):
            # urlunsplit would drop the empty authority of unix:///path URLs.
            rest = urlunsplit(("", "", parts.path, query, parts.fragment))
            return f"{parts.scheme}://{rest}"
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return url


def redact_text(text: str, urls: list[str]) -> str:
    """``text`` (an error message, a log line) with each of ``urls`` shown redacted: an
    exception's text from a client library may quote the URL it was given."""
    for url in urls:
        if url:
            text = text.replace(url, redact_url(url))
    return text
