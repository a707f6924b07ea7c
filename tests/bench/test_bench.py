"""`kvcache bench` end to end on a tiny model: every column is filled from a real run, the
engine's greedy outputs are checked against transformers', and the decode share outside the
matrix products comes from timing the products themselves."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench.harness import run_bench
from bench.matmul_timer import MatmulTimer
from bench.peers import Sampling
from runner.backends.cpu.loader import load_cpu_kernels


@pytest.mark.parametrize("prepack", [True, False], ids=["packed", "unpacked"])
def test_bench_rows_on_a_tiny_model(tiny_llama_tok_dir: Path, prepack: bool) -> None:
    result = run_bench(
        "mixed_lengths",
        ["engine", "engine-nocache", "hf-static"],
        model=str(tiny_llama_tok_dir),
        max_tokens=6,
        limit=4,
        engine_options={"prepack_weights": prepack},
    )
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"engine", "engine-nocache", "hf-static"}
    for name in ("engine", "engine-nocache"):
        row = rows[name]
        assert row["matches_reference"] is True
        assert row["output_tokens"] == 4 * 6  # mixed_lengths ignores EOS
        assert 0.0 < row["decode_outside_matmul"] < 1.0
        assert row["prefill_mfu"] > 0
        # The engine's own timings of each request: its first token and the gaps after it.
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
    assert rows["hf-static"]["vs_hf_static"] == pytest.approx(1.0)
    assert "decode outside matmul" in result["table"].splitlines()[0]


def test_bench_beam_search_matches_the_reference(tiny_llama_tok_dir: Path) -> None:
    """--beam-width: the engine's beam search and transformers' batched num_beams give the
    best beam of transformers' unbatched beam search; samplers and hf-cb are refused."""
    result = run_bench(
        "sample",
        ["engine", "hf-static"],
        model=str(tiny_llama_tok_dir),
        max_tokens=6,
        limit=3,
        engine_options={"block_size": 4},
        beam_width=3,
    )
    rows = {r["system"]: r for r in result["rows"]}
    assert rows["engine"]["matches_reference"] is True
    assert rows["hf-static"]["matches_reference"] is True
    # A beam's prompt is its parent's plus one token: with the parent's partial last block
    # copied, blocks of 4 compute one token a beam a step, as blocks of 1 do.
    whole = run_bench(
        "sample",
        ["engine"],
        model=str(tiny_llama_tok_dir),
        max_tokens=6,
        limit=3,
        check=False,
        engine_options={"block_size": 1},
        beam_width=3,
    )
    assert rows["engine"]["prefill_tokens"] == whole["rows"][0]["prefill_tokens"]
    assert "searched 3 beams" in result["table"]
    with pytest.raises(ValueError, match="beam search is greedy"):
        run_bench("sample", ["hf-cb"], model=str(tiny_llama_tok_dir), limit=1, beam_width=2)


def test_bench_speculative_systems_match_the_reference(
    make_tiny_model: Callable[..., Path],
) -> None:
    """engine-spec and transformers' prompt lookup (hf-lookup) on the rewrite workload: both
    give greedy decoding's tokens; a sampled run refuses hf-lookup by name."""
    path = make_tiny_model("llama", tokenizer=True, max_position_embeddings=1024)
    result = run_bench(
        "rewrite",
        ["engine-spec", "hf-lookup"],
        model=str(path),
        max_tokens=12,
        limit=3,
    )
    rows = {r["system"]: r for r in result["rows"]}
    assert rows["engine-spec"]["matches_reference"] is True
    assert rows["hf-lookup"]["matches_reference"] is True
    with pytest.raises(ValueError, match="hf-lookup"):
        run_bench(
            "rewrite",
            ["hf-lookup"],
            model=str(path),
            limit=1,
            sampling=Sampling(temperature=0.8, top_p=1.0),
        )


@pytest.mark.parametrize(
    "options",
    [{"cpu_kernels": False}, {"prepack_weights": False}, {}],
    ids=["packed-modules", "unpacked-tied-head", "layers-in-c"],
)
def test_matmul_timer_times_every_product_and_detaches(
    tiny_llama_dir: Path, options: dict[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcache import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), **options)
    model, layers = llm.forward_parts().model, llm.forward_parts().cpu_layers
    in_c = layers is not None
    assert in_c == (not options and load_cpu_kernels() is not None)
    stops: list[int] = []
    original = MatmulTimer._stop

    def counted_stop(self: MatmulTimer, *args: object) -> None:
        stops.append(1)
        original(self)

    monkeypatch.setattr(MatmulTimer, "_stop", counted_stop)
    timer = MatmulTimer(model, layers)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([[5, 6, 7]], greedy)  # two forward passes: the prompt, then one decode
    # qkv, o, gate/up, down through hooks, unless the layers ran in C (timed there); the head
    products_per_pass = (0 if in_c else 4 * model.num_layers) + 1
    assert len(stops) == 2 * products_per_pass and timer.total_s > 0
    if in_c:
        assert timer.total_s > timer._hooked_s  # the C products' time is in the total
    timer.close()
    llm.generate([[5, 6, 7]], greedy)
    assert len(stops) == 2 * products_per_pass  # closed: no hook left behind
    assert "compute_logits" not in vars(model)


def test_bench_can_sample_in_every_system(tiny_llama_tok_dir: Path) -> None:
    """With a temperature the engine samples (seeded per request: a rerun repeats itself, and it
    differs from greedy), the transformers peers sample with their top-k off, and nothing is
    checked against the greedy reference (hf-cb takes the same options as hf-static)."""
    from bench.harness import run_engine
    from bench.peers import Sampling, hf_sampling
    from bench.workloads import load_workload
    from kvcache import LLM

    sampling = Sampling(1.5, 0.95)
    assert hf_sampling(sampling) == {
        "do_sample": True,
        "temperature": 1.5,
        "top_p": 0.95,
        "top_k": 0,
    }
    assert hf_sampling(None) == {"do_sample": False}
    requests = load_workload("mixed_lengths", LLM(str(tiny_llama_tok_dir)).tokenizer, 6, 4)
    model = str(tiny_llama_tok_dir)
    greedy = run_engine(model, requests, "cpu", {})[0].outputs
    sampled = [run_engine(model, requests, "cpu", {}, sampling)[0].outputs for _ in range(2)]
    assert sampled[0] == sampled[1] != greedy
    result = run_bench(
        "mixed_lengths",
        ["engine", "engine-spec", "engine-nocache", "hf-static"],
        model=model,
        max_tokens=6,
        limit=4,
        sampling=sampling,
    )
    assert all(row["matches_reference"] is None for row in result["rows"])
    assert all(row["output_tokens"] == 4 * 6 for row in result["rows"])  # ignore_eos workload
    assert "every system sampled: temperature 1.5, top_p 0.95" in result["table"]
    # Guesses and the cache change no draw (only rounding could, rarely).
    assert (
        "answers sampled exactly as engine's: engine-spec 4 of 4, engine-nocache 4 of 4"
        in (result["table"])
    )


def test_bench_with_several_samples_a_prompt(tiny_llama_tok_dir: Path) -> None:
    """--n: every system produces n samples of each prompt; the engine computes each prompt's
    full blocks once, transformers' static batch runs every copy of the prompt."""
    from bench.peers import Sampling

    result = run_bench(
        "mixed_lengths",
        ["engine", "hf-static"],  # hf-cb takes n copies of each request (20 s on this CPU)
        model=str(tiny_llama_tok_dir),
        max_tokens=4,
        limit=3,
        sampling=Sampling(1.0, 1.0, n=4),
    )
    rows = {row["system"]: row for row in result["rows"]}
    assert all(row["output_tokens"] == 3 * 4 * 4 for row in rows.values())  # ignore_eos
    assert rows["engine"]["hit_rate"] > 0.5  # three of four samples find the prompt cached
    assert rows["hf-static"]["prefill_tokens"] > 3 * rows["engine"]["prefill_tokens"]
    assert "4 samples a prompt" in result["table"]
