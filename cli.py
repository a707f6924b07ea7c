"""kvcache command line: generate | report | bench | serve | router | bench-serve."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from bench.command import bench
from bench.serve.command import bench_serve
from runner.cli.batch.paths import OutputFile
from runner.cli.common_options import shown_option
from runner.cli.engine_options import engine_options
from runner.cli.report import report
from runner.cli.startup import start_up_without_gc
from runner.cli.stdout import Commands
from runner.disagg.serve_role import start_role
from runner.router.command import router
from runner.serve.command import serve_command

if TYPE_CHECKING:
    from runner.cli.batch.run import BatchRun
    from runner.cli.output_lock import LockedOutput
    from runner.cli.sampling_defaults import SamplingDefaults
    from runner.sampling.structured_outputs import StructuredOutputsParams


@click.group(cls=Commands)
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
    type=OutputFile(),
    help="JSONL results file; without it, results are printed as they finish.",
)
@click.option("--model", default=None, help="HF folder or .gguf file; default: SmolLM2-135M.")
@shown_option(
    "--max-tokens",
    int,
    64,
    "For lines without a max_tokens of their own: a line's own wins, as each sampling "
    "field of a line wins over its flag (data/sample.jsonl's lines ask for 24).",
)
@shown_option("--temperature", float, 0.0, "0 = greedy.")
@shown_option("--top-p", float, 1.0)
@shown_option("--top-k", int, -1)
@shown_option(
    "--min-p",
    float,
    0.0,
    "Drop tokens less likely than this share of the likeliest one's probability.",
)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--bad-word", "bad_words", multiple=True, help="Never generate this word (repeatable)."
)
@shown_option(
    "--min-tokens",
    int,
    0,
    "No EOS, stop token or stop string ends a request before this many tokens.",
)
@click.option(
    "--json-schema",
    "json_schema_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Hold every answer to the JSON schema in this file (a line's own structured_outputs "
    "wins).",
)
@shown_option(
    "--repetition-penalty",
    float,
    1.0,
    "Above 1 makes tokens of the prompt and the output so far less likely.",
)
@shown_option("--presence-penalty", float, 0.0)
@shown_option("--frequency-penalty", float, 0.0)
@shown_option(("--n", "samples"), int, 1, "Samples per prompt.")
@click.option(
    "--beam-width",
    type=click.IntRange(min=1),
    default=None,
    help='Beam search: each line\'s W best answers (best first under "beams"); uses each '
    "line's max_tokens and ignore_eos.",
)
@click.option(
    "--logprobs",
    type=int,
    default=None,
    help="Write each generated token's log-probability and the N likeliest alternatives.",
)
@click.option(
    "--prompt-logprobs",
    type=int,
    default=None,
    help="Write each prompt token's log-probability and the N likeliest alternatives.",
)
@click.option(
    "--metrics",
    "metrics_path",
    type=OutputFile(),
    default=None,
    help="Write a JSON record of the run for `kvcache report`.",
)
@click.option(
    "--prefix-cache",
    "prefix_cache_path",
    type=OutputFile(),
    default=None,
    help="Load the prefix cache from this file when it exists, and save it there at the end: "
    "a later run starts with this run's prefixes cached.",
)
@click.option("--resume", is_flag=True, help="Skip ids already in OUTPUT and append the rest.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace an OUTPUT that holds results, and a --prefix-cache file that is not a prefix "
    "cache of this engine.",
)
@engine_options
def generate(
    input_path: str,
    output_path: str | None,
    model: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: int | None,
    stop: tuple[str, ...],
    bad_words: tuple[str, ...],
    min_tokens: int,
    json_schema_path: str | None,
    repetition_penalty: float,
    presence_penalty: float,
    frequency_penalty: float,
    samples: int,
    beam_width: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    metrics_path: str | None,
    prefix_cache_path: str | None,
    resume: bool,
    overwrite: bool,
    engine_options: dict[str, Any],
) -> None:
    """Generate for every request in INPUT (JSONL, .txt, or - for stdin).

    Greedy by default (--temperature 0). Each JSONL line holds one of prompt / messages /
    prompt_token_ids, an optional id, and optional sampling fields (max_tokens, temperature,
    top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, min_tokens, logit_bias,
    allowed_token_ids, bad_words, truncate_prompt_tokens, skip_special_tokens,
    include_stop_str_in_output, structured_outputs, repetition_penalty, presence_penalty,
    frequency_penalty, logprobs, prompt_logprobs, n), cache_salt and priority."""
    from runner.cli.batch.paths import check_paths

    # First, and held until the command ends: a second run on OUTPUT is refused at once.
    held = click.get_current_context().with_resource(_locked_output(output_path))
    try:  # before the model loads: a wrong path costs nothing yet
        check_paths(
            input_path,
            output_path,
            metrics_path,
            resume=resume,
            overwrite=overwrite,
            prefix_cache_path=prefix_cache_path,
        )
    except ValueError as err:
        raise click.UsageError(str(err)) from err
    if beam_width and (temperature != 0 or samples != 1):
        raise click.UsageError("--beam-width searches greedily: no --temperature, no --n")
    if prefix_cache_path and (
        not engine_options["enable_prefix_caching"] or not Path(prefix_cache_path).parent.is_dir()
    ):
        raise click.UsageError(
            "--prefix-cache needs the prefix cache on and an existing folder"
            f" ({Path(prefix_cache_path).parent})"
        )
    defaults: SamplingDefaults = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
        "stop": list(stop) or None,
        "bad_words": list(bad_words) or None,
        "min_tokens": min_tokens,
        "structured_outputs": _json_schema(json_schema_path),
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "n": samples,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }
    engine_options["record_metrics"] = bool(metrics_path)  # else memory grows with every token
    from runner.cli.batch.finish import PrefixCacheFile, run_batch
    from runner.cli.signals import sigterm_as_sigint

    with sigterm_as_sigint():  # `kill`: what Ctrl-C does, not an exit without a word
        with start_up_without_gc():
            try:  # Ctrl-C in the imports or the model load: nothing was generated yet
                run = _start_batch_run(model, engine_options, defaults, beam_width)
            except KeyboardInterrupt:
                click.echo("interrupted while loading the model; nothing was generated", err=True)
                sys.exit(130)
        cache = PrefixCacheFile(Path(prefix_cache_path), overwrite) if prefix_cache_path else None
        metrics = Path(metrics_path) if metrics_path else None
        code = run_batch(run, input_path, held, resume, cache, metrics)
    sys.exit(code)


@contextlib.contextmanager
def _locked_output(path: str | None) -> Iterator[LockedOutput | None]:
    """-o OUTPUT opened and locked for the whole run, before the model loads: a second run on
    the same file is refused at once (runner/cli/output_lock.py)."""
    if path is None:
        yield None
        return
    from runner.cli.output_lock import LockedOutput, OutputInUse

    try:
        held = LockedOutput(Path(path))
    except OutputInUse as err:
        raise click.ClickException(str(err)) from err
    except OSError as err:
        raise click.ClickException(f"cannot open {path} for writing: {err.strerror}") from err
    with held:
        yield held


def _json_schema(path: str | None) -> StructuredOutputsParams | None:
    """--json-schema's file as StructuredOutputsParams (None without one)."""
    if path is None:
        return None
    from runner.sampling.structured_outputs import StructuredOutputsParams

    try:
        return StructuredOutputsParams(json=json.loads(Path(path).read_text(encoding="utf-8")))
    except (ValueError, UnicodeDecodeError) as err:
        raise click.UsageError(f"--json-schema {path}: {err}") from err


def _start_batch_run(
    model: str | None,
    engine_options: dict[str, Any],
    defaults: SamplingDefaults,
    beam_width: int | None,
) -> BatchRun:
    from runner.cli.batch.run import BatchRun
    from runner.engine.api.beam_search import BeamSearchParams
    from runner.sampling.params import SamplingParams

    try:  # a bad default would fail every line: say so once, before loading the model
        SamplingParams(**defaults)
    except ValueError as err:
        raise click.UsageError(str(err)) from err
    try:
        run = BatchRun(model, engine_options, defaults, beam_width)
        run.llm.check_structured_outputs(defaults.get("structured_outputs"))  # or fails once
        if beam_width:  # too wide for the log-probabilities a step gives: say so once
            run.llm.beam_search([], BeamSearchParams(beam_width=beam_width))
        return run
    except ValueError as err:
        raise click.ClickException(str(err)) from err


main.add_command(report)
main.add_command(bench)
main.add_command(serve_command(start_role))  # serve's workers in their roles: disagg's
main.add_command(router)
main.add_command(bench_serve)


if __name__ == "__main__":
    main()
