"""kvcache command line: generate | report | bench."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from runner.cli_startup import start_up_without_gc
from runner.config import CPU_WEIGHT_DTYPES


@click.group()
def main() -> None:
    """A prefix-caching KV-cache engine for LLM inference."""


@main.command()
@click.argument(
    "input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False, allow_dash=True)
)
@click.option(
    "-o",
    "--output",
    "output_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="JSONL results file; without it, results are printed as they finish.",
)
@click.option("--model", default=None, help="HF folder or .gguf file; default: SmolLM2-135M.")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=-1, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--repetition-penalty",
    type=float,
    default=1.0,
    show_default=True,
    help="Above 1 makes tokens of the prompt and the output so far less likely.",
)
@click.option(
    "--logprobs",
    type=int,
    default=None,
    help="Write each generated token's log-probability and the N likeliest alternatives.",
)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--no-prefix-cache", is_flag=True, help="Turn the prefix cache off.")
@click.option("--batching", type=click.Choice(["continuous", "static"]), default="continuous")
@click.option("--max-num-batched-tokens", type=int, default=2048, show_default=True)
@click.option("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks.")
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--cpu-weight-dtype",
    type=click.Choice(CPU_WEIGHT_DTYPES),
    default="float32",
    show_default=True,
    help="CPU: store weight matrices as bfloat16 or int8 (a half or a quarter of the bytes a "
    "decode step reads; the float32 model with its weights rounded so).",
)
@click.option(
    "--metrics",
    "metrics_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a JSON record of the run for `kvcache report`.",
)
@click.option("--resume", is_flag=True, help="Skip ids already in OUTPUT and append the rest.")
@click.option("--overwrite", is_flag=True, help="Replace an OUTPUT that holds results.")
def generate(
    input_path: str,
    output_path: str | None,
    model: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: tuple[str, ...],
    repetition_penalty: float,
    logprobs: int | None,
    block_size: int,
    no_prefix_cache: bool,
    batching: str,
    max_num_batched_tokens: int,
    num_kv_blocks: int | None,
    device: str,
    cpu_weight_dtype: str,
    metrics_path: str | None,
    resume: bool,
    overwrite: bool,
) -> None:
    """Generate for every request in INPUT (JSONL, .txt, or - for stdin).

    Greedy by default (--temperature 0). Each JSONL line holds one of prompt / messages /
    prompt_token_ids, an optional id, and optional sampling fields (max_tokens, temperature,
    top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, repetition_penalty,
    presence_penalty, frequency_penalty, logprobs, n) and cache_salt."""
    from runner.batch_paths import check_paths

    try:  # before the model loads: a wrong path costs nothing yet
        check_paths(input_path, output_path, metrics_path, resume=resume, overwrite=overwrite)
    except ValueError as err:
        raise click.UsageError(str(err)) from err
    defaults: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": list(stop) or None,
        "repetition_penalty": repetition_penalty,
        "logprobs": logprobs,
    }
    engine_options: dict[str, Any] = {
        "block_size": block_size,
        "enable_prefix_caching": not no_prefix_cache,
        "batching": batching,
        "max_num_batched_tokens": max_num_batched_tokens,
        "num_kv_blocks": num_kv_blocks,
        "device": device,
        "cpu_weight_dtype": cpu_weight_dtype,
        "record_metrics": bool(metrics_path),  # else memory would grow with every token
    }
    with start_up_without_gc():
        try:  # Ctrl-C in the imports or the model load: nothing was generated yet
            run = _start_batch_run(model, engine_options, defaults)
        except KeyboardInterrupt:
            click.echo("interrupted while loading the model; nothing was generated", err=True)
            sys.exit(130)
    code = run.execute(input_path, Path(output_path) if output_path else None, resume=resume)
    if metrics_path:
        Path(metrics_path).write_text(json.dumps(run.llm.metrics()))
        click.echo(f"metrics written to {metrics_path}", err=True)
    sys.exit(code)


def _start_batch_run(
    model: str | None, engine_options: dict[str, Any], defaults: dict[str, Any]
) -> Any:
    from runner.batch_run import BatchRun
    from runner.sampling import SamplingParams

    try:  # a bad default would fail every line: say so once, before loading the model
        SamplingParams(**defaults)
    except ValueError as err:
        raise click.UsageError(str(err)) from err
    try:
        return BatchRun(model, engine_options, defaults)
    except ValueError as err:
        raise click.ClickException(str(err)) from err


@main.command()
@click.argument("metrics_path", metavar="METRICS", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write a self-contained HTML page with the schedule pictures.",
)
def report(metrics_path: str, html_path: str | None) -> None:
    """Summarise a run recorded with `kvcache generate --metrics`."""
    from runner.report import format_summary, load_metrics

    if html_path and not Path(html_path).resolve().parent.is_dir():
        raise click.UsageError(f"--html: folder {Path(html_path).parent} does not exist")
    try:
        metrics = load_metrics(Path(metrics_path))
    except ValueError as err:
        raise click.ClickException(str(err)) from err
    click.echo(format_summary(metrics))
    if html_path:
        from runner.report_html import write_html

        write_html(metrics, Path(html_path))
        click.echo(f"report page written to {html_path}")


@main.command()
@click.option(
    "--workload",
    default="shared_system_prompt",
    show_default=True,
    help="A data/ workload name or .jsonl file; 'core' runs the block-manager micro-bench.",
)
@click.option(
    "--systems",
    default="engine,engine-nocache,engine-static,hf-static,hf-cb",
    show_default=True,
    help="Comma-separated systems to run.",
)
@click.option("--model", default=None)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Override the workload's max_tokens.",
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="Use only the first N requests."
)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Token budget per step for the engine systems.",
)
@click.option(
    "--max-num-seqs",
    type=click.IntRange(min=1),
    default=None,
    help="Batch size cap for the engine systems and hf-static's batches.",
)
@click.option("--no-check", is_flag=True, help="Skip the unbatched transformers reference.")
@click.option(
    "--temperature",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    help="Sample in every system at this temperature (default: greedy, outputs checked).",
)
@click.option(
    "--top-p",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=1.0,
    show_default=True,
    help="With --temperature: nucleus sampling in every system.",
)
@click.option(
    "--n",
    "samples",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --temperature: samples per prompt in every system.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def bench(
    workload: str,
    systems: str,
    model: str | None,
    max_tokens: int | None,
    limit: int | None,
    device: str,
    max_num_batched_tokens: int | None,
    max_num_seqs: int | None,
    no_check: bool,
    temperature: float | None,
    top_p: float,
    samples: int,
    json_path: str | None,
) -> None:
    """Run a workload through several systems in one process and print one table.

    Systems: engine, engine-nocache, engine-static, engine-nochunk, hf-static, hf-cb."""
    if workload == "core":
        from kvcache.microbench import main as core_main

        core_main()
        return
    from runner.bench import ENGINE_SYSTEMS, run_bench
    from runner.bench_peers import Sampling
    from runner.workloads import workload_path

    system_list = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = [s for s in system_list if s not in (*ENGINE_SYSTEMS, "hf-static", "hf-cb")]
    if unknown:
        raise click.UsageError(
            f"unknown system(s) {', '.join(unknown)}; known: "
            + ", ".join([*ENGINE_SYSTEMS, "hf-static", "hf-cb"])
        )
    try:
        workload_path(workload)
    except ValueError as err:
        raise click.UsageError(str(err)) from err
    if samples > 1 and temperature is None:
        raise click.UsageError("--n above 1 needs --temperature: greedy samples are all alike")

    start = time.perf_counter()
    result = run_bench(
        workload=workload,
        systems=system_list,
        model=model,
        max_tokens=max_tokens,
        limit=limit,
        device=device,
        check=not no_check,
        engine_options={
            k: v
            for k, v in (
                ("max_num_batched_tokens", max_num_batched_tokens),
                ("max_num_seqs", max_num_seqs),
            )
            if v is not None
        },
        sampling=Sampling(temperature, top_p, samples) if temperature is not None else None,
    )
    click.echo(result["table"])
    if json_path:
        Path(json_path).write_text(json.dumps(result["rows"], indent=2))
    click.echo(f"bench took {time.perf_counter() - start:.1f} s", err=True)


if __name__ == "__main__":
    main()
