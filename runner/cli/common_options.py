"""Click options that the commands declare alike, written once: an option whose default --help
shows, a count of 1 or more (with a default, or None where it is not given), a span of seconds
above 0, the API key that $KVCACHE_API_KEY also gives, and one decorator made of a list of
options. A command then states only what is its own: its flag, its default and its help."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import click

Command = Callable[..., None]  # a click command's function, before click.command makes it one
Option = Callable[[Command], Command]  # a decorator that adds options to a command's function
Names = str | tuple[str, ...]  # an option's flag, or its flags and its parameter's name


def shown_option(
    names: Names,
    value_type: click.ParamType | type | None,
    default: object,
    help: str | None = None,
) -> Option:
    """An option whose default --help shows (`value_type` None: click's guess from the
    default)."""
    decls = (names,) if isinstance(names, str) else names
    return click.option(*decls, type=value_type, default=default, show_default=True, help=help)


def count_option(names: Names, default: int, help: str | None = None) -> Option:
    """An option taking a count of 1 or more, its default shown."""
    return shown_option(names, click.IntRange(min=1), default, help)


def optional_count(name: str, help: str) -> Option:
    """An option taking a count of 1 or more, None where it is not given."""
    return click.option(name, type=click.IntRange(min=1), default=None, help=help)


def seconds_option(name: str, default: float, help: str) -> Option:
    """An option taking a span of seconds above 0, its default shown."""
    return shown_option(name, click.FloatRange(min=0, min_open=True), default, help)


def api_key_option(help: str) -> Option:
    """--api-key, which $KVCACHE_API_KEY gives where the flag is not given (what it is for
    differs: the key a server requires, or the one a client sends)."""
    return click.option("--api-key", default=None, envvar="KVCACHE_API_KEY", help=help)


def apply_options(options: Sequence[Option]) -> Option:
    """One decorator adding `options` to a command, the first of them first in --help."""

    def add(command: Command) -> Command:
        for option in reversed(options):
            command = option(command)
        return command

    return add
