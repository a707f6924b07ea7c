"""`kvcache generate` end to end on a tiny model: bad lines fail alone, results stream to the
output file, --resume finishes a killed run without duplicates, and reports read the metrics."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from cli import main
from kvcache import LLM, BeamSearchParams


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def good(i: int, n: int = 12) -> bytes:
    return json.dumps(
        {"id": f"r{i}", "prompt_token_ids": [3 + (i * 7 + k) % 200 for k in range(n)]}
    ).encode()


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bad_lines_fail_alone(tiny_llama_dir: Path, tmp_path: Path) -> None:
    lines = [
        good(0),
        b"{not json",
        json.dumps({"id": "noprompt"}).encode(),
        json.dumps({"id": "empty", "prompt_token_ids": []}).encode(),
        json.dumps({"id": "field", "prompt_token_ids": [5, 6], "colour": "red"}).encode(),
        json.dumps({"id": "temp", "prompt_token_ids": [5, 6], "temperature": -1}).encode(),
        json.dumps({"id": "topp", "prompt_token_ids": [5, 6], "top_p": 1.5}).encode(),
        json.dumps({"id": "vocab", "prompt_token_ids": [5, 10**6]}).encode(),
        json.dumps({"id": "long", "prompt_token_ids": [5] * 600}).encode(),
        json.dumps({"id": "maxtok", "prompt_token_ids": [5, 6], "max_tokens": 0}).encode(),
        json.dumps({"id": "stop", "prompt_token_ids": [5, 6], "stop": 3}).encode(),
        b"\xff\xfe not utf-8",
        good(1),
        good(0).replace(b'"r0"', b'"r2"')[:-10],  # truncated line
        good(3),
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(
        main,
        ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_dir), "--max-tokens", "4"],
    )
    assert result.exit_code == 1, result.output
    recs = records(out)
    assert len(recs) == len(lines)
    done = {r["id"]: r for r in recs if "error" not in r}
    assert sorted(done) == ["r0", "r1", "r3"]
    assert all(len(r["token_ids"]) == 4 and r["finish_reason"] == "length" for r in done.values())
    errors = {r["line"]: r["error"] for r in recs if "error" in r}
    assert "not valid JSON" in errors[2]
    assert "exactly one of prompt" in errors[3]
    assert "non-empty" in errors[4]
    assert "colour" in errors[5]
    assert "temperature" in errors[6]
    assert "top_p" in errors[7]
    assert "vocabulary" in errors[8]
    assert "context" in errors[9]
    assert "max_tokens" in errors[10]
    assert "stop" in errors[11]
    assert "UTF-8" in errors[12]
    assert "not valid JSON" in errors[14]
    assert all(e.startswith(f"line {n}:") for n, e in errors.items())


def generate_args(src: Path, out: Path, model: Path, max_tokens: int) -> list[str]:
    """`kvcache generate SRC -o OUT` with a model and an answer length."""
    return ["generate", str(src), "-o", str(out), "--model", str(model)] + [
        "--max-tokens",
        str(max_tokens),
    ]


def test_resume_cuts_torn_line_and_skips_done(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in range(6)])
    out = tmp_path / "out.jsonl"
    args = generate_args(src, out, tiny_llama_dir, 3)
    assert CliRunner().invoke(main, args).exit_code == 0
    full = records(out)
    # Keep two whole records and half of a third, as a crash mid-write would.
    text = out.read_text().splitlines(keepends=True)
    out.write_text("".join(text[:2]) + text[2][:15])
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    again = records(out)
    assert sorted(r["id"] for r in again) == [f"r{i}" for i in range(6)]
    by_id = {r["id"]: r["token_ids"] for r in full}
    assert all(r["token_ids"] == by_id[r["id"]] for r in again)


def test_sigkill_then_resume_keeps_every_id_once(tiny_llama_dir: Path, tmp_path: Path) -> None:
    n = 150
    src = write_lines(tmp_path / "in.jsonl", [good(i, 30) for i in range(n)])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "cli", *generate_args(src, out, tiny_llama_dir, 40)]
    cmd += ["--max-num-batched-tokens", "64"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = out.read_text().count("\n")
    assert 3 <= partial < n, "the kill should land mid-run"
    subprocess.run([*cmd, "--resume"], env=env, check=True, stderr=subprocess.DEVNULL)
    recs = records(out)
    assert sorted(r["id"] for r in recs) == sorted(f"r{i}" for i in range(n))


def test_metrics_and_report(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good(i, 40) for i in range(5)])
    metrics = tmp_path / "m.json"
    runner = CliRunner()
    result = runner.invoke(
        main,
        [
            "generate",
            str(src),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--model",
            str(tiny_llama_dir),
            "--metrics",
            str(metrics),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(metrics.read_text())
    assert len(data["requests"]) == 5 and data["steps"]
    html = tmp_path / "r.html"
    result = runner.invoke(main, ["report", str(metrics), "--html", str(html)])
    assert result.exit_code == 0, result.output
    assert "hit rate" in result.output.lower()
    assert html.stat().st_size > 1000


def test_generate_leaves_the_collector_as_it_found_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Start-up runs without the cyclic collector; an in-process caller gets it back as it was,
    with nothing frozen."""
    src = write_lines(tmp_path / "in.jsonl", [good(0)])
    args = ["generate", str(src), "--model", str(tiny_llama_dir), "--max-tokens", "2"]
    assert gc.isenabled()
    assert CliRunner().invoke(main, args).exit_code == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    bad = CliRunner().invoke(main, ["generate", str(src), "--model", str(tmp_path / "none")])
    assert bad.exit_code == 1 and "not found" in bad.output
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        assert CliRunner().invoke(main, args).exit_code == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def gen_args(src: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return ["generate", str(src), "-o", str(out), "--model", str(model), *extra]


def test_output_that_is_the_input_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good(0)])
    before = src.read_bytes()
    result = CliRunner().invoke(main, gen_args(src, src, tiny_llama_dir))
    assert result.exit_code == 2 and "input file" in result.output
    assert src.read_bytes() == before
    result = CliRunner().invoke(main, gen_args(src, tmp_path / "no" / "o.jsonl", tiny_llama_dir))
    assert result.exit_code == 2 and "does not exist" in result.output


def test_bad_default_is_one_usage_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good(0), good(1)])
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, gen_args(src, out, tiny_llama_dir, "--temperature", "-1"))
    assert result.exit_code == 2 and "temperature" in result.output
    assert not out.exists()


def test_resume_reruns_error_records(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """An error record is not a result: --resume runs the line again (fixed since), and the
    output ends with each id once, and no stale error."""
    out = tmp_path / "out.jsonl"
    src = write_lines(tmp_path / "in.jsonl", [good(0), b"\xff not utf-8", b"{oops", good(3)])
    args = gen_args(src, out, tiny_llama_dir, "--max-tokens", "3")
    assert CliRunner().invoke(main, args).exit_code == 1
    assert sum("error" in r for r in records(out)) == 2
    write_lines(src, [good(0), good(1), good(2), good(3)])
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    recs = records(out)
    assert sorted(r["id"] for r in recs) == ["r0", "r1", "r2", "r3"]
    assert not any("error" in r for r in recs)


def test_utf8_bom_is_ignored(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + good(0) + b"\n")
    out = tmp_path / "out.jsonl"
    assert CliRunner().invoke(main, gen_args(src, out, tiny_llama_dir)).exit_code == 0
    assert [r["id"] for r in records(out)] == ["r0"]


def test_failed_engine_step_sets_exit_code(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    from runner.engine.step.model_runner import ModelRunner

    def boom(self: ModelRunner, batch: Any) -> Any:
        raise RuntimeError("simulated step failure")

    monkeypatch.setattr(ModelRunner, "run", boom)
    src = write_lines(tmp_path / "in.jsonl", [good(0)])
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, gen_args(src, out, tiny_llama_dir))
    assert result.exit_code == 1, result.output
    assert records(out)[0]["finish_reason"] == "error"


def test_output_holding_results_needs_resume_or_overwrite(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good(0), good(1)])
    out = write_lines(tmp_path / "out.jsonl", [b'{"id": "earlier", "text": "kept"}'])
    before = out.read_bytes()
    result = CliRunner().invoke(main, gen_args(src, out, tiny_llama_dir))
    assert result.exit_code == 2 and "--resume" in result.output and "--overwrite" in result.output
    assert out.read_bytes() == before  # refused before anything was touched
    both = CliRunner().invoke(main, gen_args(src, out, tiny_llama_dir, "--resume", "--overwrite"))
    assert both.exit_code == 2 and "pick one" in both.output
    assert (
        CliRunner().invoke(main, gen_args(src, out, tiny_llama_dir, "--overwrite")).exit_code == 0
    )
    assert [r["id"] for r in records(out)] == ["r0", "r1"]


def test_interrupt_while_loading_exits_130(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    import runner.cli.batch.run

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.cli.batch.run, "BatchRun", interrupted)
    src = write_lines(tmp_path / "in.jsonl", [good(0)])
    result = CliRunner().invoke(main, gen_args(src, tmp_path / "out.jsonl", tiny_llama_dir))
    assert result.exit_code == 130 and "nothing was generated" in result.output


def test_report_and_bench_refuse_bad_arguments_up_front(tmp_path: Path) -> None:
    metrics = Path(__file__).resolve().parents[1] / "fixtures" / "metrics_continuous.json"
    html = tmp_path / "no" / "page.html"
    result = CliRunner().invoke(main, ["report", str(metrics), "--html", str(html)])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert "hit rate" not in result.output.lower()  # refused before the summary
    for option in ("--max-num-seqs", "--max-num-batched-tokens", "--limit", "--max-tokens"):
        result = CliRunner().invoke(main, ["bench", option, "0"])
        assert result.exit_code == 2 and option in result.output
    result = CliRunner().invoke(main, ["bench", "--workload", "tiers-nothing"])
    assert result.exit_code == 2 and "tiers-working-set" in result.output  # names the known ones


def test_resume_keeps_a_symlinked_output_and_its_mode(tmp_path: Path) -> None:
    from runner.cli.batch.file import ResultWriter

    real = write_lines(
        tmp_path / "real.jsonl", [b'{"id": "a", "text": "x"}', b'{"id": "b", "error": "e"}']
    )
    real.chmod(0o600)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    writer = ResultWriter(link, resume=True)
    writer.write({"id": "b", "text": "y"})
    writer.close()
    assert writer.done_ids == {"a"}
    assert link.is_symlink() and (real.stat().st_mode & 0o777) == 0o600
    assert [r["id"] for r in records(real)] == ["a", "b"] and "error" not in records(real)[1]


def test_output_and_metrics_on_one_file_is_refused(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good(0)])
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["generate", str(src), "-o", str(out), "--metrics", str(out)])
    assert result.exit_code == 2 and "--metrics" in result.output


def test_output_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good(0)])
    result = CliRunner().invoke(main, ["generate", str(src), "-o", str(tmp_path)])
    assert result.exit_code == 2
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result = CliRunner().invoke(main, ["generate", str(src), "-o", str(fifo)])
    assert result.exit_code == 2 and "not a regular file" in result.output and fifo.exists()


def test_a_fresh_run_empties_a_symlinked_output_in_place(tmp_path: Path) -> None:
    from runner.cli.batch.file import ResultWriter

    real = write_lines(tmp_path / "real.jsonl", [b'{"id": "old", "text": "x"}'])
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    writer = ResultWriter(link, resume=False)
    writer.write({"id": "new", "text": "y"})
    writer.close()
    assert link.is_symlink() and [r["id"] for r in records(real)] == ["new"]


def test_repeated_ids_say_which_line_took_its_line_number(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    unnamed = json.dumps({"prompt_token_ids": [5, 6]}).encode()
    named = [json.dumps({"id": i, "prompt_token_ids": [7, 8]}).encode() for i in ("1", "x", "x")]
    src = write_lines(tmp_path / "in.jsonl", [unnamed, *named, unnamed.replace(b"{", b'{"id":4,')])
    out = tmp_path / "out.jsonl"
    assert CliRunner().invoke(main, gen_args(src, out, tiny_llama_dir)).exit_code == 1
    errors = {r["line"]: r["error"] for r in records(out) if "error" in r}
    assert (
        errors[2] == "line 2: id '1' repeats line 1 (which has no id, so its line number is its id)"
    )
    assert errors[4] == "line 4: id 'x' repeats line 3"
    assert sorted(r["id"] for r in records(out) if "error" not in r) == ["1", "4", "x"]
    write_lines(src, [unnamed.replace(b"{", b'{"id":"2",'), unnamed])
    assert CliRunner().invoke(main, gen_args(src, out, tiny_llama_dir, "--overwrite")).exit_code
    assert ["this line has no id" in r["error"] for r in records(out) if "error" in r] == [True]


def test_speculative_tokens_give_the_same_answers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--speculative-tokens: the same greedy tokens, and the summary says how many guesses
    were kept."""
    looping = [json.dumps({"id": "loop", "prompt_token_ids": [7, 8, 9] * 8}).encode()]
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in range(3)] + looping)
    plain, spec = tmp_path / "plain.jsonl", tmp_path / "spec.jsonl"
    args = ["generate", str(src), "--model", str(tiny_llama_dir), "--max-tokens", "20"]
    assert CliRunner().invoke(main, [*args, "-o", str(plain)]).exit_code == 0
    result = CliRunner().invoke(main, [*args, "-o", str(spec), "--speculative-tokens", "4"])
    assert result.exit_code == 0, result.output
    answers = {r["id"]: r["token_ids"] for r in records(plain)}
    assert {r["id"]: r["token_ids"] for r in records(spec)} == answers
    assert "guessed tokens kept" in result.output


def test_json_schema_holds_every_answer(default_model_dir: Path, tmp_path: Path) -> None:
    """--json-schema: every answer that ends is a JSON value of the schema; a line's own
    structured_outputs wins; a schema that is not JSON, or does not compile, stops the run
    once, before any line."""
    schema = tmp_path / "schema.json"
    answer = {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}
    schema.write_text(json.dumps(answer))
    own = {"id": "own", "prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}}
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": q}]}).encode()
            for i, q in enumerate(["Is fire hot?", "Is ice hot?", "Is the sea wet?"])
        ]
        + [json.dumps(own).encode()],
    )
    out = tmp_path / "out.jsonl"
    args = ["generate", str(src), "--model", str(default_model_dir), "--max-tokens", "24"]
    result = CliRunner().invoke(main, [*args, "-o", str(out), "--json-schema", str(schema)])
    assert result.exit_code == 0, result.output
    answers = {r["id"]: r for r in records(out)}
    assert answers["own"]["text"] in ("yes", "no")
    for rid in ("r0", "r1", "r2"):
        assert answers[rid]["finish_reason"] == "stop", answers[rid]
        assert isinstance(json.loads(answers[rid]["text"])["yes"], bool)
    schema.write_text("{not json")
    bad = CliRunner().invoke(
        main, [*args, "-o", str(tmp_path / "b.jsonl"), "--json-schema", str(schema)]
    )
    assert bad.exit_code == 2 and "--json-schema" in bad.output
    schema.write_text(json.dumps({"type": "object", "properties": 5}))
    bad = CliRunner().invoke(
        main, [*args, "-o", str(tmp_path / "c.jsonl"), "--json-schema", str(schema)]
    )
    assert bad.exit_code == 1 and "does not compile" in bad.output
    assert not (tmp_path / "c.jsonl").exists() or not records(tmp_path / "c.jsonl")


def test_beam_width_writes_each_lines_best_answers(
    tiny_llama_tok_dir: Path, tmp_path: Path
) -> None:
    """--beam-width: each good line's answers by beam search, best first under "beams", the
    same as LLM.beam_search gives; a bad line fails alone; sampling flags are refused."""
    lines = [
        json.dumps({"id": "text", "prompt": "Hello"}).encode(),
        json.dumps({"id": "ids", "prompt_token_ids": [5, 6, 7], "max_tokens": 4}).encode(),
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        json.dumps({"id": "bad", "prompt_token_ids": [100000]}).encode(),
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    args = ["generate", str(src), "--model", str(tiny_llama_tok_dir), "--max-tokens", "6"]
    result = CliRunner().invoke(main, [*args, "-o", str(out), "--beam-width", "3"])
    assert result.exit_code == 1, result.output  # the bad line
    got = {r["id"]: r for r in records(out)}
    assert "outside the vocabulary" in got["bad"]["error"]
    llm = LLM(str(tiny_llama_tok_dir))
    chat = llm.tokenizer(
        llm.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False
    ).input_ids
    hello = llm.tokenizer("Hello").input_ids
    for rid, prompt, max_tokens in (("text", hello, 6), ("ids", [5, 6, 7], 4), ("chat", chat, 6)):
        want = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=max_tokens))[0]
        assert [b["token_ids"] for b in got[rid]["beams"]] == [s.token_ids for s in want.sequences]
        assert got[rid]["token_ids"] == want.sequences[0].token_ids
        assert got[rid]["prompt_tokens"] == len(prompt)
    bad = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "b.jsonl"), "--beam-width", "2",
                                    "--temperature", "0.5"])  # fmt: skip
    assert bad.exit_code == 2 and "--beam-width" in bad.output


def test_bad_words_hold_for_every_line(default_model_dir: Path, tmp_path: Path) -> None:
    """--bad-word: no answer says the word; a line's own bad_words win; a line that is chat
    with chat_template_kwargs runs like any other."""
    question = {"role": "user", "content": "What is the capital of France?"}
    lines = [
        {"id": "flag", "messages": [question]},
        {"id": "own", "messages": [question], "bad_words": ["Berlin"]},
        {"id": "kw", "messages": [question], "chat_template_kwargs": {"enable_thinking": False}},
    ]
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(line).encode() for line in lines])
    out = tmp_path / "out.jsonl"
    args = ["generate", str(src), "--model", str(default_model_dir), "--max-tokens", "12"]
    result = CliRunner().invoke(main, [*args, "-o", str(out), "--bad-word", "Paris"])
    assert result.exit_code == 0, result.output
    answers = {r["id"]: r["text"] for r in records(out)}
    assert "Paris" not in answers["flag"] and "Paris" not in answers["kw"]
    assert "Paris" in answers["own"]  # its own list replaces the flag's


def test_a_float16_kv_cache_from_the_command_line(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--kv-cache-dtype float16 reaches the engine (the metrics and the report say so), and
    the tiny model's greedy answers stay those of the float32 cache."""
    src = write_lines(tmp_path / "in.jsonl", [good(i, 30) for i in range(3)])
    args = ["generate", str(src), "--model", str(tiny_llama_dir), "--max-tokens", "12"]
    plain, half, metrics = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "m.json"
    assert CliRunner().invoke(main, [*args, "-o", str(plain)]).exit_code == 0
    flags = ["-o", str(half), "--kv-cache-dtype", "float16", "--metrics", str(metrics)]
    result = CliRunner().invoke(main, [*args, *flags])
    assert result.exit_code == 0, result.output
    assert [r["token_ids"] for r in records(half)] == [r["token_ids"] for r in records(plain)]
    assert json.loads(metrics.read_text())["kv_cache_dtype"] == "float16"
    assert "tokens of float16 keys and values" in result.output
    report = CliRunner().invoke(main, ["report", str(metrics)])
    assert "float16 KV cache" in report.output
    bad = CliRunner().invoke(main, [*args, "-o", str(half), "--kv-cache-dtype", "int4"])
    assert bad.exit_code == 2 and "int4" in bad.output


def test_engine_options_reach_the_engine(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--max-num-seqs caps the sequences a step runs and --dtype loads the weights so; the
    greedy answers are those of the defaults (float32 is the tiny model's own dtype), and so
    are the samples that --min-p 1 leaves."""
    src = write_lines(tmp_path / "in.jsonl", [good(i, 20) for i in range(5)])
    args = ["generate", str(src), "--model", str(tiny_llama_dir), "--max-tokens", "6"]
    plain, capped, metrics = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "m.json"
    assert CliRunner().invoke(main, [*args, "-o", str(plain)]).exit_code == 0
    flags = ["--max-num-seqs", "2", "--dtype", "float32", "--metrics", str(metrics)]
    result = CliRunner().invoke(main, [*args, "-o", str(capped), *flags])
    assert result.exit_code == 0, result.output
    assert [r["token_ids"] for r in records(capped)] == [r["token_ids"] for r in records(plain)]
    # --min-p 1 keeps only the likeliest token: sampling at any temperature is then greedy.
    hot = tmp_path / "c.jsonl"
    flags = ["--temperature", "1.5", "--seed", "3", "--min-p", "1"]
    assert CliRunner().invoke(main, [*args, "-o", str(hot), *flags]).exit_code == 0
    assert [r["token_ids"] for r in records(hot)] == [r["token_ids"] for r in records(plain)]
    steps = json.loads(metrics.read_text())["steps"]
    running = [
        sum(s in ("prefill", "cached", "decode") for s in st["states"].values()) for st in steps
    ]
    assert max(running) == 2 and len(steps) > 6  # five requests, two at a time


def test_bad_engine_options_fail_before_the_model_loads(tmp_path: Path) -> None:
    """Each names its option and exits with a usage error; the model path is never read."""
    src = write_lines(tmp_path / "in.jsonl", [good(0)])
    base = ["generate", str(src), "--model", str(tmp_path / "no-such-model")]
    for flags, named in [
        (["--device", "gpu"], "--device"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--block-size", "3"], "--block-size"),
        (["--dtype", "float8"], "--dtype"),
        (["--min-p", "2"], "min_p"),
    ]:
        result = CliRunner().invoke(main, [*base, *flags])
        assert result.exit_code == 2, (flags, result.output)
        assert named in result.output and "no-such-model" not in result.output


def test_a_lines_priority_orders_the_queue(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Under --batching priority with one sequence at a time, lines run by their `priority`
    (lower first; none given is 0), so their records arrive in that order; a priority that is
    not an integer fails its line alone, which keeps its id."""
    given = {"a": 3, "b": None, "c": -1, "d": "high"}
    lines = []
    for i, (rid, priority) in enumerate(given.items()):
        line = json.loads(good(i))
        line["id"] = rid
        if priority is not None:
            line["priority"] = priority
        lines.append(json.dumps(line).encode())
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    args = [*generate_args(src, out, tiny_llama_dir, 2), "--batching", "priority"]
    result = CliRunner().invoke(main, [*args, "--max-num-seqs", "1"])
    assert result.exit_code == 1, result.output
    recs = records(out)
    assert [r["id"] for r in recs if "error" not in r] == ["c", "b", "a"]
    assert [(r["id"], r["error"]) for r in recs if "error" in r] == [
        ("d", "line 4: 'priority' must be an integer")
    ]
