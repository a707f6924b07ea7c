"""`kvcache report`: the summary of a run recorded with `kvcache generate --metrics`, and its
HTML page (runner/report/summary.py, runner/report/html.py; imported when it runs)."""

from __future__ import annotations

from pathlib import Path

import click

from runner.cli.batch.paths import OutputFile
from runner.cli.stdout import echo


@click.command()
@click.argument("metrics_path", metavar="METRICS", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--html",
    "html_path",
    type=OutputFile(),
    default=None,
    help="Also write a self-contained HTML page with the schedule pictures.",
)
def report(metrics_path: str, html_path: str | None) -> None:
    """Summarise a run recorded with `kvcache generate --metrics`."""
    from runner.report.summary import format_summary, load_metrics

    try:
        metrics = load_metrics(Path(metrics_path))
    except ValueError as err:
        raise click.ClickException(str(err)) from err
    echo(format_summary(metrics))
    if html_path:
        from runner.report.html import write_html

        try:
            write_html(metrics, Path(html_path))
        except ValueError as err:  # a disaggregated run's second worker, malformed
            raise click.ClickException(str(err)) from err
        echo(f"report page written to {html_path}")
