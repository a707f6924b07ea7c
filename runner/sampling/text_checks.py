"""Text that is not text: a lone surrogate ("\\ud800") is a valid JSON escape and a valid Python
string, but no UTF-8 encoder (the tokenizer's, the output file's) takes it, and it failed far
from where it came in, with a TypeError or UnicodeEncodeError. These checks name it where it
enters, as the ValueError every other bad field gets."""

from __future__ import annotations

import re

# JSON text decoded from UTF-8 holds no surrogate itself: one can only come from an escape.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def check_text(name: str, text: str) -> None:
    """Raise ValueError when `text` holds a lone surrogate, naming `name` and the position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{name} is not valid Unicode text: a lone surrogate U+{ord(text[err.start]):04X} "
            f"at character {err.start}"
        ) from None


def may_hold_surrogates(json_text: str) -> bool:
    """Whether JSON text has an escape that decodes to a surrogate (a pair, or a lone one):
    only then is its parsed value worth walking with `first_bad_text`."""
    return _SURROGATE_ESCAPE.search(json_text) is not None


def first_bad_text(value: object, name: str) -> str | None:
    """The path (`name`, then `.key` and `[i]`) of the first string in a parsed JSON value
    (its keys too) that holds a lone surrogate, or None. Walks without recursion, so a value
    nested as deep as the JSON parser took costs no stack."""
    todo: list[tuple[object, str]] = [(value, name)]
    while todo:
        item, where = todo.pop()
        if isinstance(item, str):
            try:
                check_text(where, item)
            except ValueError as err:
                return str(err)
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                try:
                    check_text(f"a key of {where}", key)
                except ValueError as err:
                    return str(err)
                todo.append((child, f"{where}.{key}" if where else key))
        elif isinstance(item, list):  # token ids and numbers cost no name, nor a push
            todo.extend(
                (child, f"{where}[{i}]")
                for i, child in reversed(list(enumerate(item)))
                if isinstance(child, str | dict | list)
            )
    return None
