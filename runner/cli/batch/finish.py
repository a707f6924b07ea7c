"""`kvcache generate`'s files besides OUTPUT: the prefix cache loaded before the run and saved
after it, and the metrics written at the end, each replaced whole or not at all, and a second
Ctrl-C while they are written stopping the run at once without a traceback."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from runner.cli.batch.paths import check_output_file

if TYPE_CHECKING:
    from runner.cli.batch.run import BatchRun
    from runner.cli.output_lock import LockedOutput
    from runner.engine.api.interface import BlockEngine


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class PrefixCacheFile:
    """--prefix-cache FILE: loaded when it exists, saved there at the end. A file that was not
    read as a prefix cache of this engine (another file, a cache of another model or block
    size, a damaged one) is never replaced unless --overwrite says so: it may be someone's
    data, or a cache another engine still uses."""

    def __init__(self, path: Path, overwrite: bool) -> None:
        self.path = path
        self.overwrite = overwrite
        self.keep_as_is = False  # set when the file there is not ours to replace

    def load(self, llm: BlockEngine) -> None:
        if not self.path.exists():
            return
        try:
            blocks = llm.load_prefix_cache(self.path)
        except ValueError as err:  # a stale cache costs a cold start, not the run
            if self.overwrite:
                _say(f"prefix cache: ignored, starting cold: {err}; replaced at the end")
                return
            self.keep_as_is = True
            _say(
                f"prefix cache: ignored, starting cold: {err}; {self.path} is kept as it is "
                "(--overwrite replaces it)"
            )
            return
        _say(f"prefix cache: {blocks} blocks loaded from {self.path}")

    def save(self, llm: BlockEngine) -> None:
        if self.keep_as_is:
            _say(f"prefix cache: not saved: {self.path} was not this engine's prefix cache")
            return
        try:
            blocks = llm.save_prefix_cache(self.path)
        except Exception as err:  # noqa: BLE001 - a full disk (safetensors' own error type)
            _say(f"prefix cache: not saved ({err}); {self.path} is as it was")
            return
        _say(f"prefix cache: {blocks} blocks saved to {self.path}")


def write_metrics(metrics: Mapping[str, object], path: Path) -> None:
    """The metrics JSON, written beside `path` then swapped in: a full disk leaves no half
    file for `kvcache report` to choke on, and no temporary file. Checked again as --metrics
    was before the run: what was put at `path` since (a device, a FIFO) is never replaced."""
    try:
        check_output_file(str(path))
    except ValueError as err:
        _say(f"metrics: not written ({err})")
        return
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        partial.write_text(json.dumps(metrics))
        os.replace(partial, path)
        _say(f"metrics written to {path}")
    except OSError as err:
        _say(f"metrics: not written ({err.strerror or err}); {path} is as it was")
    finally:
        partial.unlink(missing_ok=True)


def run_batch(
    run: BatchRun,
    input_path: str,
    output: LockedOutput | None,
    resume: bool,
    cache: PrefixCacheFile | None,
    metrics_path: Path | None,
) -> int:
    """Load the cache, run every line, save the cache and the metrics; returns the exit code.
    A Ctrl-C (or SIGTERM) in the run ends it, and the files are still saved, as they are
    after any run; one more while they are saved stops at once (each is replaced whole or
    not at all, so none is half written)."""
    try:
        if cache is not None:
            cache.load(run.llm)
    except KeyboardInterrupt:
        _say("\ninterrupted while loading the prefix cache; nothing was generated")
        return 130
    try:
        code = run.execute(input_path, output, resume=resume)
    except KeyboardInterrupt:  # a second one while the first was being handled
        _say("\ninterrupted")
        code = 130
    try:
        run.llm.flush_cache_tiers()  # the disk and remote tiers have every block before exit
        if cache is not None:
            cache.save(run.llm)
        if metrics_path is not None:
            write_metrics(run.llm.metrics(), metrics_path)
    except KeyboardInterrupt:
        _say("\ninterrupted again: stopped without saving the prefix cache or metrics")
        return 130
    return code
