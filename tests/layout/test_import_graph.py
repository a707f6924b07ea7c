"""The layout's rules, checked on the source: no import cycles (TYPE_CHECKING imports count),
each package imports only what its __init__ docstring allows, and the KV store core stays pure
Python (no torch, never the runner: the pool's tensors are runner/kv_pool)."""

from __future__ import annotations

import pytest
from import_graph import ROOT, cycles, import_graph, imported_names, project_modules

# Package -> the packages it may import (besides itself), as each __init__.py says. An outside
# package's "runner.engine" covers the engine's subpackages; inside the engine each names the
# subpackages it may import.
ALLOWED: dict[str, set[str]] = {
    "kvcache": set(),
    "runner.kv_pool": set(),
    "runner.attention": {"runner.kv_pool"},
    "runner.backends.torch": {"runner.kv_pool", "runner.attention"},
    # The CPU falls back on the torch path; both plan shared prefixes by its grouping.
    "runner.backends.cpu": {"runner.kv_pool", "runner.attention", "runner.backends.torch"},
    "runner.backends.triton": {"runner.kv_pool", "runner.attention", "runner.backends.torch"},
    "runner.backends": {
        "runner.attention",
        "runner.backends.torch",
        "runner.backends.cpu",
        "runner.backends.triton",
    },
    "runner.model": {"runner.kv_pool", "runner.attention", "runner.backends"},
    "runner.sampling": set(),
    "runner.kv_events": {"kvcache"},
    # The engine's top level (config, sequence) and its subpackages, each above the last:
    # api over step over io and kv, all over the top level.
    "runner.engine": {"kvcache", "runner.backends", "runner.kv_events", "runner.sampling"},
    "runner.engine.kv": {"runner.engine", "kvcache", "runner.kv_pool", "runner.kv_events"},
    "runner.engine.requests": {"runner.engine", "kvcache", "runner.sampling"},
    "runner.engine.executor": {
        "runner.engine",
        "runner.engine.kv",
        "runner.kv_pool",
        "runner.attention",
        "runner.backends",
        "runner.model",
        "runner.sampling",
    },
    "runner.engine.step": {
        "runner.engine",
        "runner.engine.executor",
        "runner.engine.requests",
        "runner.engine.kv",
        "kvcache",
        "runner.kv_pool",
        "runner.attention",
        "runner.backends",
        "runner.model",
        "runner.sampling",
        "runner.kv_events",
    },
    "runner.engine.api": {
        "runner.kv_events",  # the engine front starts the KV events publisher it owns
        "runner.engine",
        "runner.engine.step",
        "runner.engine.requests",
        "runner.engine.kv",
        "kvcache",
        "runner.attention",  # the interface's ForwardParts, for profilers: types only
        "runner.model",
        "runner.sampling",
    },
    "runner.report": set(),
    # serve never imports disagg, which extends it: cli.py hands serve disagg's role starter.
    "runner.serve": {"kvcache", "runner.engine", "runner.sampling", "runner.cli"},
    "runner.disagg": {"kvcache", "runner.serve", "runner.engine"},
    "runner.router": {"kvcache", "runner.engine", "runner.serve", "runner.kv_events", "runner.cli"},
    "runner.cli": {
        "kvcache",
        "runner.engine",
        "runner.sampling",
        "runner.report",
    },
    # The measuring code: it may import the product, the product never imports it.
    "bench": {
        "kvcache",
        "runner.kv_pool",
        "runner.attention",
        "runner.backends",
        "runner.engine",
        "runner.model",
        "runner.sampling",
        "runner.serve",
        "runner.disagg",
        "runner.cli",
    },
}
# The product's packages: each of them, and everything under them, stays clear of bench.
PRODUCT = ("kvcache", "runner")


ENGINE_PARTS = ("api", "step", "requests", "kv", "executor")


def package_of(module: str) -> str:
    """The rule's package of a module: backends by backend, the
    engine by subpackage (config and sequence are its top level), bench whole (bench.serve is
    part of it)."""
    if module == "runner.kv_pool":
        return module
    parts = module.split(".")
    if parts[:2] == ["runner", "engine"] and len(parts) > 2 and parts[2] in ENGINE_PARTS:
        return ".".join(parts[:3])
    if parts[0] in ("kvcache", "bench"):
        return parts[0]
    if (
        parts[:2] == ["runner", "backends"]
        and len(parts) > 2
        and parts[2] in ("torch", "cpu", "triton")
    ):
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def covers(allowed: set[str], target: str, source: str = "") -> bool:
    """Whether an allowed package (or one above it: runner.backends covers its backends)
    names the target's package; inside the engine a subpackage is covered only by its name."""
    if source.startswith("runner.engine") and target.startswith("runner.engine"):
        return target in allowed
    return any(target == a or target.startswith(a + ".") for a in allowed)


def test_the_project_has_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_each_package_imports_only_what_it_may() -> None:
    wrong = []
    for module, targets in import_graph().items():
        source = package_of(module)
        if source == "runner":
            continue  # runner/__init__.py sets the Triton switch
        assert source in ALLOWED, f"{source} has no rule: add it to ALLOWED and its docstring"
        for target in targets:
            dest = package_of(target)
            if dest != source and dest != "runner" and not covers(ALLOWED[source], dest, source):
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_no_product_package_imports_the_bench() -> None:
    """bench/ measures the product from outside: cli.py, the composition root, registers its
    commands, and nothing under kvcache/ or runner/ imports it (not even lazily)."""
    reaching = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.split(".")[0] in PRODUCT
        for target in targets
        if target.split(".")[0] == "bench"
    ]
    assert reaching == []
    assert "bench.command" in import_graph()  # the graph reads bench/: a reach would show


def test_serve_gets_its_worker_roles_from_the_composition_root() -> None:
    """serve may not import disagg (ALLOWED), so its roles come in through cli.py: the serve
    command built alone refuses a role, naming the flag; `kvcache serve` has disagg's (which
    checks --handover)."""
    from click.testing import CliRunner

    from cli import main
    from runner.serve.command import serve

    bad = ["--role", "prefill", "--handover", "bogus"]  # fails before a model loads, either way
    alone = CliRunner().invoke(serve, bad)
    assert alone.exit_code != 0 and "--role prefill: this serve command has no worker roles" in (
        alone.output
    )
    wired = CliRunner().invoke(main, ["serve", *bad])
    assert wired.exit_code != 0 and "handover must be" in wired.output


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_docstring_names_what_it_owns_and_imports(package: str) -> None:
    doc = (project_modules()[package].read_text().split('"""') + ["", ""])[1]
    assert "May import" in doc, f"{package}/__init__.py must say which packages it may import"
    for allowed in ALLOWED[package]:
        assert allowed.removeprefix("runner.") in doc, f"{package}: docstring omits {allowed}"


def test_the_core_imports_no_torch_and_no_runner() -> None:
    heavy = []
    for name, path in project_modules().items():
        if not name.startswith("kvcache"):
            continue
        for target in imported_names(path, name):
            if target.split(".")[0] in ("torch", "runner", "numpy", "transformers"):
                heavy.append(f"{name} imports {target}")
    assert heavy == []


def test_the_core_tests_import_no_torch() -> None:
    """tests/kvcache/ tests the pure core without torch (the pool's tensors: tests/kv_pool)."""
    heavy = []
    for path in sorted((ROOT / "tests" / "kvcache").glob("test_*.py")):
        for target in imported_names(path, f"tests.kvcache.{path.stem}"):
            if target.split(".")[0] in ("torch", "runner", "numpy", "transformers"):
                heavy.append(f"{path.name} imports {target}")
    assert heavy == []
