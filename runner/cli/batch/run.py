"""`kvcache generate`: a batch file in, one JSONL record per request out, as they finish."""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from runner.cli.batch.beams import BeamRecord, line_prompt, search_lines
from runner.cli.batch.file import (
    BatchLine,
    ResultWriter,
    parse_line,
    read_lines,
    unreadable_line,
)
from runner.cli.batch.records import Record, RecordsNotWritten
from runner.cli.output_lock import LockedOutput
from runner.cli.sampling_defaults import SamplingDefaults
from runner.cli.stdout import StdoutFailed, silence_stdout
from runner.engine.api.interface import EngineInterface
from runner.engine.api.llm import LLM
from runner.engine.requests.outputs import RequestOutput


class BatchRun:
    """Feeds every good line to one LLM; a bad line becomes an error record and the run goes on."""

    def __init__(
        self,
        model: str | None,
        engine_options: dict[str, Any],
        defaults: SamplingDefaults,
        beam_width: int | None = None,
    ) -> None:
        self.llm: EngineInterface = LLM(model, **engine_options)
        self.defaults = defaults
        self.beam_width = beam_width  # beam search instead of sampling (runner/cli/batch/beams.py)
        self.beam_lines: list[BatchLine] = []
        self.num_errors = 0
        self.num_done = 0
        self.num_skipped = 0
        self.output_tokens = 0
        self.num_queued = 0
        self.num_rerun = 0  # done ids in OUTPUT whose input line changed since: run again
        self._hash_of: dict[str, str] = {}  # each queued request's hash, for its record

    def execute(self, input_path: str, held: LockedOutput | None, resume: bool) -> int:
        """Runs every line of the input into OUTPUT (`held`: opened and locked before the model
        loaded; None: results are printed). Returns the exit code: 0 when every line ran, 1
        when some failed or the output could not be written (a full disk), 130 on Ctrl-C."""
        try:
            return self._execute(input_path, held, resume)
        except RecordsNotWritten as err:  # a full disk: every record written is whole
            print(f"\nerror: {err}", file=sys.stderr)
            return 1
        except StdoutFailed as err:  # printed results that cannot be: stop, saying so once
            silence_stdout()
            print(f"\nerror: {err.message}", file=sys.stderr)
            return 1

    def _execute(self, input_path: str, held: LockedOutput | None, resume: bool) -> int:
        start = time.perf_counter()
        output = held.path if held is not None else None
        try:
            writer: ResultWriter | PrintWriter = (
                ResultWriter(output, resume, held) if output is not None else PrintWriter()
            )
        except OSError as err:  # --resume rewrote it (a torn tail cut) onto a full disk
            assert output is not None  # printing opens nothing
            kept = output.read_bytes().count(b"\n") if output.is_file() else 0
            raise RecordsNotWritten(output, kept, err) from err
        line_of: dict[str, int] = {}
        given_ids: set[str] = set()  # ids written in the file, not taken from line numbers
        with ExitStack() as stack:
            stack.callback(writer.close)
            try:
                stream = self._open(input_path, stack)
            except OSError as err:
                print(f"error: cannot read {input_path}: {err}", file=sys.stderr)
                return 2
            is_text = input_path.endswith(".txt")
            failed_ids: set[str] = set()  # ids of lines that fail: their records may go
            for line_no, text, error in read_lines(stream, is_text):
                if error:
                    line = unreadable_line(line_no, text, error, is_text)
                else:
                    line = parse_line(line_no, text, self.defaults, is_text)
                self._take(writer, line, output, line_of, given_ids, failed_ids)
            for request_id in sorted(failed_ids.intersection(writer.done_ids) - line_of.keys()):
                writer.drop(request_id)  # its only line fails now: the old answer goes
                print(
                    f"id {request_id!r}: its record in {output} is dropped: its line now fails",
                    file=sys.stderr,
                )
            total = len(self.beam_lines) or self.num_queued
            bar = tqdm(total=total, desc="generate", unit="req", file=sys.stderr)
            stack.callback(bar.close)
            try:
                self._generate(writer, line_of, bar, start)
            except KeyboardInterrupt:
                bar.close()
                where = f"written to {output}; rerun with --resume" if output else "printed"
                print(f"\ninterrupted: {self.num_done} requests {where}", file=sys.stderr)
                return 130
        self._summary(output, time.perf_counter() - start)
        return 1 if self.num_errors else 0

    def _take(
        self,
        writer: ResultWriter | PrintWriter,
        line: BatchLine,
        output: Path | None,
        line_of: dict[str, int],
        given_ids: set[str],
        failed_ids: set[str],
    ) -> None:
        """One input line: failed, skipped (its record is in OUTPUT already), or queued."""
        # An id belongs to its first line that parses, in a fresh run as on resume: a
        # later line of that id is an error, whatever OUTPUT holds for the id.
        if line.error is None and line.request_id in line_of:
            line.error = self._repeat_error(line, line_of[line.request_id], given_ids)
        if line.error is not None:
            failed_ids.add(line.request_id)
            self._fail(writer, line)
            return
        line_of[line.request_id] = line.line_no
        if line.id_given:
            given_ids.add(line.request_id)
        if line.request_id in writer.done_ids:
            if not writer.is_stale(line):
                self.num_skipped += 1
                return
            self.num_rerun += 1
            print(
                f"line {line.line_no}: id {line.request_id!r}: its record in {output} was "
                "made from another request (the input or the options changed since); "
                "running it again",
                file=sys.stderr,
            )
        self._hash_of[line.request_id] = line.request_hash
        if self.beam_width:
            self.beam_lines.append(line)
        else:
            self._submit(writer, line)

    def _generate(
        self,
        writer: ResultWriter | PrintWriter,
        line_of: dict[str, int],
        bar: tqdm,
        start: float,
    ) -> None:
        """The queued requests run to their ends (the beam searches first), each record
        written as it ends."""
        if self.beam_width:
            search_lines(
                self.llm,
                self.beam_lines,
                self.beam_width,
                lambda line, record: self._searched(writer, record, line.request_hash, bar, start),
                lambda line: self._fail(writer, line),
            )
        self.llm.run_until_done(lambda out: self._finish(writer, out, line_of, bar, start))

    @staticmethod
    def _open(input_path: str, stack: ExitStack) -> IO[bytes]:
        if input_path == "-":
            return sys.stdin.buffer
        return stack.enter_context(Path(input_path).open("rb"))

    def _submit(self, writer: ResultWriter | PrintWriter, line: BatchLine) -> None:
        try:
            prompt, special = line_prompt(self.llm, line)
            self.llm.add_request(
                prompt,
                line.params,
                request_id=line.request_id,
                cache_salt=line.cache_salt,
                add_special_tokens=special,
                priority=line.priority,
            )
            self.num_queued += 1
        except ValueError as err:
            line.error = f"line {line.line_no}: {err}"
            self._fail(writer, line)
        except (TypeError, RecursionError, UnicodeError) as err:  # a check missed it: alone
            line.error = f"line {line.line_no}: {type(err).__name__}: {err}"
            self._fail(writer, line)

    @staticmethod
    def _repeat_error(line: BatchLine, first_line: int, given_ids: set[str]) -> str:
        """Why a line's id clashes with an earlier line's, saying which side defaulted."""
        message = f"line {line.line_no}: id {line.request_id!r} repeats line {first_line}"
        if line.request_id not in given_ids:
            return message + " (which has no id, so its line number is its id)"
        if not line.id_given:
            return message + " (this line has no id, so its line number is its id; give it one)"
        return message

    def _fail(self, writer: ResultWriter | PrintWriter, line: BatchLine) -> None:
        self.num_errors += 1
        writer.write({"id": line.request_id, "line": line.line_no, "error": line.error})
        print(f"error: {line.error}", file=sys.stderr)

    def _finish(
        self,
        writer: ResultWriter | PrintWriter,
        out: RequestOutput,
        line_of: dict[str, int],
        bar: tqdm,
        start: float,
    ) -> None:
        record = {**out.to_record(), "line": line_of[out.request_id]}
        writer.write({**record, "request_hash": self._hash_of.pop(out.request_id, "")})
        if out.error is not None:  # its engine step failed: an error, not a result
            self.num_errors += 1
            tqdm.write(f"error: line {line_of[out.request_id]}: {out.error}", file=sys.stderr)
        else:
            self.num_done += 1
        self.output_tokens += sum(len(sample.token_ids) for sample in out.outputs)
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.update(1)
        bar.set_postfix(
            tok_s=f"{self.output_tokens / elapsed:.1f}",
            hit=f"{self.llm.cache_stats().hit_rate:.1%}",
            refresh=False,
        )

    def _searched(
        self,
        writer: ResultWriter | PrintWriter,
        record: BeamRecord,
        request_hash: str,
        bar: tqdm,
        start: float,
    ) -> None:
        """A line's beam search is done: its record out, the counts and the bar on."""
        writer.write({**record, "request_hash": request_hash})
        self.num_done += 1
        self.output_tokens += len(record["token_ids"])
        bar.update(1)
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix(tok_s=f"{self.output_tokens / elapsed:.1f}", refresh=False)

    def _summary(self, output: Path | None, elapsed: float) -> None:
        s, pool = self.llm.stats(), self.llm.kv_pool()
        lines = [
            f"done: {self.num_done} requests, {self.num_errors} errors"
            + (f", {self.num_skipped} skipped (already in output)" if self.num_skipped else "")
            + (f", {self.num_rerun} run again (changed since)" if self.num_rerun else ""),
            f"output tokens: {self.output_tokens} in {elapsed:.1f} s "
            f"({self.output_tokens / max(elapsed, 1e-9):.1f} tok/s)",
            f"prefix cache: {s['hit_tokens']}/{s['query_tokens']} prompt tokens hit "
            f"({s['hit_rate']:.1%}; {s['copied_tokens']} copied from partial blocks), "
            f"{s['evicted_blocks']} blocks evicted, "
            f"{s['num_preemptions']} preemptions",
            f"KV pool: {pool.num_blocks} blocks of {pool.block_size} tokens "
            f"({pool.num_slots:,} tokens of {pool.dtype_name} keys and values)",
        ]
        if s["segment_query_tokens"]:
            lines.append(
                f"segments: {s['segment_hit_tokens']}/{s['segment_query_tokens']} tokens of later "
                f"segments served from their own cache ({s['segment_hit_rate']:.1%}; "
                f"{s['segment_recompute_fraction']:.1%} of them recomputed), "
                f"{s['segments_filled']} segments cached alone"
            )
        if s["num_draft_tokens"]:
            lines.append(
                f"speculative: {s['num_accepted_tokens']}/{s['num_draft_tokens']} guessed tokens "
                f"kept ({s['num_accepted_tokens'] / s['num_draft_tokens']:.1%})"
            )
        if output is not None:
            lines.append(f"results: {output}")
        print("\n".join(lines), file=sys.stderr)


class PrintWriter:
    """Without an output file: print each result as a readable line on stdout."""

    done_ids: frozenset[str] = frozenset()

    def is_stale(self, line: BatchLine) -> bool:
        return False  # nothing was done before: there is no record to be stale

    def drop(self, request_id: str) -> None:
        pass  # nothing was done before: there is no record to drop

    def write(self, record: Record) -> None:
        if "error" in record:
            lines = [f"[{record['id']}] (error) {record['error']!r}"]
        elif "outputs" in record:  # several samples: one line each
            outputs = record["outputs"]
            assert isinstance(outputs, list)  # RequestOutput.to_record's samples
            lines = [
                f"[{record['id']}#{o['index']}] ({o['finish_reason']}) {o['text']!r}"
                for o in outputs
            ]
        else:
            lines = [f"[{record['id']}] ({record['finish_reason']}) {record['text']!r}"]
        try:
            for line in lines:
                tqdm.write(line, file=sys.stdout)  # not across the bar
            sys.stdout.flush()
        except OSError as err:  # `> /dev/full`, a full disk under a redirect
            raise StdoutFailed(err) from err

    def close(self) -> None:
        pass
