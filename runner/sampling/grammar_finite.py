"""Whether a compiled structure admits any finite answer.

A structure can let every token through at first and still have no end: a JSON schema whose
required property is the schema itself (`{"required": ["next"], "properties": {"next":
{"$ref": "#"}}}`), or the grammar `root ::= "a" root`. Its first mask allows tokens, so the
check on that mask passes; each answer then runs to max_tokens and ends as "length", never as
the structure it asked for. Such a grammar has a rule that derives no finite string: a
context-free grammar's *productive* rules are the least fixed point of "some alternative is
made only of literals, character classes, optional parts and productive rules", and the
structure admits an answer exactly when its root is productive.

The rules are read from xgrammar's own EBNF print of the compiled grammar (the form every
kind of structure compiles to). A print this reader does not follow (another xgrammar
version) answers None, "unknown", and the structure is let through as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*")
    | (?P<chars>\[(?:[^\]\\]|\\.)*\])
    | (?P<repeat>\{\s*-?\d+\s*,\s*-?\d+\s*\}|\{\s*\d+\s*\})
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<op>\(=|\(|\)|\||\*|\+|\?)
    )""",
    re.VERBOSE,
)


class _Unreadable(Exception):
    """The print holds something this reader does not know."""


@dataclass
class _Node:
    kind: str  # "terminal", "rule", "alt", "seq", "lookahead"
    name: str = ""
    parts: tuple[_Node, ...] = ()
    min_count: int = 1  # repetitions the node must take at least


def has_finite_answer(ebnf: str) -> bool | None:
    """Whether `root` in this EBNF print derives some finite string; None when unreadable."""
    try:
        rules = _read_rules(ebnf)
    except _Unreadable:
        return None
    if "root" not in rules:
        return None
    productive: set[str] = set()
    changed = True
    while changed:  # the least fixed point: at most one pass per rule
        changed = False
        for name, body in rules.items():
            if name not in productive and _productive(body, productive):
                productive.add(name)
                changed = True
    return "root" in productive


def _productive(node: _Node, productive: set[str]) -> bool:
    if node.min_count == 0 or node.kind in ("terminal", "lookahead"):
        return True
    if node.kind == "rule":
        return node.name in productive
    if node.kind == "alt":
        return any(_productive(part, productive) for part in node.parts)
    return all(_productive(part, productive) for part in node.parts)


def _read_rules(ebnf: str) -> dict[str, _Node]:
    rules: dict[str, _Node] = {}
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition("::=")
        if not sep or not re.fullmatch(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*", name):
            raise _Unreadable(line)
        rules[name.strip()] = _Parser(body).whole()
    return rules


class _Parser:
    """Recursive descent over one rule's body: alternatives of sequences of (possibly
    repeated) items."""

    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                raise _Unreadable(text[pos:])
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            pos = match.end()
        self.at = 0

    def whole(self) -> _Node:
        node = self.alternatives()
        if self.at != len(self.tokens):
            raise _Unreadable(str(self.tokens[self.at]))
        return node

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.at] if self.at < len(self.tokens) else ("end", "")

    def alternatives(self) -> _Node:
        alts = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.at += 1
            alts.append(self.sequence())
        return alts[0] if len(alts) == 1 else _Node("alt", parts=tuple(alts))

    def sequence(self) -> _Node:
        items: list[_Node] = []
        while self.peek()[0] != "end" and self.peek()[1] not in ("|", ")"):
            items.append(self.repeated())
        return _Node("seq", parts=tuple(items))  # empty: "" derives the empty string

    def repeated(self) -> _Node:
        node = self.item()
        kind, text = self.peek()
        if kind == "op" and text in "*?+":
            self.at += 1
            node.min_count = 1 if text == "+" else 0
        elif kind == "repeat":
            self.at += 1
            node.min_count = int(text.strip("{}").split(",")[0])
        return node

    def item(self) -> _Node:
        kind, text = self.peek()
        self.at += 1
        if kind in ("string", "chars"):
            return _Node("terminal")
        if kind == "name":
            return _Node("rule", name=text)
        if kind == "op" and text in ("(", "(="):
            inner = self.alternatives()
            if self.peek() != ("op", ")"):
                raise _Unreadable("unclosed (")
            self.at += 1
            return _Node("lookahead") if text == "(=" else _Node("seq", parts=(inner,))
        raise _Unreadable(text)
