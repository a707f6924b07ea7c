"""`pip install .` (not editable) must ship everything the engine needs at run time: every
package, and the C kernels' sources with their headers (they are compiled at first use, so a
missing header silently drops the engine to torch's slower paths)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from import_graph import ROOT, project_modules


def test_the_wheel_holds_every_module_and_the_c_headers(tmp_path: Path) -> None:
    # A copy of the sources: setuptools keeps a build/ folder beside them, whose leftovers
    # (modules since moved) would end up in a wheel built in place.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns("build", ".*", "*.egg-info", "__pycache__")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvcache-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    csrc = ROOT / "runner/backends/cpu/csrc"
    sources = sorted(p for p in csrc.rglob("*") if p.is_file())
    assert {p.suffix for p in sources} == {".c", ".h"}
    assert csrc / "portable" / "decode_attention_vec.c" in sources
    for path in sources:
        assert path.relative_to(ROOT).as_posix() in names
    for path in project_modules().values():
        assert path.relative_to(ROOT).as_posix() in names
    assert "cli.py" in names
