"""Parallel sampling (`SamplingParams.n`): n samples of a prompt come back as one request whose
samples each equal a lone request with the sample's seed, the prompt's full blocks are
computed once, and abort, failure, streaming and the batch file all see one request."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cli import main
from kvcache import LLM, SamplingParams
from runner.report.summary import format_summary

PROMPT = [5 + (i * 7) % 300 for i in range(70)]  # 4 full blocks of 16 and 6 tokens


def test_greedy_samples_all_equal_the_lone_answer(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0]
    fresh = LLM(str(tiny_llama_dir))
    out = fresh.generate([PROMPT], dataclasses.replace(params, n=3))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == alone.token_ids for o in out.outputs)
    assert out.token_ids == alone.token_ids and out.text == alone.text
    # The prompt's 4 full blocks were computed by one sample and found by the other two, which
    # copied 5 of the 6 slots of its partial block: each computes only the last prompt token.
    assert sorted(o.num_cached_tokens for o in out.outputs) == [0, 69, 69]
    assert fresh.stats()["hit_tokens"] == 2 * 69


def test_seeded_samples_equal_lone_requests_with_their_seeds(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=40, ignore_eos=True, logprobs=1)
    outs = llm.generate([PROMPT, [9, 10, 11]], [dataclasses.replace(params, n=4), params])
    group = outs[0]
    assert len(group.outputs) == 4 and len(outs[1].outputs) == 1
    for j, sample in enumerate(group.outputs):
        lone = llm.generate([PROMPT], dataclasses.replace(params, seed=40 + j))[0]
        assert sample.token_ids == lone.token_ids and sample.text == lone.text
        assert sample.logprobs is not None and lone.logprobs is not None
        assert [t.logprob for t in sample.logprobs] == pytest.approx(
            [t.logprob for t in lone.logprobs], abs=1e-5
        )
    assert len({tuple(s.token_ids) for s in group.outputs}) > 1  # the samples differ
    assert group.cumulative_logprob == group.outputs[0].cumulative_logprob


def test_unseeded_samples_differ(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, n=5)
    out = LLM(str(tiny_llama_dir)).generate([PROMPT], params)[0]
    assert [len(s.token_ids) for s in out.outputs] == [12] * 5
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1


def test_abort_stops_every_sample(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, n=3)
    first = llm.add_request(PROMPT, params, request_id="q")
    assert first.request_id == "q#0"
    assert [s.request_id for s in llm.samples_of("q")] == ["q#0", "q#1", "q#2"]
    with pytest.raises(ValueError, match="already running"):
        llm.add_request([5, 6], request_id="q")
    with pytest.raises(ValueError, match="'q#1' is already running"):
        llm.add_request([5, 6], request_id="q#1")
    for taken_n in (1, 2):  # a request or a sample group already named like a sample of p
        llm.add_request([5, 6], dataclasses.replace(params, n=taken_n), request_id="p#1")
        with pytest.raises(ValueError, match=r"'p#1' \(a sample of 'p'\) is already running"):
            llm.add_request([5, 6], params, request_id="p")
        llm.abort_request("p#1")
    for _ in range(4):
        llm.step()
    out = llm.abort_request("q")
    assert out is not None and out.request_id == "q" and len(out.outputs) == 3
    assert {s.finish_reason for s in out.outputs} == {"abort"}
    assert not llm.has_unfinished() and llm.abort_request("q") is None
    assert llm.block_manager.stats.blocks_in_use == 0
    llm.block_manager.check_integrity()
    summary = format_summary(llm.metrics())
    assert "(0 finished, 0 errors, 6 aborted)" in summary  # q: 3 samples; p#1: 1, then 2


def test_a_failed_step_fails_its_samples(tiny_llama_dir: Path, monkeypatch: Any) -> None:
    llm = LLM(str(tiny_llama_dir))
    run = llm.runner.run
    calls = {"n": 0}

    def fail_third(batch: Any) -> Any:  # from the third step on, for sample 1 only
        calls["n"] += 1
        if calls["n"] >= 3 and any(item.seq.sample_index == 1 for item in batch):
            raise RuntimeError("device fell over")
        return run(batch)

    monkeypatch.setattr(llm.runner, "run", fail_third)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2)
    out = llm.generate([PROMPT], params)[0]
    assert out.error is not None and "device fell over" in out.error
    assert [s.finish_reason for s in out.outputs] == ["length", "error"]  # sample 0 goes on
    assert not llm.has_unfinished()
    llm.block_manager.check_integrity()


def test_stream_of_several_samples(tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir))
    params = SamplingParams(max_tokens=15, temperature=1.0, seed=3, n=3, stop=["a"])
    expected = llm.generate(["Hello", "World"], params)
    texts: dict[tuple[int, int], str] = {}
    reasons: dict[tuple[int, int], str] = {}
    outputs = {}
    for delta in llm.stream(["Hello", "World"], params):
        key = (delta.index, delta.sample_index)
        assert key not in reasons, "a delta after its sample finished"
        texts[key] = texts.get(key, "") + delta.text
        if delta.finish_reason is not None:
            reasons[key] = delta.finish_reason
        if delta.output is not None:
            outputs[delta.index] = delta.output
    assert sorted(outputs) == [0, 1] and len(reasons) == 6
    for i, ref in enumerate(expected):
        for j, sample in enumerate(ref.outputs):
            assert texts[(i, j)] == sample.text
            assert reasons[(i, j)] == sample.finish_reason
        assert [s.token_ids for s in outputs[i].outputs] == [s.token_ids for s in ref.outputs]


@pytest.mark.parametrize("value", [0, -1, 1.5, 2000])
def test_bad_n_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=value)  # type: ignore[arg-type]


def test_batch_file_lists_the_samples(tiny_llama_dir: Path, tmp_path: Path) -> None:
    lines = [
        {"id": "many", "prompt_token_ids": PROMPT, "n": 3, "temperature": 0.8, "seed": 1},
        {"id": "one", "prompt_token_ids": [5, 6, 7]},
        {"id": "bad", "prompt_token_ids": [5, 6, 7], "n": 0},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_dir)]
    result = CliRunner().invoke(main, [*args, "--max-tokens", "5"])
    assert result.exit_code == 1, result.output
    by_id = {r["id"]: r for r in (json.loads(x) for x in out.read_text().splitlines())}
    assert "n must be >= 1" in by_id["bad"]["error"]
    assert "outputs" not in by_id["one"]
    samples = by_id["many"]["outputs"]
    assert [s["index"] for s in samples] == [0, 1, 2]
    total = sum(s["output_tokens"] for s in samples) + by_id["one"]["output_tokens"]
    assert f"output tokens: {total} " in result.output  # every sample counts
    assert samples[0]["token_ids"] == by_id["many"]["token_ids"]
    lone = LLM(str(tiny_llama_dir)).generate(
        [PROMPT], SamplingParams(max_tokens=5, temperature=0.8, seed=2)
    )[0]
    assert samples[1]["token_ids"] == lone.token_ids


def test_printed_results_show_each_sample(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "q", "prompt_token_ids": [5, 6, 7]}) + "\n")
    args = ["generate", str(src), "--model", str(tiny_llama_dir), "--max-tokens", "3"]
    result = CliRunner().invoke(main, [*args, "--n", "2", "--temperature", "1.0", "--seed", "4"])
    assert result.exit_code == 0, result.output
    assert "[q#0] (length)" in result.output and "[q#1] (length)" in result.output


def test_static_batch_preempted_to_empty_admits_the_next(tiny_llama_dir: Path) -> None:
    """Samples of one static batch computing the same prompt pin each other's cached blocks
    and can run the pool short: the batch is preempted, released, and the next one admitted
    in the same step, instead of the step finding nothing to run."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, block_size=4, batching="static")
    base = list(range(10, 22))
    outs = llm.generate(
        [base, base[:6]],
        [
            SamplingParams(max_tokens=18, n=3, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=13, temperature=1, seed=1, ignore_eos=True),
        ],
    )
    assert [len(s.token_ids) for s in outs[0].outputs] == [18, 18, 18]
    assert len(outs[1].token_ids) == 13
    llm.block_manager.check_integrity()
