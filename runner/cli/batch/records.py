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
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeAlias

import xxhash

from runner.engine.requests.segmented_prompt import SegmentedPrompt

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_HASH = re.compile(r"[0-9a-f]{16}")

# One JSON line of the output (an answer, a line's error, a beam search's answers), as written.
Record: TypeAlias = dict[str, object]


class LineRequest(Protocol):
    """What a batch line's request is made of (runner/cli/batch/file.py's BatchLine)."""

    prompt: str | None
    messages: list[dict[str, str]] | None
    prompt_token_ids: list[int] | None
    segments: SegmentedPrompt | None
    template_kwargs: dict[str, object] | None
    cache_salt: str | None


def request_hash(line: LineRequest, sampling: Mapping[str, object]) -> str:
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


def _plain(value: object) -> object:
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


@dataclass
class Recovered:
    """What an OUTPUT holds for --resume."""

    done: dict[str, str | None]  # each answered id: its record's hash (see recover)
    errors: set[bytes]  # the error records' lines, each with its newline
    records: int  # the records in the file, answers and errors


def valid_hash(value: object) -> bool:
    """Whether `value` is a request hash as request_hash writes it (16 lowercase hex digits)."""
    return isinstance(value, str) and _HASH.fullmatch(value) is not None


def recover(path: Path) -> Recovered:
    """What `path` already holds. Cuts a last line that a crash left half written and lines
    that are not records, and of two answers of one id keeps the later (an answer to a changed
    line, written before the run that made it could drop the old one), unless the earlier has a
    valid request hash and the later has none: a record this program did not write never
    replaces one it did. Error records stay in place (their lines run again: an input line
    fixed since, a failed engine step; the writer drops those that this run does not write
    again, so a run that changes nothing leaves the file as it was).

    Each answer's hash is None for a record without one (written before records carried one:
    trusted), "" for one whose hash is not valid (it matches no line: its line runs again)."""
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    answers: dict[str, tuple[int, str | None]] = {}
    lines: dict[int, bytes] = {}
    errors: set[bytes] = set()
    for index, raw in enumerate(data[:keep].splitlines(keepends=True)):
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, RecursionError, UnicodeDecodeError):
            continue
        if not isinstance(record, dict) or "id" not in record:
            continue
        if "error" in record:
            if raw not in errors:  # one copy of a record written twice
                errors.add(raw)
                lines[index] = raw
            continue
        request_id = str(record["id"])
        given = record.get("request_hash")
        kept_hash = None if "request_hash" not in record else given if valid_hash(given) else ""
        earlier = answers.get(request_id)
        if earlier is not None:
            if valid_hash(earlier[1]) and not valid_hash(kept_hash):
                continue  # dropped: the earlier record, hashed, stays
            del lines[earlier[0]]
        answers[request_id] = (index, kept_hash)
        lines[index] = raw
    kept = b"".join(lines[index] for index in sorted(lines))
    if kept != data:
        rewrite(path, kept)
    done = {request_id: kept_hash for request_id, (_, kept_hash) in answers.items()}
    return Recovered(done, errors, len(lines))


def drop_records(path: Path, before: int, stale: set[str], lines: set[bytes]) -> None:
    """Drop from `path`, among its first `before` bytes (what the file held when this run opened
    it), the records of `stale` ids (each of those ids has a newer record after them, or its
    line now fails) and the records that are `lines` (error records this run did not write
    again)."""
    data = path.read_bytes()
    head = [
        raw
        for raw in data[:before].splitlines(keepends=True)
        if raw not in lines and _record_id(raw) not in stale
    ]
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
