"""The README's Python example runs as written (with the default model), so the guide stays
true as the API changes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_python_example_runs(
    default_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert blocks, "the README has no Python example"
    monkeypatch.chdir(tmp_path)  # files the example writes land here
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # our own guide, run as written
    assert capsys.readouterr().out.strip(), "the streaming loop printed nothing"
    saved = list(tmp_path.glob("*.safetensors"))
    assert saved, "save_prefix_cache wrote no file"
    from kvcache import LLM

    assert LLM().load_prefix_cache(saved[0]) > 0
