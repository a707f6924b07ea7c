"""An empty --cache-key (`--cache-key "$SECRET"` with SECRET unset) is a usage error naming the
option, in every command that takes the engine's options (issue 42): before, it meant no key,
and the run trusted every stored block without a word."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from cli import main


def test_generate_refuses_an_empty_cache_key(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": [5, 6, 7]}) + "\n")
    args = ["generate", str(src), "--model", str(tiny_llama_dir), "--max-tokens", "2"]
    result = CliRunner().invoke(main, [*args, "--cache-key", ""])
    assert result.exit_code == 2, result.output
    assert "--cache-key" in result.output and "empty" in result.output
    assert "[a]" not in result.output  # nothing ran unsigned
    assert CliRunner().invoke(main, [*args, "--cache-key", "k"]).exit_code == 0


def test_serve_refuses_an_empty_cache_key_before_the_model_loads(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    result = CliRunner().invoke(main, ["serve", "--model", missing, "--cache-key", ""])
    assert result.exit_code == 2, result.output
    assert "--cache-key" in result.output and "empty" in result.output
    assert "no-such-model" not in result.output
