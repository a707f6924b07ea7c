"""Checks on the file arguments of the command line, made before anything loads: every file a
command writes (`kvcache generate`'s OUTPUT, --metrics and --prefix-cache, `report --html`,
`bench --json`, `bench-serve --result-json`) through one check, and `kvcache generate`'s own
rules on how its files relate."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import click

# What a path that is not a regular file is, for the error that refuses it.
_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def check_output_file(path: str) -> None:
    """Raise ValueError unless `path` can take a file that a command writes: nothing there yet,
    or a regular file (through a symlink, its target), in a folder that exists. Writes replace
    the file at the path (a temporary file renamed over it) or write into it, so a device node
    (/dev/null, /dev/full: as root, replaced by a JSON file), a FIFO (the write would wait for a
    reader) or a socket is refused, before any open for writing."""
    try:
        mode = os.stat(path).st_mode  # follows a symlink: its target is what would be written
    except FileNotFoundError:  # nothing there, or a dangling symlink: a new file is made
        mode = None
    except OSError as err:  # a path through a file, a loop of symlinks, no permission
        raise ValueError(f"{path}: {err.strerror or err}") from err
    if mode is not None and not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "something else")
        raise ValueError(f"{path} is not a regular file but {kind}: name a file to write")
    if not Path(path).resolve().parent.is_dir():
        raise ValueError(f"{path}: folder {Path(path).parent} does not exist")


class OutputFile(click.ParamType):
    """The type of an option that names a file the command writes: checked by
    check_output_file when the command line is parsed, so before anything loads."""

    name = "file"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> str:
        path = str(value)
        try:
            check_output_file(path)
        except ValueError as err:
            self.fail(str(err), param, ctx)
        return path


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
    """Raise ValueError for an output that would lose work: OUTPUT, --metrics or --prefix-cache
    naming the input or each other (one would be emptied or overwritten), or an OUTPUT
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
    if output_path is None:
        return
    out = Path(output_path)
    if not (resume or overwrite) and out.exists() and out.stat().st_size > 0:
        raise ValueError(
            f"{output_path} already holds results: --resume finishes that run, "
            "--overwrite starts again"
        )
