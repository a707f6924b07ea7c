"""vLLM's `FlexibleArgumentParser`, which its example scripts build their command lines on
(with `EngineArgs.add_cli_args`): an argparse parser that takes `--max_model_len` for
`--max-model-len` as vLLM's does, and `human_readable_int`, vLLM's reading of sizes such as
`1k` (1,000) and `1K` (1,024)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """`value` as vLLM reads a size: a plain int, or a number with a decimal suffix (k, m, g,
    t: 1k = 1,000, 25.6k = 25,600) or a binary one (K, M, G, T: 1K = 1,024; whole numbers
    only). argparse.ArgumentTypeError (what argparse reports as a usage error) for anything
    else."""
    text = value.strip()
    match = _SIZE.fullmatch(text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is no whole number (sizes may end in k, m, g, t or K, M, G, T)"
            ) from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{value!r}: a binary suffix ({suffix}) takes a whole number; did you mean "
            f"{number}{suffix.lower()}?"
        )
    return int(number) * _BINARY[suffix]


class FlexibleArgumentParser(argparse.ArgumentParser):
    """argparse's parser, taking underscores in long option names as dashes
    (`--max_model_len 256` is `--max-model-len 256`), as vLLM's does."""

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        import sys

        given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([_dashed(a) for a in given], namespace)


def _dashed(arg: str) -> str:
    """`--some_option[=value]` as `--some-option[=value]`; anything else as it is."""
    if not arg.startswith("--") or arg == "--":
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value
