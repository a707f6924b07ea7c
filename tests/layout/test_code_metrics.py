"""scripts/code_metrics.py's counters, on a small source written here (the repo's own figures
change with every commit, so they are printed, never asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "code_metrics.py"


@pytest.fixture(scope="module")
def metrics() -> ModuleType:
    spec = importlib.util.spec_from_file_location("code_metrics", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


SOURCE = """
import typing
from typing import Any

def loose(a: Any, b: int, *rest: "Any", c: dict[str, typing.Any] = {}) -> list[Any]:
    x: Any = a  # a variable's annotation is not a signature's
    return [x]

async def tight(a: int, **kw: str) -> None:
    def inner(b: "list[Any]") -> typing.Literal["Any"]:
        return "Any"

def untyped(a, b):
    return Any
"""


def test_any_counted_in_parameters_returns_and_strings_only(metrics: ModuleType) -> None:
    # loose: a, *rest (a string), c (typing.Any), the return; inner: b (a string), not the
    # Literal's "Any" (a value); the variable's annotation and untyped's body are no signature.
    anys, defs = metrics.signature_any(SOURCE)
    assert defs == 4
    assert anys == 5


def test_any_absent_counts_zero(metrics: ModuleType) -> None:
    assert metrics.signature_any("def f(a: int) -> str:\n    return ''\n") == (0, 1)


def test_functions_over_sixty_lines(metrics: ModuleType) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    # 1 def line + 59 + 1 return = 61 lines: over; one line fewer: not.
    long_one = f"def long_one():\n{body}    return 0\n"
    short_one = f"def short_one():\n{body[: body.rindex('    x58')]}    return 0\n"
    found = metrics.long_functions(long_one + "\n" + short_one, "m.py")
    assert [(f.name, f.length, f.line) for f in found] == [("long_one", 61, 1)]
