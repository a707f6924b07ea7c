"""vLLM's `EngineArgs` for its scripts' command lines: `EngineArgs.add_cli_args(parser)` adds
the engine's options to an argparse parser (or argument group), each by vLLM's flag name
(EngineConfig's field with dashes: `--max-model-len`, `--enable-prefix-caching` /
`--no-enable-prefix-caching`), with `--model`, `--tokenizer`, `--seed`, `--trust-remote-code`
and vLLM's own arguments (runner/engine/api/vllm_args.py). A flag not given leaves no
attribute behind (argparse.SUPPRESS), so `LLM(**vars(parser.parse_args()))` passes exactly
what the command line said and the engine's defaults stand for the rest."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, Union

from kvcache.utils.argparse_utils import human_readable_int
from runner.engine.api.vllm_args import PARALLEL, vllm_arg_names
from runner.engine.config import EngineConfig


class ArgumentAdder(Protocol):
    """What add_cli_args is given: an argparse parser or argument group."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action: ...


Adder = TypeVar("Adder", bound=ArgumentAdder)

# vLLM's own arguments whose values are not text.
_VLLM_TYPES: dict[str, Callable[[str], object]] = {
    **dict.fromkeys(PARALLEL, int),
    "swap_space": float,
    "cpu_offload_gb": float,
    "max_seq_len_to_capture": int,
}
_VLLM_FLAGS = ("disable_log_stats", "disable_log_requests", "enable_log_requests") + (
    "disable_custom_all_reduce",
)


def _value_type(hint: object) -> Callable[[str], object] | None:
    """How one EngineConfig field's text is read (None: a bool flag)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else ()
    kinds = [o for o in options if o is not type(None)] or [hint]
    kind = kinds[0]
    if kind is bool:
        return None
    if kind is int:
        return human_readable_int  # vLLM's sizes: --max-model-len 1k
    if kind is float:
        return float
    return str  # text, a Literal's words, and kv_events_config's JSON


class EngineArgs:
    """The engine's arguments, by name: `EngineArgs(model=..., **options)`,
    `EngineArgs.from_cli_args(args)`, and `LLM(**engine_args.kwargs())`."""

    def __init__(self, model: str | None = None, **options: object) -> None:
        self.model = model
        self.options = options

    def kwargs(self) -> dict[str, object]:
        """The arguments as `LLM(...)` takes them."""
        return {"model": self.model, **self.options}

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine's arguments among a parsed command line's (those add_cli_args adds)."""
        names = {"model", "tokenizer", "seed", "trust_remote_code", *vllm_arg_names()}
        names |= {f.name for f in dataclasses.fields(EngineConfig)}
        given = {k: v for k, v in vars(args).items() if k in names}
        model = given.pop("model", None)
        return cls(model, **given)

    @staticmethod
    def add_cli_args(parser: Adder) -> Adder:
        """Add the engine's options to `parser` (a parser or an argument group); returns it."""
        quiet = argparse.SUPPRESS
        parser.add_argument("--model", type=str, default=None, help="Model folder, .gguf or id")
        parser.add_argument("--tokenizer", type=str, default=quiet, help="The model's own")
        parser.add_argument("--seed", type=int, default=quiet)
        parser.add_argument("--trust-remote-code", action="store_true", default=quiet)
        hints = typing.get_type_hints(EngineConfig)
        for field in dataclasses.fields(EngineConfig):
            if field.name == "model":
                continue
            flags = ["--" + field.name.replace("_", "-")]
            if field.name == "tensor_parallel_size":
                flags.append("-tp")  # vLLM's short flag
            read = _value_type(hints[field.name])
            if read is None:
                parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=quiet)
            else:
                parser.add_argument(*flags, type=read, default=quiet)
        for name in vllm_arg_names():
            flags = ["--" + name.replace("_", "-")]
            if name in _VLLM_FLAGS:
                parser.add_argument(*flags, action="store_true", default=quiet)
            else:
                parser.add_argument(*flags, type=_VLLM_TYPES.get(name, str), default=quiet)
        return parser
