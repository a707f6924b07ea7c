"""The engine bounds how long its OpenMP threads spin at a region's end (runner/__init__.py):
set before torch loads libgomp, which reads it once, and never over the user's own setting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# What libgomp will read: the variables as they stand when torch (and libgomp) first loads.
PROBE = (
    "import builtins, os\n"
    "real = builtins.__import__\n"
    "seen = {}\n"
    "def watch(name, *args, **kwargs):\n"
    "    if name == 'torch' and not seen:\n"
    "        seen.update(spin=os.environ.get('GOMP_SPINCOUNT'))\n"
    "    return real(name, *args, **kwargs)\n"
    "builtins.__import__ = watch\n"
    "import runner\n"
    "print(seen.get('spin'))\n"
)


def spin_count_at_torch_import(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    clean["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_spin_count_is_bounded_before_torch_loads() -> None:
    assert spin_count_at_torch_import() == "1000"


def test_the_users_own_settings_are_kept() -> None:
    assert spin_count_at_torch_import(GOMP_SPINCOUNT="5") == "5"
    assert spin_count_at_torch_import(OMP_WAIT_POLICY="ACTIVE") == "None"
