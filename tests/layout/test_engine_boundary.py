"""The engine's boundary, checked on the source: no module imports another package's private
name (a leading underscore); the packages outside the engine (serve, disagg, the CLI, the bench)
reach none of the engine's parts through it (its scheduler, block manager, recorder, tiers, KV
pool...), not even through getattr, and none of its private names; and no engine anywhere is
typed `Any`. What they need of the engine is on the interface (runner/engine/api/interface.py);
a profiler reads the model through its `forward_parts()`."""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import ROOT, project_modules

from runner.engine.api.interface import EngineInterface

# The engine's parts: what `Engine.__init__` builds, which only runner/engine may touch.
ENGINE_PARTS = {
    "attention", "block_manager", "clock", "cpu_layers", "executor", "grammars", "hf_config",
    "intake", "kv", "kv_events", "model", "overlap", "recorder", "runner", "scheduler", "settler",
    "spec_stats", "stopper", "tiers", "token_texts", "validator",
}  # fmt: skip
# What the engine is called where it is held (the bench's probe and reference engines too).
ENGINE_NAMES = {"llm", "engine", "_llm", "probe", "reference"}
MIGRATED = ("runner/serve", "runner/disagg", "runner/cli", "bench", "cli.py")


def _package(module: str) -> str:
    parts = module.split(".")
    return "kvcache" if parts[0] == "kvcache" else ".".join(parts[:2])


def _sources() -> dict[str, Path]:
    return project_modules() | {"cli": ROOT / "cli.py"}


def test_no_private_name_is_imported_from_another_package() -> None:
    crossing = []
    for name, path in _sources().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
                continue
            if node.module.split(".")[0] not in ("kvcache", "runner"):
                continue
            if _package(node.module) == _package(name):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    crossing.append(f"{name} imports {node.module}.{alias.name}")
    assert crossing == []


def _held_engine(node: ast.expr) -> bool:
    """Whether ``node`` names an engine: ``llm``, ``self.llm``, ``state.llm``, ``run.llm``."""
    if isinstance(node, ast.Name):
        return node.id in ENGINE_NAMES
    return isinstance(node, ast.Attribute) and node.attr in ENGINE_NAMES


def _got_part(call: ast.Call) -> str | None:
    """The part ``getattr(<engine>, "<part>", ...)`` names, if ``call`` is such a call."""
    if not isinstance(call.func, ast.Name) or call.func.id != "getattr" or len(call.args) < 2:
        return None
    name = call.args[1]
    if not _held_engine(call.args[0]) or not isinstance(name, ast.Constant):
        return None
    return name.value if name.value in ENGINE_PARTS else None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def reaches(path: Path) -> list[str]:
    """Each ``<engine>.<part>`` or ``<engine>._private`` (or ``getattr(<engine>, "<part>")``)
    in a file, as "path:line: part"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and (node.attr in ENGINE_PARTS or _private(node.attr)):
            if _held_engine(node.value):
                found.append(f"{path}:{node.lineno}: {node.attr}")
        elif isinstance(node, ast.Call) and (part := _got_part(node)) is not None:
            found.append(f"{path}:{node.lineno}: {part}")
    return found


def _outside_files() -> list[Path]:
    files = [ROOT / "cli.py"]
    for folder in MIGRATED[:-1]:
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def test_the_migrated_packages_use_the_engine_only_through_its_interface() -> None:
    assert [hit for path in _outside_files() for hit in reaches(path)] == []


def test_no_engine_part_is_on_the_interface() -> None:
    """The parts list and the interface never overlap: what the interface offers is allowed."""
    assert ENGINE_PARTS.isdisjoint(dir(EngineInterface))


def test_the_reach_finder_sees_a_reach(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        "def f(state, llm):\n    state.llm.scheduler\n    getattr(llm, 'kv_events', None)\n"
        "    getattr(llm, 'config')\n    llm._requests.is_empty()\n    llm.__class__\n"
        "    return llm.kv.tensor\n"
    )
    found = sorted(hit.split(": ")[-1] for hit in reaches(source))
    assert found == ["_requests", "kv", "kv_events", "scheduler"]


def any_engines(path: Path) -> list[str]:
    """Each argument or annotated variable named as an engine is held (``llm``, ``probe``...)
    and typed ``Any``, as "path:line: name"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.arg):
            name, annotation = node.arg, node.annotation
        elif isinstance(node, ast.AnnAssign):
            name = node.target.id if isinstance(node.target, ast.Name) else ""
            name = node.target.attr if isinstance(node.target, ast.Attribute) else name
            annotation = node.annotation
        else:
            continue
        typed_any = isinstance(annotation, ast.Name) and annotation.id == "Any"
        if name in ENGINE_NAMES and typed_any:
            found.append(f"{path}:{node.lineno}: {name}")
    return found


def test_no_engine_is_typed_any() -> None:
    files = [ROOT / "cli.py", *sorted((ROOT / "runner").rglob("*.py"))]
    files += sorted((ROOT / "bench").rglob("*.py"))
    assert [hit for path in files for hit in any_engines(path)] == []


def test_the_any_finder_sees_an_any_engine(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        "def f(llm: Any, n: Any, probe: LLM) -> None:\n    engine: Any = None\n"
        "    self.reference: Any = None\n"
    )
    found = sorted(hit.split(": ")[-1] for hit in any_engines(source))
    assert found == ["engine", "llm", "reference"]
