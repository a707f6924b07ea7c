"""`kvcache router`: the click command. The web stack is imported when it runs."""

from __future__ import annotations

from collections.abc import Sequence

import click

from runner.cli.common_options import Option, api_key_option, apply_options, shown_option
from runner.router.policy import POLICIES

# An option whose default --help shows: (flag, type, default, help).
Shown = tuple[str, click.ParamType, float, str | None]

# cache_aware's tuning, in --help's order.
CACHE_AWARE_TUNING: tuple[Shown, ...] = (
    (
        "--cache-threshold",
        click.FloatRange(0, 1),
        0.0,
        "cache_aware: a match shorter than this share of the prompt's blocks counts as none.",
    ),
    (
        "--balance-abs",
        click.IntRange(min=0),
        64,
        "cache_aware: loads are unbalanced past this many requests between busiest and idlest",
    ),
    (
        "--balance-rel",
        click.FloatRange(min=1),
        1.5,
        "cache_aware: ... and past this ratio; then the least loaded replica gets the request.",
    ),
    (
        "--load-weight",
        click.FloatRange(min=0),
        1.0,
        "cache_aware: what a block of work in flight on a replica costs against a block of "
        "the prompt it holds (0: prefixes alone).",
    ),
    (
        "--recent-half-life",
        click.FloatRange(min=0),
        120.0,
        "cache_aware: seconds over which a conversation started on a replica comes to weigh "
        "half as much against its prefixes (0: only the work in flight counts).",
    ),
)

SECONDS = click.FloatRange(min=0, min_open=True)
# How often replicas are checked, and the deadlines on what they answer, in --help's order.
DEADLINES: tuple[Shown, ...] = (
    ("--health-interval", click.FloatRange(min=0.05), 1.0, None),
    ("--upstream-connect-timeout", SECONDS, 5.0, "Seconds to connect to a replica."),
    (
        "--upstream-first-output-timeout",
        SECONDS,
        600.0,
        "Seconds from a request to its first generated text (not streamed: its whole answer); "
        "past it the replica is taken out and the request retried on another.",
    ),
    (
        "--upstream-idle-timeout",
        SECONDS,
        600.0,
        "Seconds a stream may go without a byte once its text began (a stream is alive while "
        "tokens arrive); past it the client's stream ends with an error event and the replica "
        "is taken out until its health check passes.",
    ),
)


def shown_options(table: Sequence[Shown]) -> Option:
    """One decorator adding the options of `table`, in its order in --help."""
    return apply_options([shown_option(*row) for row in table])


@click.command()
@click.option(
    "--replica",
    "replicas",
    multiple=True,
    help="A `kvcache serve` URL, such as http://127.0.0.1:8001 (repeatable).",
)
@click.option(
    "--prefill",
    "prefill",
    multiple=True,
    help="A `kvcache serve --role prefill` URL (repeatable; with --decode, instead of --replica).",
)
@click.option("--decode", "decode", multiple=True, help="A `kvcache serve --role decode` URL.")
@click.option("--policy", type=click.Choice(POLICIES), default="cache_aware", show_default=True)
@shown_option("--host", None, "127.0.0.1")
@shown_option("--port", int, 8000)
@shown_options(CACHE_AWARE_TUNING)
@click.option(
    "--kv-events",
    is_flag=True,
    help="cache_aware: know what each replica caches from its KV events (`kvcache serve "
    "--kv-events-config`, the endpoints its /kvcache/info reports) instead of from what was "
    "routed to it.",
)
@click.option(
    "--kv-events-endpoint",
    "kv_events_endpoints",
    multiple=True,
    metavar="URL=ENDPOINT[,REPLAY]",
    help="--kv-events: where the replica at URL publishes (tcp://host:5557, and its replay "
    "socket) when its /kvcache/info cannot say (repeatable; implies --kv-events).",
)
@shown_options(DEADLINES)
@click.option(
    "--tokenizer", default=None, help="cache_aware: tokenizer folder [default: the replicas']."
)
@api_key_option("Clients must send 'Authorization: Bearer KEY' to /v1/* (or $KVCACHE_API_KEY).")
@click.option(
    "--replica-api-key",
    default=None,
    envvar="KVCACHE_REPLICA_API_KEY",
    help="The key sent to the replicas in place of the client's (or $KVCACHE_REPLICA_API_KEY) "
    "[default: the client's own Authorization is passed on].",
)
def router(
    replicas: tuple[str, ...],
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    policy: str,
    host: str,
    port: int,
    cache_threshold: float,
    balance_abs: int,
    balance_rel: float,
    load_weight: float,
    recent_half_life: float,
    kv_events: bool,
    kv_events_endpoints: tuple[str, ...],
    health_interval: float,
    upstream_connect_timeout: float,
    upstream_first_output_timeout: float,
    upstream_idle_timeout: float,
    tokenizer: str | None,
    api_key: str | None,
    replica_api_key: str | None,
) -> None:
    """One OpenAI endpoint in front of several `kvcache serve` replicas."""
    import uvicorn

    from runner.router.app import build_router_app
    from runner.router.proxy import RouterSettings

    settings = RouterSettings(
        policy,
        cache_threshold,
        balance_abs,
        balance_rel,
        health_interval,
        tokenizer,
        api_key=api_key,
        replica_api_key=replica_api_key,
        load_weight=load_weight,
        recent_half_life_s=recent_half_life,
        kv_events=kv_events or bool(kv_events_endpoints),
        kv_events_endpoints=dict(_given(text) for text in kv_events_endpoints),
        connect_timeout_s=upstream_connect_timeout,
        first_output_timeout_s=upstream_first_output_timeout,
        idle_timeout_s=upstream_idle_timeout,
    )
    from runner.router.pd import build_pd_router_app

    if bool(replicas) == bool(prefill or decode):
        raise click.UsageError("give --replica URLs, or --prefill and --decode URLs")
    if settings.kv_events and (policy != "cache_aware" or not replicas):
        raise click.UsageError("--kv-events goes with --policy cache_aware and --replica URLs")
    try:
        if replicas:
            app = build_router_app(list(replicas), settings)
        else:
            app = build_pd_router_app(list(prefill), list(decode), settings)
            policy = "prefill/decode"
    except ValueError as err:
        raise click.UsageError(str(err)) from err
    click.echo(f"kvcache router ({policy}) on http://{host}:{port}/v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)


def _given(text: str) -> tuple[str, str]:
    """``URL=ENDPOINT[,REPLAY]`` of --kv-events-endpoint, split (checked by the router)."""
    url, sep, endpoints = text.partition("=")
    if not sep or not url or not endpoints:
        raise click.BadParameter(f"want URL=ENDPOINT[,REPLAY], got {text!r}")
    return url, endpoints
