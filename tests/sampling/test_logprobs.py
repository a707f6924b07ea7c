"""Log-probabilities: each generated token's, and the N likeliest, equal the log-softmax of
transformers' own logits over the same tokens, whatever the sampling settings, batch or cache,
and reach the batch file's records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from greedy_reference import make_prompts
from transformers import AutoModelForCausalLM

from cli import main
from kvcache import LLM, SamplingParams

TOLERANCE = 1e-4  # float order differs between the engine's kernels and transformers'


def model_logprobs(hf: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: the model's log-softmax before each output token."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def check_against_model(hf: Any, prompt: list[int], out: Any, n: int) -> None:
    reference = model_logprobs(hf, prompt, out.token_ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for step, (token, got) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = reference[step]
        assert got.logprob == pytest.approx(float(row[token]), abs=TOLERANCE)
        assert len(got.top) == n
        values = [lp for _, lp in got.top]
        assert values == sorted(values, reverse=True)
        expected = torch.topk(row, n).values.tolist() if n else []
        assert values == pytest.approx(expected, abs=TOLERANCE)
        for token_id, lp in got.top:  # each pair is that token's own figure
            assert lp == pytest.approx(float(row[token_id]), abs=TOLERANCE)
    total = sum(float(reference[i, t]) for i, t in enumerate(out.token_ids))
    assert out.cumulative_logprob == pytest.approx(total, abs=TOLERANCE * len(out.token_ids))


@pytest.mark.parametrize(
    "options",
    [{}, {"enable_prefix_caching": False}, {"num_kv_blocks": 40, "block_size": 4}],
    ids=["cache-on", "cache-off", "tiny-pool"],
)
@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_logprobs_equal_the_models(
    model_dir: str, options: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size, seed=11)
    # Greedy, sampled, penalized and no-logprobs requests share the batch; the figures are the
    # model's own distribution whatever picked the token.
    kinds = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=8, temperature=1.2, seed=3, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, top_k=5, repetition_penalty=1.4, logprobs=20),
    ]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    outs = LLM(str(path), **options).generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        if sp.logprobs is None:
            assert out.logprobs is None and out.cumulative_logprob is None
        else:
            check_against_model(hf, prompt, out, sp.logprobs)


def test_greedy_token_is_the_top_logprob(tiny_qwen3_dir: Path) -> None:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    out = LLM(str(tiny_qwen3_dir)).generate([[4, 5, 6, 7, 8]], params)[0]
    assert out.logprobs is not None
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.top[0][0] == token and lp.top[0][1] == lp.logprob


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_bad_logprobs_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_batch_file_writes_logprobs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    lines = [
        {"id": "a", "prompt_token_ids": [5, 6, 7], "logprobs": 2},
        {"id": "b", "prompt_token_ids": [5, 6, 8]},
        {"id": "bad", "prompt_token_ids": [5, 6, 9], "presence_penalty": 3},
        {"id": "c", "prompt_token_ids": [5, 6, 9], "frequency_penalty": 0.5, "logprobs": 0},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_dir)]
    result = CliRunner().invoke(main, [*args, "--max-tokens", "4", "--repetition-penalty", "1.2"])
    assert result.exit_code == 1, result.output  # one line failed, the others ran
    by_id = {r["id"]: r for r in (json.loads(x) for x in out.read_text().splitlines())}
    assert "presence_penalty must be in [-2, 2]" in by_id["bad"]["error"]
    assert "logprobs" not in by_id["b"]
    for rid, n in (("a", 2), ("c", 0)):
        record = by_id[rid]
        assert [e["token_id"] for e in record["logprobs"]] == record["token_ids"]
        for entry in record["logprobs"]:
            assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == n
            assert all(isinstance(t, int) and lp <= 0 for t, lp in entry["top_logprobs"])
    # The default penalty reached the lines: the same prompt without it can differ, but with it
    # must equal the Python API's answer.
    llm = LLM(str(tiny_llama_dir))
    expected = llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, repetition_penalty=1.2)
    )
    assert by_id["a"]["token_ids"] == expected[0].token_ids


def model_prompt_logprobs(hf: Any, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: the model's log-softmax before each prompt token after the
    first."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 7},  # the prompt in chunks, some of them one token long
        {"num_kv_blocks": 40, "block_size": 4},  # preempted and recomputed
        {"cpu_kernels": False},
    ],
    ids=["whole", "chunks", "tiny-pool", "torch-ops"],
)
def test_prompt_logprobs_equal_the_models(tiny_llama_dir: Path, options: dict[str, Any]) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size, seed=12)
    llm = LLM(str(tiny_llama_dir), **options)
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0))  # their prefixes cached
    params = [
        SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3),
        SamplingParams(max_tokens=4, temperature=0),
        SamplingParams(max_tokens=4, temperature=0.9, seed=1, prompt_logprobs=0, n=2),
    ]
    asked = [params[i % 3] for i in range(len(prompts))]
    outs = llm.generate(prompts, asked)
    for prompt, sp, out in zip(prompts, asked, outs, strict=True):
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        # Computed whole, though the prefix is cached: every position has its figures.
        assert out.num_cached_tokens == 0
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        reference = model_prompt_logprobs(hf, prompt)
        for position in range(1, len(prompt)):
            entry, row = got[position], reference[position - 1]
            assert entry is not None
            assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=TOLERANCE)
            expected = torch.topk(row, sp.prompt_logprobs).values.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(expected, abs=TOLERANCE)


def test_batch_file_writes_prompt_logprobs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "s", "prompt_token_ids": [5, 6, 7, 8], "prompt_logprobs": 1}))
    out = tmp_path / "out.jsonl"
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_llama_dir)]
    assert CliRunner().invoke(main, [*args, "--max-tokens", "2"]).exit_code == 0
    record = json.loads(out.read_text())
    entries = record["prompt_logprobs"]
    assert entries[0] is None and [e["token_id"] for e in entries[1:]] == [6, 7, 8]
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 1 for e in entries[1:])


def test_prompt_logprobs_of_several_samples_compute_the_prompt_once(tiny_llama_dir: Path) -> None:
    """Sample 0 computes every prompt position (and fills the cache); the other samples reuse
    its full blocks and copy its partial one; the request's prompt_logprobs are sample 0's."""
    prompt = list(range(5, 5 + 70))
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=2, prompt_logprobs=1, n=3)
    out = LLM(str(tiny_llama_dir)).generate([prompt], params)[0]
    assert [s.num_cached_tokens for s in out.outputs] == [0, 69, 69]
    assert out.prompt_logprobs is not None and all(x is not None for x in out.prompt_logprobs[1:])


def test_no_salt_reaches_a_prompt_logprob_request(tiny_llama_dir: Path) -> None:
    """Whatever a cache holds (any salt, a loaded file), such a prompt is computed whole."""
    prompt = list(range(5, 5 + 49))
    llm = LLM(str(tiny_llama_dir))
    for salt in (None, "prompt-logprobs/1", "prompt-logprobs/0"):
        llm.generate([prompt], SamplingParams(max_tokens=1), cache_salt=salt)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs is not None and all(x is not None for x in out.prompt_logprobs[1:])


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_prompt_logprobs_fill_a_small_pool_without_preempting(
    tiny_llama_dir: Path, batching: str
) -> None:
    """A prompt-logprobs request whose prefix is cached takes only its own blocks: in a pool
    just big enough for it, it finishes without preemption, and the engine goes on."""
    prompt = list(range(5, 45))  # 40 tokens + 8 new = 48 = the whole pool of 12 x 4
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=12, block_size=4, batching=batching)
    llm.generate([prompt[:8]], SamplingParams(max_tokens=1))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([prompt], params)[0]
    assert len(out.token_ids) == 8 and llm.scheduler.num_preemptions == 0
    assert out.prompt_logprobs is not None and None not in out.prompt_logprobs[1:]
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].token_ids) >= 1
    llm.block_manager.check_integrity()
