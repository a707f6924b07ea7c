"""`kvcache report` on a disaggregated run: the two workers' recorded schedules (GET
/kvcache/metrics on each, as the bench writes them) give one timeline with a prefill lane
above a decode lane, on one clock; a run whose second worker's metrics lack their clock is a
clear error, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from click.testing import CliRunner

from cli import main
from runner.report.pd_timeline import LANES, pd_lanes
from tests.pd.conftest import WorkerFactory
from tests.pd.test_handover import PROMPT
from tests.pd.test_router_pd import pd_router


def test_the_report_of_a_pd_run_has_both_lanes(worker: WorkerFactory, tmp_path: Path) -> None:
    with worker("prefill") as prefill, worker("decode") as decode:
        with pd_router([prefill.url], [decode.url]) as router:
            for i in range(2):
                body = {"prompt": f"{i} {PROMPT}", "max_tokens": 12, "temperature": 0}
                answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
                assert answer.status_code == 200, answer.text
        metrics = httpx.get(f"{decode.url}/kvcache/metrics").json()
        metrics["prefill_worker"] = httpx.get(f"{prefill.url}/kvcache/metrics").json()
    lanes = pd_lanes(metrics)
    assert [lane.name for lane in lanes] == list(LANES)
    prefill_lane, decode_lane = lanes
    assert {kind for _, _, kind in prefill_lane.steps} == {"prefill"}  # max_tokens 1: no decode
    assert sum(kind == "decode" for _, _, kind in decode_lane.steps) >= 2 * 10
    # One clock: each prompt's prefill ends before the decode worker's first step for it.
    first_prefill_end = min(s + d for s, d, _ in prefill_lane.steps)
    assert first_prefill_end <= min(s for s, _, _ in decode_lane.steps)

    path = tmp_path / "pd.metrics.json"
    path.write_text(json.dumps(metrics))
    html = tmp_path / "pd.html"
    result = CliRunner().invoke(main, ["report", str(path), "--html", str(html)])
    assert result.exit_code == 0, result.output
    page = html.read_text()
    assert "<h2>Prefill and decode workers</h2>" in page
    assert page.index("Prefill and decode workers") < page.index("Schedule timeline")

    del metrics["prefill_worker"]["t0_unix_s"]
    path.write_text(json.dumps(metrics))
    result = CliRunner().invoke(main, ["report", str(path), "--html", str(html)])
    assert result.exit_code != 0 and "prefill worker: no t0_unix_s" in result.output
