"""The code's health in three figures, for kvcache/, runner/, bench/ and cli.py (issue 50).

- `Any` in signatures: every `Any` (a bare name or `typing.Any`) inside a def's parameter or
  return annotations, string annotations parsed too, against the number of defs.
- Long functions: defs longer than 60 lines (a nested def counts on its own, and in its parent).
- Duplicate pairs: the `duplicates` tool's pairs over the repo with both sides in these sources.

Run: python scripts/code_metrics.py
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("kvcache", "runner", "bench", "cli.py")
LONG = 60

Def = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class LongFunction:
    path: str
    name: str
    line: int
    length: int


def defs(tree: ast.AST) -> Iterator[Def]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def signature_annotations(fn: Def) -> Iterator[ast.expr]:
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    params += [a for a in (args.vararg, args.kwarg) if a is not None]
    for param in params:
        if param.annotation is not None:
            yield param.annotation
    if fn.returns is not None:
        yield fn.returns


def any_in(annotation: ast.expr) -> int:
    """How many `Any` one annotation holds; a string annotation counts as the code it spells,
    but a `Literal`'s strings are values."""
    if isinstance(annotation, ast.Name | ast.Attribute):
        name = annotation.id if isinstance(annotation, ast.Name) else annotation.attr
        if name == "Any":
            return 1
    if isinstance(annotation, ast.Subscript) and isinstance(
        annotation.value, ast.Name | ast.Attribute
    ):
        value = annotation.value
        if (value.id if isinstance(value, ast.Name) else value.attr) == "Literal":
            return 0
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            return any_in(ast.parse(annotation.value, mode="eval").body)
        except SyntaxError:
            return 0
    return sum(
        any_in(child) for child in ast.iter_child_nodes(annotation) if isinstance(child, ast.expr)
    )


def signature_any(source: str) -> tuple[int, int]:
    """(`Any` in the defs' signatures, the number of defs) of one module's source."""
    fns = list(defs(ast.parse(source)))
    return sum(any_in(a) for fn in fns for a in signature_annotations(fn)), len(fns)


def long_functions(source: str, path: str, limit: int = LONG) -> list[LongFunction]:
    found = []
    for fn in defs(ast.parse(source)):
        length = (fn.end_lineno or fn.lineno) - fn.lineno + 1
        if length > limit:
            found.append(LongFunction(path, fn.name, fn.lineno, length))
    return found


def source_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for name in SOURCES:
        path = root / name
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def package_of(path: Path, root: Path = ROOT) -> str:
    """kvcache, cli.py, bench, bench/serve, or runner's subpackage (runner/engine/api...)."""
    parts = path.relative_to(root).parts
    return "/".join(parts[:-1]) or parts[0]


def in_sources(path: str) -> bool:
    return path == "cli.py" or path.split("/")[0] in SOURCES


ROW = re.compile(r"^D\d+\s+(\S+?):\d+-\d+\s+~\s+(\S+?):\d+-\d+")


def duplicate_pairs(root: Path = ROOT) -> int | None:
    """Pairs with both sides in the sources, or None where the tool is not on PATH."""
    if shutil.which("duplicates") is None:
        return None
    out = subprocess.run(
        ["duplicates", "--repo", str(root), "--most", "200", "--seconds", "120"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    rows = (ROW.match(line.strip()) for line in out.splitlines())
    return sum(1 for m in rows if m and in_sources(m[1]) and in_sources(m[2]))


def main() -> int:
    by_package: dict[str, list[int]] = {}
    long: list[LongFunction] = []
    for path in source_files():
        source = path.read_text(encoding="utf-8")
        anys, count = signature_any(source)
        totals = by_package.setdefault(package_of(path), [0, 0])
        totals[0] += anys
        totals[1] += count
        long += long_functions(source, str(path.relative_to(ROOT)))
    anys = sum(t[0] for t in by_package.values())
    count = sum(t[1] for t in by_package.values())
    print(f"Any in signatures: {anys} in {count} signatures")
    for package, (a, n) in sorted(by_package.items(), key=lambda kv: (-kv[1][0], kv[0])):
        print(f"  {package:32} {a:4} in {n:4}")
    print(f"functions over {LONG} lines: {len(long)}")
    for fn in sorted(long, key=lambda f: -f.length)[:10]:
        print(f"  {fn.length:4}  {fn.path}:{fn.line} {fn.name}")
    pairs = duplicate_pairs()
    print(f"duplicate pairs: {'not available' if pairs is None else pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
