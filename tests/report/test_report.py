"""Reports from a metrics dict: numbers by hand, the HTML page, and bad files.

`simulate` builds a plausible metrics dict (a toy scheduler over 12 requests) so the
pictures have something realistic to draw; `PYTHONPATH=. python tests/report/test_report.py [DIR]`
rewrites tests/fixtures/metrics_*.json from it and, given DIR, the HTML pages to look at.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from runner.report.html import render_html, state_matrix, write_html
from runner.report.summary import (
    format_summary,
    load_metrics,
    percentile,
    prefill_tokens,
    prefix_breakdown,
    summary_rows,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _req(rid: str, prompt: int, cached: int, out: int, ttft: float | None, itl: list[float],
         key: str, preview: str = "p") -> dict[str, Any]:  # fmt: skip
    return {"id": rid, "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": out,
            "arrival_time_s": 0.0, "first_token_time_s": ttft, "finish_time_s": 1.0,
            "ttft_s": ttft, "itl_s": itl, "finish_reason": "length", "num_preemptions": 0,
            "prefix_key": key, "prefix_preview": preview}  # fmt: skip


def hand_metrics() -> dict[str, Any]:
    reqs = [
        _req("a0", 100, 0, 4, 0.010, [0.001, 0.002, 0.003], "aa", "system A"),
        _req("a1", 100, 96, 4, 0.020, [0.004], "aa", "system A"),
        _req("a2", 120, 96, 4, 0.030, [], "aa", "system A"),
        _req("b0", 50, 48, 4, 0.040, [0.005], "bb", "system B"),
        _req("c0", 10, 0, 4, None, [], "", "short"),
    ]
    steps = [
        {"step": i, "t_start_s": i * 0.1, "duration_s": 0.1, "num_prefill_tokens": p,
         "num_decode_tokens": d, "num_cached_tokens": 0, "hit_tokens_cum": h,
         "query_tokens_cum": q, "states": s}
        for i, (p, d, h, q, s) in enumerate([
            (100, 0, 0, 100, {"0": "prefill", "1": "waiting"}),
            (4, 1, 96, 200, {"0": "decode", "1": "cached", "2": "waiting"}),
            (16, 2, 240, 380, {"0": "decode", "1": "decode", "2": "prefill", "4": "held"}),
        ])
    ]  # fmt: skip
    cache = {"query_tokens": 380, "hit_tokens": 240, "readmit_query_tokens": 0,
             "readmit_hit_tokens": 0, "evicted_blocks": 3, "blocks_in_use": 10,
             "blocks_cached": 5, "blocks_free": 49, "hit_rate": 0.0}  # fmt: skip
    return {"version": 1, "model": "toy", "batching": "continuous", "enable_prefix_caching": True,
            "block_size": 16, "num_kv_blocks": 64, "max_num_batched_tokens": 128,
            "wall_time_s": 2.0, "cache": cache, "num_preemptions": 1, "requests": reqs,
            "steps": steps}  # fmt: skip


PREVIEWS = {
    "sysA": "You are a precise assistant for Python's regular expression",
    "sysB": "Name the Python standard-library function that each docstring",
}


def _admit(r: dict[str, Any], shared: dict[str, int], committed: set[str],
           cache: dict[str, int]) -> str:  # fmt: skip
    need = r["prompt"] + r["out"]  # a readmission recomputes the answer so far
    hit = shared[r["group"]] // 16 * 16 if r["group"] in committed else 0
    kind = "readmit_" if r["preempt"] else ""  # the engine counts readmissions apart
    cache[kind + "query_tokens"] += need
    cache[kind + "hit_tokens"] += hit
    r["cached"] = r["cached"] or hit
    r["done"], r["need"] = hit, need
    return "cached" if hit else "prefill"


def simulate(batching: str, seed: int = 0) -> dict[str, Any]:
    """A toy run: 12 requests, 3 shared prefixes, chunked prefill, one preemption.

    Plausible numbers for pictures and shape checks, not a model of the real scheduler.
    """
    rng = random.Random(seed)
    budget, max_running = 128, 4
    shared = {"sysA": 160, "sysB": 96, "own0": 0, "own1": 0}
    groups = ["sysA"] * 6 + ["sysB"] * 4 + ["own0", "own1"]
    rng.shuffle(groups)
    reqs: list[dict[str, Any]] = [
        {"group": g, "prompt": shared[g] + rng.randint(12, 60), "out_len": rng.randint(4, 24),
         "arrive": 2 * i, "back_at": 0, "cached": 0, "done": 0, "need": 0, "out": 0,
         "times": [], "preempt": 0}
        for i, g in enumerate(groups)
    ]  # fmt: skip
    keys = ["query_tokens", "hit_tokens", "readmit_query_tokens", "readmit_hit_tokens"]
    cache: dict[str, Any] = dict.fromkeys(keys, 0)
    committed: set[str] = set()
    waiting, t = list(range(len(reqs))), 0.0
    running: list[int] = []
    steps: list[dict[str, Any]] = []
    for step in range(1000):
        if not waiting and not running:
            break
        arrived = [i for i in waiting if reqs[i]["arrive"] <= step]
        states = {str(i): "preempted" if reqs[i]["preempt"] else "waiting" for i in arrived}
        # Static batching admits only into an empty batch; continuous whenever a slot frees.
        may_admit = batching == "continuous" or not running
        for i in [i for i in arrived if reqs[i]["back_at"] <= step]:
            if not may_admit or len(running) >= max_running:
                break
            states[str(i)] = _admit(reqs[i], shared, committed, cache)
            waiting.remove(i)
            running.append(i)
        decoding = [i for i in running if reqs[i]["need"] <= reqs[i]["done"]]
        decoding = [i for i in decoding if reqs[i]["out"] < reqs[i]["out_len"]]
        states.update({str(i): "decode" for i in decoding})
        left, n_pre = budget - len(decoding), 0  # decodes first, prefill chunks take the rest
        for i in running:
            r = reqs[i]
            if r["done"] < r["need"] and left > 0:
                chunk = min(left, r["need"] - r["done"])
                r["done"], left, n_pre = r["done"] + chunk, left - chunk, n_pre + chunk
                states.setdefault(str(i), "prefill")  # stays "cached" on its admission step
        dur = 0.004 + 0.00003 * n_pre + 0.0006 * len(running)
        for i in running:
            r = reqs[i]
            if str(i) in states and r["done"] >= r["need"] and r["out"] < r["out_len"]:
                r["out"] += 1
                r["times"].append(t + dur)
                committed.add(r["group"])  # its prompt blocks are in the tree now
        for i in running:  # static: finished but still in the batch; else: no budget left
            states.setdefault(str(i), "held" if reqs[i]["out"] >= reqs[i]["out_len"] else "waiting")
        if batching == "continuous" and step == 14:  # memory pressure: preempt the newest
            victim = running.pop()
            reqs[victim]["preempt"] += 1
            reqs[victim]["back_at"] = step + 4
            waiting.insert(0, victim)
            states[str(victim)] = "preempted"
        if batching == "continuous" or all(reqs[i]["out"] >= reqs[i]["out_len"] for i in running):
            running = [i for i in running if reqs[i]["out"] < reqs[i]["out_len"]]
        steps.append(
            {"step": step, "t_start_s": round(t, 6), "duration_s": round(dur, 6),
             "num_prefill_tokens": n_pre, "num_decode_tokens": len(decoding),
             "num_cached_tokens": 0, "hit_tokens_cum": cache["hit_tokens"],
             "query_tokens_cum": cache["query_tokens"], "states": states}
        )  # fmt: skip
        t += dur
    out = []
    for i, r in enumerate(reqs):
        arrival, ts = steps[r["arrive"]]["t_start_s"], r["times"]
        # Unshared prompts still have a first block of their own: one key per request.
        key = r["group"] if r["group"] in PREVIEWS else f"{r['group']}-{i}"
        out.append(
            {"id": f"req-{i:02d}", "prompt_tokens": r["prompt"], "cached_tokens": r["cached"],
             "output_tokens": r["out"], "arrival_time_s": arrival, "first_token_time_s": ts[0],
             "finish_time_s": ts[-1], "ttft_s": ts[0] - arrival,
             "itl_s": [b - a for a, b in zip(ts, ts[1:], strict=False)],
             "finish_reason": "length", "num_preemptions": r["preempt"],
             "prefix_key": hashlib.sha1(key.encode()).hexdigest()[:16],
             "prefix_preview": PREVIEWS.get(r["group"], f"Short question number {i}")}
        )  # fmt: skip
    cache.update(evicted_blocks=0, blocks_in_use=0, blocks_cached=20, blocks_free=44)
    cache["hit_rate"] = cache["hit_tokens"] / cache["query_tokens"]
    return {"version": 1, "model": "SmolLM2-135M-Instruct", "batching": batching,
            "enable_prefix_caching": True, "block_size": 16, "num_kv_blocks": 64,
            "max_num_batched_tokens": budget, "wall_time_s": round(t, 6), "cache": cache,
            "num_preemptions": sum(r["preempt"] for r in reqs), "requests": out,
            "steps": steps}  # fmt: skip


def test_summary_numbers() -> None:
    m = hand_metrics()
    rows = dict(summary_rows(m))
    assert rows["cache hit rate"].startswith("63.2%")  # 240 / 380, not the stored 0.0
    assert "copied" not in rows["cache hit rate"]
    m["cache"]["copied_tokens"] = 17
    assert dict(summary_rows(m))["cache hit rate"].endswith("; 17 copied from partial blocks)")
    assert rows["prompt tokens"] == "380" and rows["cached prompt tokens"] == "240"
    assert prefill_tokens(m) == (120, 360)  # computed + served by the cache
    assert rows["evicted blocks"] == "3" and rows["preemptions"] == "1"
    assert rows["throughput"] == "10.0 output tok/s, 2.50 req/s"
    # TTFT over the 4 requests with a first token: 10, 20, 30, 40 ms.
    assert rows["TTFT p50 / p90 / p99"] == "25.0 / 37.0 / 39.7 ms"
    assert rows["inter-token p50 / p90 / p99"] == "3.0 / 4.6 / 5.0 ms"
    text = format_summary(m)
    assert "continuous batching" in text and "toy" in text and "3 groups" in text
    assert "weights" not in text.splitlines()[0]  # float32, the checkpoint's own model
    assert "int8 weights" in format_summary({**m, "cpu_weight_dtype": "int8"}).splitlines()[0]
    assert "guessed tokens kept" not in rows  # speculative decoding was off
    spec = dict(summary_rows({**m, "num_draft_tokens": 40, "num_accepted_tokens": 30}))
    assert spec["guessed tokens kept"] == "30 of 40 (75.0%)"


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0


def test_prefix_breakdown_groups_and_sorts() -> None:
    groups = prefix_breakdown(hand_metrics())
    assert [(g.prefix_key, g.num_requests, g.prompt_tokens, g.cached_tokens) for g in groups] == [
        ("aa", 3, 320, 192),
        ("bb", 1, 50, 48),
        ("", 1, 10, 0),
    ]
    assert groups[0].hit_rate == pytest.approx(0.6)
    assert "(no full block)" in format_summary(hand_metrics())


def test_state_matrix() -> None:
    grid = state_matrix(hand_metrics())
    assert grid.shape == (5, 3)
    assert list(grid[1]) == [1, 2, 4]  # waiting, cached, decode
    assert grid[3].sum() == 0 and grid[4, 2] == 6  # never present; held


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_html_is_self_contained(tmp_path: Path, batching: str) -> None:
    m = simulate(batching)
    out = tmp_path / "report.html"
    write_html(m, out)
    page = out.read_text(encoding="utf-8")
    assert f"{batching} batching" in page and "SmolLM2-135M-Instruct" in page
    assert page.count('src="data:image/png;base64,') == 3
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page)
    assert "http://" not in page and "https://" not in page
    if batching == "static":
        assert any("held" in s["states"].values() for s in m["steps"])


def test_html_without_steps() -> None:
    m = hand_metrics()
    m["steps"] = []
    page = render_html(m)
    assert "data:image/png" not in page and "No engine steps" in page


def test_shipped_fixtures_load() -> None:
    for path in sorted(FIXTURES.glob("metrics_*.json")):
        assert format_summary(load_metrics(path))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "not found"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"version": 1}', "missing keys"),
        ('{"version": 2, "cache": {}, "requests": [], "steps": [], "wall_time_s": 1}', "version"),
        ('{"version": 1, "cache": [], "requests": [], "steps": [], "wall_time_s": 1}', "cache"),
    ],
)
def test_bad_files_raise_value_error(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "metrics.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        load_metrics(path)


if __name__ == "__main__":
    # Regenerates tests/fixtures/metrics_*.json; with a folder argument, the pages too.
    html_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    FIXTURES.mkdir(exist_ok=True)
    for mode in ("continuous", "static"):
        metrics = simulate(mode)
        (FIXTURES / f"metrics_{mode}.json").write_text(json.dumps(metrics, indent=1) + "\n")
        if html_dir:
            html_dir.mkdir(parents=True, exist_ok=True)
            write_html(metrics, html_dir / f"report_{mode}.html")
        print(format_summary(metrics))
