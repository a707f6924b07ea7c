"""Standard output that cannot be written (`kvcache ... > /dev/full`, a full disk under a
redirect): one error line on stderr and exit status 1, never a traceback.

The commands' own results (generate's printed lines, report's summary, bench's table) are
written through `echo`, which names the failure whatever stdout is; anything else that writes
there (--help, a command of another package) is caught once, at the top, by `Commands`. A
closed pipe (`| head`) stays click's own quiet exit.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import IO, Any

import click


class StdoutFailed(click.ClickException):
    """Writing to stdout failed: the command stops with this one line, and stdout is silenced
    so that the interpreter's last flush at exit cannot print a traceback of its own."""

    def __init__(self, err: OSError) -> None:
        super().__init__(f"cannot write to stdout ({err.strerror or err}); stopped")

    def show(self, file: IO[str] | None = None) -> None:
        silence_stdout()
        super().show(file)


def echo(text: str) -> None:
    """click.echo of a command's result to stdout; a write that fails is StdoutFailed."""
    try:
        click.echo(text)
    except OSError as err:
        raise StdoutFailed(err) from err


def silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null (written to, never replaced): what is still
    buffered for the stdout that failed is dropped at exit instead of failing again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no real stdout: nothing
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


def stdout_is_broken() -> bool:
    """Whether stdout refuses writes: an empty write to it fails (a full device such as
    /dev/full refuses even that; a regular file on a full disk does not, which is why the
    commands' results go through `echo`)."""
    try:
        os.write(sys.stdout.fileno(), b"")
    except OSError:
        return True
    except (ValueError, AttributeError):  # no file descriptor: not a real stdout
        return False
    return False


class Commands(click.Group):
    """The kvcache group: an OSError that escapes a command because stdout is broken ends in
    StdoutFailed's one line instead of a traceback."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: object,
    ) -> Any:  # click's: standalone (the default) never returns, it exits
        try:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        except OSError as err:  # click's standalone mode lets it through (all but EPIPE)
            if not (standalone_mode and stdout_is_broken()):
                raise
            failed = StdoutFailed(err)
            failed.show()
            sys.exit(failed.exit_code)
