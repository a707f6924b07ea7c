"""Reading a batch of requests from JSONL / text, and the crash-safe JSONL output file."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from runner.cli.batch.records import (
    Record,
    RecordsNotWritten,
    drop_records,
    recover,
    request_hash,
)
from runner.cli.output_lock import LockedOutput, OutputInUse
from runner.cli.sampling_defaults import SamplingDefaults
from runner.engine.requests.segmented_prompt import SegmentedPrompt
from runner.engine.requests.validation import check_template_kwargs
from runner.sampling.params import SamplingParams
from runner.sampling.structured_outputs import StructuredOutputsParams
from runner.sampling.text_checks import first_bad_text, may_hold_surrogates

SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "structured_outputs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "prompt_logprobs",
    "n",
)
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids", "segments")
KNOWN_FIELDS = frozenset(
    (
        *("id", "cache_salt", "priority", "chat_template_kwargs", "blend_ratio"),
        *PROMPT_FIELDS,
        *SAMPLING_FIELDS,
    )
)


@dataclass
class BatchLine:
    """One parsed input line: a request, or the error that stops it."""

    line_no: int
    request_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    template_kwargs: dict[str, object] | None = None  # the chat template's, with messages
    prompt_token_ids: list[int] | None = None
    segments: SegmentedPrompt | None = None  # a prompt given as segments (docs/SEGMENTS.md)
    params: SamplingParams | None = None
    cache_salt: str | None = None
    priority: int = 0  # vLLM's (lower first); orders the queue, not the answer
    error: str | None = None
    extra: dict[str, object] = field(default_factory=dict)
    id_given: bool = False  # False: the id is the line number, since the line named none
    request_hash: str = ""  # of the request as it runs (runner/cli/batch/records.py), for --resume


def read_lines(stream: IO[bytes], is_text_file: bool) -> Iterator[tuple[int, str, str]]:
    """Yield (line number, decoded line, error) for each non-blank line; the error is empty
    unless the line is not UTF-8, whose bytes that are not are then decoded as lone
    surrogates (for unreadable_line to find the line's id; never to run as a prompt).

    Decoding is per line, so one line that is not UTF-8 fails alone."""
    for line_no, raw in enumerate(stream, start=1):
        if line_no == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Windows editors)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield (
                line_no,
                raw.decode("utf-8", "surrogateescape").rstrip("\r\n"),
                f"line {line_no}: not valid UTF-8 ({err.reason} at byte {err.start})",
            )
            continue
        text = text.rstrip("\r\n")
        if not text.strip():
            continue
        yield line_no, text, ""


def parse_line(
    line_no: int, text: str, defaults: SamplingDefaults, is_text_file: bool
) -> BatchLine:
    """Turn one line into a request; any problem becomes `error`, naming line and field."""
    if is_text_file:
        return _with_params(BatchLine(line_no, str(line_no), prompt=text), {}, defaults)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return BatchLine(line_no, str(line_no), error=f"line {line_no}: not valid JSON ({err.msg})")
    except RecursionError:  # valid JSON, but nested deeper than the parser's stack goes
        return BatchLine(line_no, str(line_no), error=f"line {line_no}: JSON nested too deeply")
    if not isinstance(obj, dict):
        return BatchLine(line_no, str(line_no), error=f"line {line_no}: expected a JSON object")
    bad_text = first_bad_text(obj, "") if may_hold_surrogates(text) else None
    if bad_text is not None:  # before any of it reaches an encoder: the id, the prompt, ...
        return _failed(line_no, own_id(obj), f"line {line_no}: {bad_text}")
    request_id = obj.get("id", str(line_no))
    if not isinstance(request_id, str | int) or isinstance(request_id, bool):
        return BatchLine(line_no, str(line_no), error=f"line {line_no}: 'id' must be a string")
    line = BatchLine(line_no, str(request_id), id_given="id" in obj)
    unknown = sorted(set(obj) - KNOWN_FIELDS)
    if unknown:
        line.error = f"line {line_no}: unknown field(s) {', '.join(unknown)}"
        return line
    given = [k for k in PROMPT_FIELDS if k in obj]
    if len(given) != 1:
        line.error = (
            f"line {line_no}: needs exactly one of prompt, messages, prompt_token_ids, segments"
        )
        return line
    if "blend_ratio" in obj and "segments" not in obj:
        line.error = f"line {line_no}: blend_ratio applies to a line given as segments"
        return line
    key = given[0]
    value = obj[key]
    if key == "prompt":
        if not isinstance(value, str) or not value.strip():
            line.error = f"line {line_no}: 'prompt' must be a non-empty string"
            return line
        line.prompt = value
    elif key == "messages":
        if not isinstance(value, list) or not value:
            line.error = f"line {line_no}: 'messages' must be a non-empty list"
            return line
        line.messages = value
    elif key == "segments":
        try:
            line.segments = SegmentedPrompt.of(value, obj.get("blend_ratio"))
        except ValueError as err:
            line.error = f"line {line_no}: {err}"
            return line
    else:
        if not isinstance(value, list) or not value:
            line.error = f"line {line_no}: 'prompt_token_ids' must be a non-empty list of ints"
            return line
        line.prompt_token_ids = value
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        line.error = f"line {line_no}: 'cache_salt' must be a string"
        return line
    line.cache_salt = salt
    priority = obj.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        line.error = f"line {line_no}: 'priority' must be an integer"
        return line
    line.priority = priority
    if "chat_template_kwargs" in obj:
        if line.messages is None:
            line.error = f"line {line_no}: chat_template_kwargs needs messages"
            return line
        try:
            check_template_kwargs(obj["chat_template_kwargs"])
        except ValueError as err:
            line.error = f"line {line_no}: {err}"
            return line
        line.template_kwargs = obj["chat_template_kwargs"]
    return _with_params(line, {k: obj[k] for k in SAMPLING_FIELDS if k in obj}, defaults)


def own_id(obj: object) -> str | None:
    """A parsed line's own id, when it has one that can name its record: a string of text (no
    lone surrogate: a record cannot be written with one) or an integer; else None."""
    request_id = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(request_id, bool) or not isinstance(request_id, str | int):
        return None
    return None if first_bad_text(str(request_id), "id") else str(request_id)


def unreadable_line(line_no: int, text: str, error: str, is_text_file: bool) -> BatchLine:
    """A line that is not UTF-8 (read_lines' error) as a failed BatchLine; its record keeps the
    line's own id when the rest of the line is a JSON object with a readable id."""
    if is_text_file:
        return _failed(line_no, None, error)
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        obj = None
    return _failed(line_no, own_id(obj), error)


def _failed(line_no: int, request_id: str | None, error: str) -> BatchLine:
    """A line that fails, named by its own id when it has one, else by its line number."""
    if request_id is None:
        return BatchLine(line_no, str(line_no), error=error)
    return BatchLine(line_no, request_id, id_given=True, error=error)


def _with_params(line: BatchLine, given: dict[str, Any], defaults: SamplingDefaults) -> BatchLine:
    try:
        line.request_hash = request_hash(line, {**defaults, **given})
        structure = given.get("structured_outputs")
        if isinstance(structure, dict):  # {"json": {...}}, {"regex": "..."}, {"choice": [...]}
            unknown = sorted(set(structure) - set(StructuredOutputsParams.__dataclass_fields__))
            if unknown:
                raise ValueError(f"structured_outputs has no field {unknown[0]!r}")
            given["structured_outputs"] = StructuredOutputsParams(**structure)
        line.params = SamplingParams(**{**defaults, **given})
    except (ValueError, TypeError) as err:
        line.error = f"line {line.line_no}: {err}"
    except RecursionError:  # a field nested nearly as deep as the parser's stack goes
        line.error = f"line {line.line_no}: a field is nested too deeply"
    return line


class ResultWriter:
    """Appends one JSON record per finished request; each record is one write and an fsync,
    so a killed run leaves only whole lines (a torn tail from an older crash is cut on open).
    A write that fails (a full disk) is cut back off and raised as RecordsNotWritten.

    The file is written under its lock (runner/cli/output_lock.py): `held`, taken before the
    model loaded, or taken here (OutputInUse when another run holds it)."""

    def __init__(self, path: Path, resume: bool, held: LockedOutput | None = None) -> None:
        self.path = path
        self._own_lock = held is None  # closed with the writer; else the caller closes it
        self._held = LockedOutput(path) if held is None else held
        self._held.taken = True
        try:
            recovered = recover(path) if resume else None
            self._held.follow()  # recover may have swapped a new file in: hold that one
            if not resume:  # emptied in place, through a symlink, not unlinked
                os.ftruncate(self._held.fd, 0)
        except BaseException:
            if self._own_lock:
                self._held.close()
            raise
        self._fd = self._held.fd
        self.done: dict[str, str | None] = recovered.done if recovered else {}
        self.done_ids: set[str] = set(self.done)
        self.num_records = recovered.records if recovered else 0
        self._stale: set[str] = set()  # done ids whose input line changed: answered again
        self._old_errors: set[bytes] = recovered.errors if recovered else set()
        self._errors_again: set[bytes] = set()  # old error records this run made again
        self._opened_size = os.fstat(self._fd).st_size  # the records of earlier runs

    def is_stale(self, line: BatchLine) -> bool:
        """Whether the record kept for a done id answers another request than `line` (a line
        that parses: its hash differs): the line then runs again, and the old record is dropped
        when the writer closes. A record without a hash (written before records had one) is
        trusted."""
        kept = self.done.get(line.request_id)
        if kept is None or kept == line.request_hash:
            return False
        self.drop(line.request_id)
        return True

    def drop(self, request_id: str) -> None:
        """The record kept for `request_id` no longer stands (its line changed, or now fails):
        it is dropped when the writer closes."""
        if request_id in self.done_ids:
            self._stale.add(request_id)
            self.done_ids.discard(request_id)

    def write(self, record: Record) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        if data in self._old_errors:  # the same error as the last run's: its record stays
            self._errors_again.add(data)
            return
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:  # a short write (the disk filling up) is continued or raises
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)  # no half record left for --resume to cut
            raise RecordsNotWritten(self.path, self.num_records, err) from err
        self.num_records += 1

    def close(self) -> None:
        gone = self._old_errors - self._errors_again  # lines that now run, or fail otherwise
        if self._stale or gone:  # their new records are in: the old ones go (a crash first:
            with contextlib.suppress(OSError):  # recover); a full disk: the next --resume
                drop_records(self.path, self._opened_size, self._stale, gone)  # still locked
            with contextlib.suppress(OSError, OutputInUse):  # our records are all written
                self._held.follow()  # the rewritten file stays held until the run ends
        if self._own_lock:
            self._held.close()
