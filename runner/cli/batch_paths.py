"""Checks on `kvcache generate`'s file arguments, made before the model loads."""

from __future__ import annotations

from pathlib import Path


def check_paths(
    input_path: str,
    output_path: str | None,
    metrics_path: str | None,
    *,
    resume: bool,
    overwrite: bool,
) -> None:
    """Raise ValueError for an output that would lose work or fail late: OUTPUT or --metrics
    naming the input (it would be emptied), a folder that does not exist (the run would crash
    at its first or last write), or an OUTPUT holding results that neither --resume (finish
    them) nor --overwrite (drop them) was asked about."""
    if resume and output_path is None:
        raise ValueError("--resume needs -o OUTPUT")
    if resume and overwrite:
        raise ValueError("--resume keeps OUTPUT's results and --overwrite drops them: pick one")
    if (
        output_path is not None
        and metrics_path is not None
        and Path(output_path).resolve() == Path(metrics_path).resolve()
    ):
        raise ValueError("-o OUTPUT and --metrics name the same file: pick another --metrics")
    for option, path in (("-o OUTPUT", output_path), ("--metrics", metrics_path)):
        if path is None:
            continue
        resolved = Path(path).resolve()
        if input_path != "-" and resolved == Path(input_path).resolve():
            raise ValueError(f"{option} {path} is the input file; pick another path")
        if not resolved.parent.is_dir():
            raise ValueError(f"{option}: folder {Path(path).parent} does not exist")
    if output_path is None:
        return
    out = Path(output_path)
    if out.exists() and not out.is_file():
        raise ValueError(
            f"-o OUTPUT {output_path} is not a regular file; without -o results are printed"
        )
    if not (resume or overwrite) and out.exists() and out.stat().st_size > 0:
        raise ValueError(
            f"{output_path} already holds results: --resume finishes that run, "
            "--overwrite starts again"
        )
