"""`kvcache report` on a metrics file with a field of the wrong type, or missing: one error
naming the field, never a KeyError, ValueError or AttributeError traceback (issue 24, item 10).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "metrics_continuous.json"


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets the field at a dotted path ("requests.0.itl_s")."""

    def edit(metrics: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = metrics
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if value is KeyError:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return edit


CASES = [
    ("requests.0.prompt_tokens", "ten", "requests[0].prompt_tokens must be a number, got 'ten'"),
    ("requests.1.cached_tokens", KeyError, "requests[1] has no 'cached_tokens'"),
    ("requests.0.id", KeyError, "requests[0] has no 'id'"),
    ("requests.0.itl_s", "fast", "requests[0].itl_s must be a list of numbers"),
    ("requests.0.ttft_s", "soon", "requests[0].ttft_s must be a number"),
    ("requests.2", 5, "requests[2] must be an object, got 5"),
    ("requests.0.finish_reason", 3, "requests[0].finish_reason must be a string"),
    ("steps.3.states", ["decode"], "steps[3].states must be an object"),
    ("steps.3.states", {"x": "decode"}, "steps[3].states keys must be request rows"),
    ("steps.3.states", {"0": 1}, "steps[3].states.0 must be a string"),
    ("steps.0.duration_s", "1s", "steps[0].duration_s must be a number"),
    ("steps.2.hit_tokens_cum", KeyError, "steps[2] has no 'hit_tokens_cum'"),
    ("steps.1.model_s", [1], "steps[1].model_s must be a number"),
    ("wall_time_s", "2", "wall_time_s must be a number, got '2'"),
    ("cache.hit_tokens", "many", "cache.hit_tokens must be a number"),
    ("num_draft_tokens", "3", "num_draft_tokens must be a number"),
    ("requests.0.prompt_tokens", True, "requests[0].prompt_tokens must be a number, got True"),
]


@pytest.mark.parametrize(("path", "value", "message"), CASES)
def test_a_wrong_field_is_named(tmp_path: Path, path: str, value: Any, message: str) -> None:
    metrics = copy.deepcopy(json.loads(FIXTURE.read_text()))
    _set(path, value)(metrics)
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps(metrics))
    result = CliRunner().invoke(main, ["report", str(bad), "--html", str(tmp_path / "r.html")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"Error: {bad}: {message}" in result.output


def test_the_fixture_itself_still_reports(tmp_path: Path) -> None:
    html = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", str(FIXTURE), "--html", str(html)])
    assert result.exit_code == 0 and html.stat().st_size > 1000, result.output
