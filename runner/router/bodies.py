"""A client's request body as a router reads it: a JSON object, else a 400 in OpenAI's error
shape naming what is wrong, before any replica is picked or sent it.

A router reads only what it routes by (the prompt, `cache_salt`) and forwards the body's bytes
as they came: the replica checks every field itself. What the router does check is what it
would otherwise fail on: JSON nested past Python's parser (a RecursionError, not a ValueError),
text that is not UTF-8, a body that is no object, and a `cache_salt` that is not a string of
Unicode text (a lone surrogate such as "\\ud800" cannot be encoded to hash)."""

from __future__ import annotations

import json

from fastapi import Request

from runner.serve.json_types import JSONObject


class BadBody(Exception):
    """The client's body, refused with a 400: `message` says why, `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


async def read_body(request: Request) -> tuple[bytes, JSONObject]:
    """(the body's bytes, to forward as they are; the JSON object they hold). Raises BadBody."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError as err:
        raise BadBody("the body is not valid JSON: it nests arrays or objects too deep") from err
    except ValueError as err:  # json's errors, and bytes that are not UTF-8 (UnicodeDecodeError)
        raise BadBody(f"the body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise BadBody(f"the body must be a JSON object, got {type(body).__name__}")
    check_cache_salt(body.get("cache_salt"))
    return raw, body


def check_cache_salt(salt: object) -> None:
    """A cache_salt is absent, null, or a string of Unicode text."""
    if salt is None:
        return
    if not isinstance(salt, str):
        raise BadBody(f"cache_salt must be a string, got {type(salt).__name__}", "cache_salt")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = salt[err.start : err.end].encode("unicode_escape").decode()
        raise BadBody(
            f"cache_salt is not Unicode text: it holds a lone surrogate ({bad}) at {err.start}",
            "cache_salt",
        ) from err
