"""`kvcache serve`: the click command. The web stack and the engine are imported when it runs,
so `kvcache --help` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from runner.cli.engine_options import engine_options

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@click.command()
@click.option("--model", default=None, help="HF folder or .gguf file; default: SmolLM2-135M.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--api-key",
    default=None,
    envvar="KVCACHE_API_KEY",
    help="Clients must send 'Authorization: Bearer KEY' to every route but /health "
    "(or $KVCACHE_API_KEY).",
)
@click.option(
    "--served-model-name", default=None, help="The model's name in the API [default: its folder]."
)
@click.option(
    "--max-queued-requests",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Past this many samples (prompts x n) waiting to start, new requests get 429 with "
    "Retry-After; one request holding more gets 400.",
)
@click.option(
    "--trust-request-chat-template",
    is_flag=True,
    help="Render a client's own chat_template (in chat_template_kwargs); refused otherwise.",
)
@click.option(
    "--body-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds a request's body may take to arrive; a slower one gets 408.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="On SIGTERM, seconds running requests get to finish before they are aborted.",
)
@click.option(
    "--role",
    type=click.Choice(["both", "prefill", "decode"]),
    default="both",
    show_default=True,
    help="prefill/decode: one half of a disaggregated pair (docs/DISAGGREGATION.md).",
)
@click.option(
    "--handover",
    default="zmq",
    show_default=True,
    help="How prefill hands KV to decode: zmq, zmq://HOST:PORT (direct) or redis://HOST:PORT/DB.",
)
@click.option("--cpus", default=None, help="Pin this worker to these CPUs (0 or 0-3,6).")
@engine_options
def serve(
    model: str | None,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    max_queued_requests: int,
    trust_request_chat_template: bool,
    body_timeout: float,
    drain_timeout: float,
    role: str,
    handover: str,
    cpus: str | None,
    engine_options: dict[str, Any],
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) with /health
    and Prometheus /metrics, over one engine that batches every request continuously."""
    if api_key is not None and not api_key.strip():  # an unset $SECRET: not "no key"
        raise click.BadParameter("the key is empty", param_hint="--api-key")
    from runner.cli.startup import start_up_without_gc
    from runner.disagg.serve_role import start_role
    from runner.engine.frozen_heap import freeze_server_heap
    from runner.engine.llm import LLM
    from runner.serve.app import ServeSettings, build_app
    from runner.serve.masking import Masker
    from runner.serve.server import run_server

    name = served_model_name or (Path(model).stem if model else DEFAULT_MODEL_NAME)
    engine_options["record_metrics"] = False  # a server's memory must not grow per token
    engine_options["prefault_kv_cache"] = True  # its pool's page faults at start, not in steps
    with start_up_without_gc():
        try:
            make = lambda options: LLM(model, **options)  # noqa: E731
            llm, attach = start_role(role, handover, cpus, make, engine_options)
        except ValueError as err:  # its text may quote a URL it was given
            urls = [u for u in (engine_options.get("remote_cache_url"), handover) if u]
            raise click.ClickException(Masker(tuple(urls)).mask(str(err))) from err
        freeze_server_heap()  # inside: its collection is the start-up's one, not a second
    secret_urls = tuple(u for u in (engine_options.get("remote_cache_url"), handover) if u)
    settings = ServeSettings(
        name,
        api_key=api_key,
        max_queued_requests=max_queued_requests,
        trust_request_chat_template=trust_request_chat_template,
        body_timeout_s=body_timeout,
        secret_urls=secret_urls,
    )
    banner = f"kvcache serve ({role}): {name} on http://{host}:{port}/v1"
    click.echo(settings.masker().mask(banner), err=True)
    run_server(attach(build_app(llm, settings)), host, port, drain_timeout)
