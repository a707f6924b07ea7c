"""`kvcache serve`: the click command, built by `serve_command` around the `RoleStarter` that
starts its worker (cli.py hands it disagg's roles; this package never imports disagg, which
extends it). The web stack and the engine are imported when it runs, so `kvcache --help` stays
fast."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import click

from runner.cli.common_options import (
    Option,
    api_key_option,
    apply_options,
    count_option,
    seconds_option,
    shown_option,
)
from runner.cli.engine_options import engine_options
from runner.serve.tool_calls import TOOL_PARSERS
from runner.serve.vllm_flags import VllmServeOptions, vllm_serve_options

if TYPE_CHECKING:
    from fastapi import FastAPI

    from runner.engine.api.interface import EngineInterface

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


# What a role's engine is built by: its options (the role may add some) -> the engine.
MakeEngine = Callable[[dict[str, object]], "EngineInterface"]
# What a started worker gives back: its engine, and the step that adds its role's routes to the
# app.
StartedWorker = tuple["EngineInterface", Callable[["FastAPI"], "FastAPI"]]


class WorkerPlacement(NamedTuple):
    """Where a worker stands: its role, how it hands prompts over, and the CPUs it is pinned
    to (--role, --handover, --cpus)."""

    role: str
    handover: str
    cpus: str | None


class RoleStarter(Protocol):
    """Starts a worker in its role (--role, --handover, --cpus): builds the engine through
    `make_llm` and gives it back with the step that adds the role's routes to the app; a
    ValueError names a bad option. disagg's serve_role has the roles; cli.py, where
    the commands are put together, hands its `start_role` to `serve_command`, so the server
    never imports the package that extends it."""

    def __call__(
        self, placement: WorkerPlacement, make_llm: MakeEngine, engine_options: dict[str, object]
    ) -> StartedWorker: ...


def colocated(
    placement: WorkerPlacement, make_llm: MakeEngine, engine_options: dict[str, object]
) -> StartedWorker:
    """The one role a serve command without the disaggregation roles has: both, unpinned."""
    role = placement.role
    if role != "both" or placement.cpus is not None:
        given = f"--role {role}" if role != "both" else "--cpus"
        raise ValueError(f"{given}: this serve command has no worker roles (cli.py adds them)")
    return make_llm(engine_options), _unchanged


def _unchanged(app: FastAPI) -> FastAPI:
    return app


# The command's options, in --help's order; the engine's (engine_options) come last.
_OPTIONS: list[Option] = [
    click.argument("model_args", metavar="[MODEL]", nargs=-1),
    click.option(
        "--model",
        default=None,
        help="HF folder, .gguf file or a Hub id in the local cache (or the MODEL argument, as "
        "`vllm serve MODEL`); default: SmolLM2-135M.",
    ),
    shown_option("--host", None, "127.0.0.1"),
    shown_option("--port", int, 8000),
    api_key_option(
        "Clients must send 'Authorization: Bearer KEY' to every route but /health "
        "(or $KVCACHE_API_KEY)."
    ),
    click.option(
        "--served-model-name",
        default=None,
        help="The model's name in the API [default: its folder]. As vLLM's, it may be followed "
        "by more names (`--served-model-name a b`): requests may use any, answers the first.",
    ),
    count_option(
        "--max-queued-requests",
        1024,
        "Past this many samples (prompts x n) waiting to start, new requests get 429 with "
        "Retry-After; one request holding more gets 400.",
    ),
    click.option(
        "--trust-request-chat-template",
        is_flag=True,
        help="Render a client's own chat_template (top-level or in chat_template_kwargs); "
        "refused otherwise.",
    ),
    click.option(
        "--chat-template",
        default=None,
        help="The chat template to render conversations with instead of the model's: a file's "
        "path, or the Jinja text itself.",
    ),
    shown_option("--seed", click.IntRange(min=0), 0),
    click.option(
        "--tool-call-parser",
        type=click.Choice(sorted(TOOL_PARSERS)),
        default=None,
        help="How tool calls are read out of answers (tool_choice auto) [default: the format the "
        "chat template teaches, else hermes].",
    ),
    click.option(
        "--enable-auto-tool-choice",
        is_flag=True,
        help="vLLM's flag, accepted: tool_choice auto is always on here.",
    ),
    click.option(
        "--trust-remote-code",
        is_flag=True,
        help="vLLM's flag, accepted: no repository code is ever run here.",
    ),
    click.option(
        "--disable-log-requests", is_flag=True, help="vLLM's flag, accepted: none logged."
    ),
    click.option("--disable-log-stats", is_flag=True, help="vLLM's flag, accepted: none logged."),
    vllm_serve_options,
    click.version_option(package_name="kvcache", message="%(version)s"),
    seconds_option(
        "--body-timeout",
        30.0,
        "Seconds a request's body may take to arrive; a slower one gets 408.",
    ),
    seconds_option(
        "--head-timeout",
        10.0,
        "Seconds a request's head (request line and headers) may take; past it a 408.",
    ),
    count_option(
        "--max-body-bytes",
        32 * 2**20,
        "The largest request body taken, in bytes; a larger one gets 413.",
    ),
    shown_option(
        "--drain-timeout",
        click.FloatRange(min=0),
        30.0,
        "On SIGTERM, seconds running requests get to finish before they are aborted.",
    ),
    shown_option(
        "--role",
        click.Choice(["both", "prefill", "decode"]),
        "both",
        "prefill/decode: one half of a disaggregated pair (docs/DISAGGREGATION.md).",
    ),
    shown_option(
        "--handover",
        None,
        "zmq",
        "How prefill hands KV to decode: zmq, zmq://HOST:PORT (direct) or redis://HOST:PORT/DB.",
    ),
    click.option("--cpus", default=None, help="Pin this worker to these CPUs (0 or 0-3,6)."),
]
# The serve command's own options (vLLM's serve flags among them), as one decorator.
serve_options = apply_options(_OPTIONS)


def serve_command(start_role: RoleStarter) -> click.Command:
    """`kvcache serve`, whose worker `start_role` starts in the role --role names (cli.py
    hands it disagg's roles; `serve` below has the colocated engine only)."""

    @click.command("serve")
    @serve_options
    @engine_options
    def serve(
        model_args: tuple[str, ...],
        model: str | None,
        host: str,
        port: int,
        api_key: str | None,
        served_model_name: str | None,
        max_queued_requests: int,
        trust_request_chat_template: bool,
        chat_template: str | None,
        seed: int,
        tool_call_parser: str | None,
        enable_auto_tool_choice: bool,
        trust_remote_code: bool,
        disable_log_requests: bool,
        disable_log_stats: bool,
        vllm: VllmServeOptions,
        body_timeout: float,
        head_timeout: float,
        max_body_bytes: int,
        drain_timeout: float,
        role: str,
        handover: str,
        cpus: str | None,
        engine_options: dict[str, object],
    ) -> None:
        """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) and vLLM's
        routes (/tokenize, /detokenize, /version, /ping) with /health and Prometheus /metrics,
        over one engine that batches every request continuously. vLLM's flag names work."""
        check_api_key(api_key)
        model, more_names = model_and_names(model_args, model, served_model_name)
        template = read_chat_template(chat_template) if chat_template is not None else None
        secret_urls = secret_urls_of(engine_options, handover)
        make = engine_maker(model, seed, vllm)
        llm, attach = start_engine(
            start_role, make, WorkerPlacement(role, handover, cpus), engine_options, secret_urls
        )
        from runner.serve.app import ServeSettings, build_app
        from runner.serve.server import run_server

        settings = ServeSettings(
            served_model_name or (Path(model).stem if model else DEFAULT_MODEL_NAME),
            api_key=api_key,
            max_queued_requests=max_queued_requests,
            trust_request_chat_template=trust_request_chat_template,
            body_timeout_s=body_timeout,
            max_body_bytes=max_body_bytes,
            secret_urls=secret_urls,
            chat_template=template,
            tool_call_parser=tool_call_parser,
            model_aliases=more_names,
        )
        banner = f"kvcache serve ({role}): {settings.model_name} on http://{host}:{port}/v1"
        click.echo(settings.masker().mask(banner), err=True)
        app = attach(build_app(llm, settings))
        log_level, access_log = vllm.uvicorn_log_level, vllm.access_log
        run_server(app, host, port, drain_timeout, log_level, access_log, head_timeout)

    return serve


def check_api_key(api_key: str | None) -> None:
    if api_key is not None and not api_key.strip():  # an unset $SECRET: not "no key"
        raise click.BadParameter("the key is empty", param_hint="--api-key")


def model_and_names(
    model_args: tuple[str, ...], model: str | None, served_model_name: str | None
) -> tuple[str | None, tuple[str, ...]]:
    """The model (--model or the MODEL argument, which must agree) and the further served
    names."""
    model_arg, more_names = split_positionals(model_args, model, served_model_name)
    if model_arg is not None and model is not None and model_arg != model:
        raise click.BadParameter(
            f"names {model!r} but the MODEL argument is {model_arg!r}", param_hint="--model"
        )
    return model or model_arg, more_names


def secret_urls_of(engine_options: Mapping[str, object], handover: str) -> tuple[str, ...]:
    """The URLs given that may hold a password: shown masked wherever they appear."""
    urls = (engine_options.get("remote_cache_url"), handover)
    return tuple(u for u in urls if isinstance(u, str) and u)


def engine_maker(model: str | None, seed: int, vllm: VllmServeOptions) -> MakeEngine:
    """The engine's builder a role calls with its options: LLM(model, ...) with vLLM's LLM
    arguments given on the command line."""

    def make(options: dict[str, object]) -> EngineInterface:
        from runner.engine.api.llm import LLM

        # LLM takes EngineConfig's and vLLM's arguments by name and checks them itself.
        extra: dict[str, Any] = vllm.llm_arguments()
        engine: dict[str, Any] = options
        return LLM(model, seed=seed, **extra, **engine)

    return make


def start_engine(
    start_role: RoleStarter,
    make: MakeEngine,
    placement: WorkerPlacement,
    engine_options: dict[str, object],
    secret_urls: tuple[str, ...],
) -> StartedWorker:
    """The worker's engine, started by `start_role` in its role (`placement`: --role,
    --handover, --cpus) with the server's engine settings; a bad option is a usage error,
    its text masked."""
    from runner.cli.startup import start_up_without_gc
    from runner.engine.api.frozen_heap import freeze_server_heap
    from runner.serve.masking import Masker

    engine_options["record_metrics"] = False  # a server's memory must not grow per token
    engine_options["prefault_kv_cache"] = True  # its pool's page faults at start, not in steps
    with start_up_without_gc():
        try:
            started = start_role(placement, make, engine_options)
        except ValueError as err:  # its text may quote a URL it was given
            raise click.ClickException(Masker(secret_urls).mask(str(err))) from err
        freeze_server_heap()  # inside: its collection is the start-up's one, not a second
    return started


def split_positionals(
    given: tuple[str, ...], model: str | None, served_model_name: str | None
) -> tuple[str | None, tuple[str, ...]]:
    """The MODEL argument and the further served names among the positional words: vLLM's
    `--served-model-name a b` leaves `b` among them (click options take one value). The first
    word is the MODEL argument, unless --model and --served-model-name are both given and it
    is not the model: then every word is a further name."""
    words = list(given)
    names_only = model is not None and served_model_name is not None
    first_is_model = bool(words) and (not names_only or words[0] == model)
    model_arg = words.pop(0) if first_is_model else None
    if words and served_model_name is None:
        raise click.UsageError(f"unexpected extra arguments: {' '.join(words)}")
    return model_arg, tuple(words)


def read_chat_template(given: str) -> str:
    """--chat-template's value: a file's text when it names a file, else the template itself
    (as vLLM reads it); a usage error for an empty one or a path that cannot be read."""
    looks_like_path = not any(mark in given for mark in ("{{", "{%", "\n"))
    path = Path(given)
    if looks_like_path:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise click.BadParameter(
                f"{given!r} is no readable file ({err.strerror}) and no Jinja template",
                param_hint="--chat-template",
            ) from err
    else:
        text = given
    if not text.strip():
        raise click.BadParameter("the template is empty", param_hint="--chat-template")
    return text


serve = serve_command(colocated)  # the colocated server alone; `kvcache serve` is cli.py's
