"""docs/ARCHITECTURE.md's "One request's path" is true: its numbered Python modules are the
files one greedy request enters, in the order a profile sees it enter them
(scripts/request_path.py), and every file it names exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ITEM = re.compile(r"^\d+\. `([^`]+)`", flags=re.MULTILINE)


def documented_path() -> list[str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## One request's path", 1)[1].split("\n## ", 1)[0]
    return ITEM.findall(section)


def test_every_file_on_the_path_exists() -> None:
    files = documented_path()
    assert len(files) > 40
    assert [f for f in files if not (ROOT / f).is_file()] == []
    assert f"enters **{len(files)} files**" in (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_the_path_is_the_order_a_profile_enters_the_files(default_model_dir: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from request_path import request_path
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    python = [f for f in documented_path() if f.endswith(".py")]
    assert request_path(str(default_model_dir)) == python
