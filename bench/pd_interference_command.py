"""The disaggregation bench's side of `kvcache bench` (bench/command.py hands it the
workload pd_interference, or any list of systems with engine-pd)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from bench.pd_interference import format_table, run_pd_bench

DEFAULT_SYSTEMS = "engine,engine-nochunk,engine-pd"


def pd_bench(
    workload: str, systems: str, model: str | None, limit: int | None, json_path: str | None
) -> None:
    """Run the served systems and print one table (and write every figure to --json)."""
    names = [s.strip() for s in systems.split(",") if s.strip()]
    if systems.startswith("engine,engine-nocache"):  # `kvcache bench`'s own default list
        names = DEFAULT_SYSTEMS.split(",")
    try:
        results = run_pd_bench(workload, names, model, limit)
    except (ValueError, RuntimeError) as err:
        raise click.ClickException(str(err)) from err
    click.echo(format_table(results))
    if json_path:
        # engine-pd's two schedules go to their own metrics file, which `kvcache report` reads.
        for result in results:
            pd_metrics = result.pop("pd_metrics", None)
            if pd_metrics is not None:
                system = result["system"]
                path = Path(json_path).with_suffix(f".{system}.metrics.json")
                path.write_text(json.dumps(pd_metrics))
                click.echo(f"{system}'s schedules (for kvcache report --html): {path}")
        Path(json_path).write_text(json.dumps(results, indent=2))
