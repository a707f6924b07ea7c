"""Reading a batch of requests from JSONL / text, and the crash-safe JSONL output file."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from runner.engine.requests import check_template_kwargs
from runner.sampling.params import SamplingParams
from runner.sampling.structured_outputs import StructuredOutputsParams

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
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
KNOWN_FIELDS = frozenset(
    ("id", "cache_salt", "chat_template_kwargs", *PROMPT_FIELDS, *SAMPLING_FIELDS)
)


@dataclass
class BatchLine:
    """One parsed input line: a request, or the error that stops it."""

    line_no: int
    request_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    template_kwargs: dict[str, Any] | None = None  # the chat template's, with messages
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    cache_salt: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    id_given: bool = False  # False: the id is the line number, since the line named none


def read_lines(stream: IO[bytes], is_text_file: bool) -> Iterator[tuple[int, str | None, str]]:
    """Yield (line number, decoded line or None, error) for each non-blank line.

    Decoding is per line, so one line that is not UTF-8 fails alone."""
    for line_no, raw in enumerate(stream, start=1):
        if line_no == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Windows editors)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield (
                line_no,
                None,
                f"line {line_no}: not valid UTF-8 ({err.reason} at byte {err.start})",
            )
            continue
        text = text.rstrip("\r\n")
        if not text.strip():
            continue
        yield line_no, text, ""


def parse_line(line_no: int, text: str, defaults: dict[str, Any], is_text_file: bool) -> BatchLine:
    """Turn one line into a request; any problem becomes `error`, naming line and field."""
    if is_text_file:
        return _with_params(BatchLine(line_no, str(line_no), prompt=text), {}, defaults)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return BatchLine(line_no, str(line_no), error=f"line {line_no}: not valid JSON ({err.msg})")
    if not isinstance(obj, dict):
        return BatchLine(line_no, str(line_no), error=f"line {line_no}: expected a JSON object")
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
        line.error = f"line {line_no}: needs exactly one of prompt, messages, prompt_token_ids"
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


def _with_params(line: BatchLine, given: dict[str, Any], defaults: dict[str, Any]) -> BatchLine:
    try:
        structure = given.get("structured_outputs")
        if isinstance(structure, dict):  # {"json": {...}}, {"regex": "..."}, {"choice": [...]}
            unknown = sorted(set(structure) - set(StructuredOutputsParams.__dataclass_fields__))
            if unknown:
                raise ValueError(f"structured_outputs has no field {unknown[0]!r}")
            given["structured_outputs"] = StructuredOutputsParams(**structure)
        line.params = SamplingParams(**{**defaults, **given})
    except (ValueError, TypeError) as err:
        line.error = f"line {line.line_no}: {err}"
    return line


class ResultWriter:
    """Appends one JSON record per finished request; each record is one write and a flush, so
    a killed run leaves only whole lines (a torn tail from an older crash is cut on open)."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.done_ids: set[str] = set()
        if resume and path.exists():
            self.done_ids = _recover(path)
        # "w" empties the file in place, through a symlink, instead of unlinking it.
        self._file = path.open("a" if resume else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _recover(path: Path) -> set[str]:
    """Ids already generated in `path`. Cuts a last line that a crash left half written, and
    drops error records, so that their lines run again (an input line fixed since, a failed
    engine step) instead of being skipped as done, and are not written twice."""
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    done: set[str] = set()
    kept: list[bytes] = []
    for raw in data[:keep].splitlines(keepends=True):
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "id" in record and "error" not in record:
            done.add(str(record["id"]))
            kept.append(raw)
    if b"".join(kept) != data:  # rewritten whole, then swapped in: a crash here loses nothing
        path = path.resolve()  # through a symlink: replace its target, keep the link
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as f:
            os.chmod(f.fileno(), path.stat().st_mode & 0o7777)
            f.write(b"".join(kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return done
