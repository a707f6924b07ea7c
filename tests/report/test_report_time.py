"""Where the time went: steps grouped by kind with the shares of their wall time that the
model, its products and its attention took, each step's split for the HTML page
(runner/report/time_split.py), and a real CPU run recording them
(runner/engine/step/metrics.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcache import LLM, SamplingParams
from runner.backends.cpu.loader import load_cpu_kernels
from runner.report.html import render_html
from runner.report.summary import format_summary
from runner.report.time_split import TimeRow, step_parts_ms, time_breakdown, time_cells

# The C layers time their products and attention apart; torch's operators cannot.
needs_cpu_kernels = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels cannot be built on this machine"
)


def step(prefill: int, decode: int, wall: float, **timing: float | None) -> dict[str, Any]:
    return {
        "num_prefill_tokens": prefill,
        "num_decode_tokens": decode,
        "duration_s": wall,
        **timing,
    }


def test_steps_are_grouped_by_kind_and_shared_out() -> None:
    steps = [
        step(64, 0, 0.4, model_s=0.36, product_s=0.3, attention_s=0.04),
        step(0, 4, 0.1, model_s=0.08, product_s=0.05, attention_s=0.02),
        step(0, 4, 0.1, model_s=0.09, product_s=0.06, attention_s=0.01),
        step(0, 0, 0.5),  # an empty step computes nothing: not counted
        step(8, 3, 0.2, model_s=0.2, product_s=None, attention_s=None),  # torch's operators
    ]
    rows = time_breakdown(steps)
    assert [r.kind for r in rows] == ["prefill only", "decode only", "prefill + decode"]
    assert [r.steps for r in rows] == [1, 2, 1]
    decode = rows[1]
    assert decode.wall_s == pytest.approx(0.2)
    assert (decode.model, decode.products, decode.attention) == pytest.approx((0.85, 0.55, 0.15))
    assert rows[2].products is None and rows[2].model == pytest.approx(1.0)
    assert time_cells(decode) == ("decode only", "2", "0.20", "100.0", "85%", "55%", "15%", "15%")
    assert time_cells(rows[2])[5:] == ("-", "-", "0%")


def test_a_file_without_timings_shows_dashes() -> None:
    """Metrics written before the timings existed (or on a GPU) still report, without shares."""
    rows = time_breakdown([step(0, 2, 0.05), step(0, 2, 0.05, model_s=0.04)])
    assert rows == [TimeRow("decode only", 2, pytest.approx(0.1), None, None, None)]
    assert time_cells(rows[0])[4:] == ("-", "-", "-", "-")


@needs_cpu_kernels
def test_a_cpu_run_records_where_its_steps_went(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    prompts = [[3 + (i * 7 + k) % 200 for k in range(40)] for i in range(3)]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    steps = llm.recorder.steps
    assert llm.cpu_layers is not None and len(steps) >= 6
    for s in steps:
        assert 0 < s["attention_s"] < s["model_s"] <= s["duration_s"]
        assert 0 < s["product_s"] < s["model_s"]
        assert s["product_s"] + s["attention_s"] < s["model_s"]
    text = format_summary(llm.metrics())
    assert "Where the time went" in text and "decode only" in text


def test_torch_operators_record_only_the_model(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), cpu_kernels=False)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    for s in llm.recorder.steps:
        assert 0 < s["model_s"] <= s["duration_s"]
        assert s["product_s"] is None and s["attention_s"] is None


def test_each_step_splits_into_four_parts() -> None:
    steps = [
        step(64, 0, 0.4, model_s=0.36, product_s=0.3, attention_s=0.04),
        step(0, 0, 0.01),  # computed nothing: all host
        step(0, 4, 0.1, model_s=0.08, product_s=0.05, attention_s=0.02),
    ]
    parts = step_parts_ms(steps)
    assert parts is not None and parts.shape == (4, 3)
    assert parts[:, 0] == pytest.approx([300, 40, 20, 40])
    assert parts[:, 1] == pytest.approx([0, 0, 0, 10])
    assert parts.sum(axis=0) == pytest.approx([400, 10, 100])  # each step's whole wall time
    steps.append(step(0, 4, 0.1, model_s=0.08))  # one step without the split: no picture
    assert step_parts_ms(steps) is None


@needs_cpu_kernels
def test_the_html_page_shows_where_the_time_went(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    llm.generate([[5, 6, 7, 8] * 5], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    page = render_html(llm.metrics())
    assert "<h2>Where the time went</h2>" in page and 'alt="Step time"' in page
    metrics = llm.metrics()  # as a file written before the timings existed
    for row in metrics["steps"]:
        for key in ("model_s", "product_s", "attention_s"):
            del row[key]
    untimed = render_html(metrics)
    assert "<h2>Where the time went</h2>" in untimed and 'alt="Step time"' not in untimed
