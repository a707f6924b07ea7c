"""Byte sizes on the command line: ``2GiB``, ``512MB``, ``10gb``, ``4096`` (bytes)."""

from __future__ import annotations

import re
from argparse import ArgumentTypeError

import click

from kvcache.utils.argparse_utils import human_readable_int

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in ``text`` (a number with an optional unit; KiB/MiB/GiB are powers of two, KB/MB/GB
    powers of ten). Raises ValueError naming the problem."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 2GiB, 512MB, 4096)")
    return int(float(match.group(1)) * _UNITS[unit])


class ParsedInt(click.ParamType):
    """A whole number read from its text by `parse` (an int given as one is taken as it is);
    the parser's error is the option's."""

    def parse(self, text: str) -> int:
        raise NotImplementedError

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int:
        if isinstance(value, int):
            return value
        try:
            return self.parse(str(value))
        except (ValueError, ArgumentTypeError) as err:
            self.fail(str(err), param, ctx)


class ByteSize(ParsedInt):
    name = "size"

    def parse(self, text: str) -> int:
        return parse_size(text)


class HumanInt(ParsedInt):
    """A count as vLLM reads one (kvcache/utils/argparse_utils.py): ``2048``, ``1k`` (1,000),
    ``1K`` (1,024), ``25.6k``."""

    name = "count"

    def parse(self, text: str) -> int:
        return human_readable_int(text)
