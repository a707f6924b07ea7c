"""`kvcache generate -tp 2` started by torchrun, one process a rank, as docs/PARALLEL.md says:
rank 1 serves its share and exits before it opens a file, rank 0 writes the records, with the
tokens one process gives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_torchrun_ranks_give_one_processs_records(tiny_llama_tok_dir: Path, tmp_path: Path) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text(
        "".join(json.dumps({"prompt": p, "max_tokens": 6}) + "\n" for p in ("abc", "hello there"))
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    common = ["generate", str(lines), "--model", str(tiny_llama_tok_dir), "--temperature", "0"]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    subprocess.run(
        [sys.executable, "-m", "cli", *common, "-o", str(one)], check=True, env=env, timeout=300
    )
    launcher = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "cli"]
    done = subprocess.run(
        [*launcher, *common, "-o", str(two), "-tp", "2"],
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = [
        [json.loads(line)["token_ids"] for line in f.read_text().splitlines()] for f in (one, two)
    ]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 2
