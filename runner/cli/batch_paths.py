"""Checks on `kvcache generate`'s file arguments, made before the model loads."""

from __future__ import annotations

import os
from pathlib import Path


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: by identity (device and inode) when both exist, so a
    hard link or a symlink of a file is that file; else by their resolved names."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): a name is all there is to compare
        return Path(a).resolve() == Path(b).resolve()


def check_paths(
    input_path: str,
    output_path: str | None,
    metrics_path: str | None,
    *,
    resume: bool,
    overwrite: bool,
    prefix_cache_path: str | None = None,
) -> None:
    """Raise ValueError for an output that would lose work or fail late: OUTPUT, --metrics or
    --prefix-cache naming the input or each other (one would be emptied or overwritten), a
    folder that does not exist (the run would crash at its first or last write), or an OUTPUT
    holding results that neither --resume (finish them) nor --overwrite (drop them) was asked
    about."""
    if resume and output_path is None:
        raise ValueError("--resume needs -o OUTPUT")
    if resume and overwrite:
        raise ValueError("--resume keeps OUTPUT's results and --overwrite drops them: pick one")
    named = [
        (option, path)
        for option, path in (
            ("-o OUTPUT", output_path),
            ("--metrics", metrics_path),
            ("--prefix-cache", prefix_cache_path),
        )
        if path is not None
    ]
    for i, (option, path) in enumerate(named):
        for other, other_path in named[:i]:
            if same_file(path, other_path):
                raise ValueError(f"{other} and {option} name the same file: pick another {option}")
    for option, path in named:
        if input_path != "-" and same_file(path, input_path):
            raise ValueError(f"{option} {path} is the input file; pick another path")
        if not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{option}: folder {Path(path).parent} does not exist")
    if prefix_cache_path is not None:
        cache = Path(prefix_cache_path)
        if cache.exists() and not cache.is_file():
            raise ValueError(f"--prefix-cache {prefix_cache_path} is not a regular file")
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
