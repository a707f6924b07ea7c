"""`kvcache generate`'s output records on disk: what --resume keeps of them, and the writes that
can fail (a full disk) without leaving half a record or a stray temporary file.

Each result record carries `request_hash`, a hash of the request it answers (the prompt, its
salt and chat template arguments, every sampling field with the command line's defaults
filled in). --resume keeps a record only while the input line of its id still hashes the same:
an input that changed since (a line added at the top shifts every line-number id) reruns those
lines instead of attaching old answers to new prompts.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path
from typing import Any, Protocol

import xxhash

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class LineRequest(Protocol):
    """What a batch line's request is made of (runner/cli/batch_file.py's BatchLine)."""

    prompt: Any
    messages: Any
    prompt_token_ids: Any
    segments: Any
    template_kwargs: Any
    cache_salt: Any


def request_hash(line: LineRequest, sampling: dict[str, Any]) -> str:
    """The hash of one line's request as it runs: its prompt fields and `sampling` (the
    line's fields over the defaults)."""
    request = {
        "prompt": line.prompt,
        "messages": line.messages,
        "prompt_token_ids": line.prompt_token_ids,
        **({"segments": line.segments} if line.segments is not None else {}),
        "chat_template_kwargs": line.template_kwargs,
        "cache_salt": line.cache_salt,
        "sampling": sampling,
    }
    text = json.dumps(request, sort_keys=True, default=_plain)  # ASCII: any str encodes
    return f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"


def _plain(value: Any) -> Any:
    """A default's StructuredOutputsParams (from --json-schema) as JSON."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return repr(value)


class RecordsNotWritten(Exception):
    """A write of the output failed (a full disk): what is in the file is whole and kept."""

    def __init__(self, path: Path, kept: int, err: OSError) -> None:
        self.path, self.kept, self.err = path, kept, err
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.err.errno in _DISK_FULL:
            return (
                f"disk full: {self.kept} records kept in {self.path}; "
                "free space and rerun with --resume"
            )
        return (
            f"cannot write {self.path} ({self.err.strerror or self.err}): {self.kept} records "
            "kept; rerun with --resume"
        )


def recover(path: Path) -> dict[str, str | None]:
    """The ids already answered in `path`, each with its record's request hash (None for a
    record written before records carried one). Cuts a last line that a crash left half
    written, drops error records (their lines run again: an input line fixed since, a failed
    engine step), and of two records of one id keeps the later (an answer to a changed line,
    written before the run that made it could drop the old one)."""
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    last: dict[str, tuple[bytes, str | None]] = {}
    for raw in data[:keep].splitlines(keepends=True):
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, RecursionError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and "id" in record and "error" not in record:
            request_id = str(record["id"])
            last.pop(request_id, None)  # re-inserted: the file's order is the later record's
            kept_hash = record.get("request_hash")
            last[request_id] = (raw, kept_hash if isinstance(kept_hash, str) else None)
    kept = b"".join(raw for raw, _ in last.values())
    if kept != data:
        rewrite(path, kept)
    return {request_id: kept_hash for request_id, (_, kept_hash) in last.items()}


def drop_stale(path: Path, before: int, stale: set[str]) -> None:
    """Drop from `path` the records of `stale` ids among its first `before` bytes (what the
    file held when this run opened it): each of those ids has a newer record after them."""
    data = path.read_bytes()
    head = [raw for raw in data[:before].splitlines(keepends=True) if _record_id(raw) not in stale]
    rewrite(path, b"".join(head) + data[before:])


def _record_id(raw: bytes) -> str | None:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, RecursionError, UnicodeDecodeError):
        return None
    return str(record["id"]) if isinstance(record, dict) and "id" in record else None


def rewrite(path: Path, data: bytes) -> None:
    """Replace `path`'s bytes with `data`, whole or not at all: written beside it, then swapped
    in (a crash loses nothing); a write that fails (a full disk) leaves `path` as it was and no
    temporary file behind. Through a symlink, its target is replaced and the link kept; the
    file's mode is kept."""
    path = path.resolve()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            os.chmod(f.fileno(), path.stat().st_mode & 0o7777)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
