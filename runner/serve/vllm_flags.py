"""`vllm serve`'s flags that are not the engine's options, on `kvcache serve`: each one does what
vLLM's does (the uvicorn ones), reaches `LLM(...)` as vLLM's argument of the same name (where
LLM honours it, ignores it with one warning, or refuses it by name), or is accepted where its
value is what this server does anyway and refused with a usage error naming it where it is not
(nothing aborts on a flag's name alone)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import click

from runner.cli.common_options import apply_options
from runner.engine.api.vllm_args import VLLM_SCHEDULING_POLICIES

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
MAX_LOGPROBS = 20  # SamplingParams' cap (vLLM's default --max-logprobs)


@dataclass(frozen=True)
class VllmServeOptions:
    """The values of vLLM's serve flags, as the serve command uses them."""

    uvicorn_log_level: str = "warning"
    access_log: bool = True
    llm: tuple[tuple[str, object], ...] = ()  # vLLM's LLM arguments given on the command line

    def llm_arguments(self) -> dict[str, object]:  # LLM(...)'s keywords, of their types
        return dict(self.llm)


# vLLM's LLM arguments as serve flags: keyword -> (flags, click type).
_LLM_FLAGS: dict[str, tuple[tuple[str, ...], click.ParamType]] = {
    "swap_space": (("--swap-space",), click.FLOAT),
    "tokenizer": (("--tokenizer",), click.STRING),
    "tokenizer_mode": (("--tokenizer-mode",), click.STRING),
    "quantization": (("--quantization", "-q"), click.STRING),
    "load_format": (("--load-format",), click.STRING),
    "config_format": (("--config-format",), click.STRING),
    "pipeline_parallel_size": (("--pipeline-parallel-size", "-pp"), click.INT),
    "cpu_offload_gb": (("--cpu-offload-gb",), click.FLOAT),
    "distributed_executor_backend": (("--distributed-executor-backend",), click.STRING),
    "scheduling_policy": (("--scheduling-policy",), click.Choice(VLLM_SCHEDULING_POLICIES)),
}


ClickCallback = Callable[[click.Context, click.Parameter, str | None], str | None]


def _refuse_unless(flag: str, accepted: tuple[str, ...], why: str) -> ClickCallback:
    def check(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
        if value is not None and value not in accepted:
            raise click.BadParameter(f"{value!r}: {why}", param_hint=flag)
        return value

    return check


def _max_logprobs(_ctx: click.Context, _param: click.Parameter, value: int | None) -> None:
    if value is not None and value != MAX_LOGPROBS:
        raise click.BadParameter(
            f"{value}: this server's cap is {MAX_LOGPROBS} log-probabilities a token (vLLM's "
            "default), fixed",
            param_hint="--max-logprobs",
        )


_OPTIONS = [
    click.option(
        "--uvicorn-log-level",
        type=click.Choice(UVICORN_LOG_LEVELS),
        default="warning",
        show_default=True,
        help="vLLM's flag: uvicorn's log level (info shows each request's access line).",
    ),
    click.option(
        "--disable-uvicorn-access-log", is_flag=True, help="vLLM's flag: no access lines."
    ),
    click.option(
        "--max-logprobs",
        type=int,
        default=None,
        callback=_max_logprobs,
        expose_value=False,
        help=f"vLLM's flag: {MAX_LOGPROBS} only, the cap here.",
    ),
    click.option(
        "--generation-config",
        default=None,
        callback=_refuse_unless(
            "--generation-config",
            ("vllm",),
            "the model's generation_config.json is not read for default sampling parameters "
            "here; requests' defaults are vLLM's own (`--generation-config vllm`)",
        ),
        expose_value=False,
        help="vLLM's flag: vllm only (defaults are SamplingParams' own).",
    ),
    click.option(
        "--reasoning-parser",
        default=None,
        callback=_refuse_unless(
            "--reasoning-parser",
            (),
            "reasoning is not split out of answers here (no reasoning_content); leave the "
            "flag out and the reasoning stays in content",
        ),
        expose_value=False,
        help="vLLM's flag: refused (no reasoning_content here).",
    ),
    click.option(
        "--chat-template-content-format",
        default=None,
        callback=_refuse_unless(
            "--chat-template-content-format",
            ("auto", "string"),
            "templates get a message's text parts joined into one string here ('string', "
            "what 'auto' picks for a text model)",
        ),
        expose_value=False,
        help="vLLM's flag: auto or string (text parts joined into one string).",
    ),
    *[
        click.option(*flags, name, type=kind, default=None, help="vLLM's flag (docs/SERVE.md).")
        for name, (flags, kind) in _LLM_FLAGS.items()
    ],
]


def vllm_serve_options(command: Callable[..., None]) -> Callable[..., None]:
    """Add vLLM's serve flags to `command`, which receives them as `vllm`, a
    VllmServeOptions."""

    @functools.wraps(command)
    def with_vllm_flags(**kwargs: object) -> None:
        level = str(kwargs.pop("uvicorn_log_level"))  # a choice, with a default
        access = not kwargs.pop("disable_uvicorn_access_log")
        given = {name: kwargs.pop(name) for name in _LLM_FLAGS}
        llm = tuple((k, v) for k, v in given.items() if v is not None)
        command(vllm=VllmServeOptions(level, access, llm), **kwargs)

    return apply_options(_OPTIONS)(with_vllm_flags)
