"""What a benchmark sends: independent requests read from a JSONL file of data/, or
multi-turn chat sessions, each a conversation whose turn k repeats turns 1..k-1 with the
answers the server actually gave (so a turn's prompt extends the previous turn's prompt and
answer, as a chat client's does)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FOLLOW_UPS = (
    "Summarise that in one sentence.",
    "Give a short example.",
    "What is the most common mistake here?",
    "How would you explain it to a beginner?",
    "What should I read next?",
    "Can you say it another way?",
)


@dataclass
class Session:
    """One conversation: its opening messages, then one follow-up question a turn."""

    id: str
    opening: list[dict[str, str]]
    follow_ups: list[str]
    max_tokens: int

    @property
    def turns(self) -> int:
        return 1 + len(self.follow_ups)


def read_lines(path: Path) -> list[dict[str, Any]]:
    """A data/ workload file: one JSON object a line, with `prompt` or `messages`."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
            raise ValueError(f"{path}:{number}: needs a prompt or messages")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def as_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" in row:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    return [{"role": "user", "content": str(row["prompt"])}]


def multi_turn_sessions(
    rows: list[dict[str, Any]], conversations: int, turns: int, max_tokens: int, seed: int
) -> list[Session]:
    """`conversations` sessions of `turns` turns each; session i opens with row i (cycled)
    as its context (a system message holding the row's text) and asks follow-ups in a
    seeded random order."""
    rng = random.Random(seed)
    sessions = []
    for i in range(conversations):
        row = rows[i % len(rows)]
        opening = as_messages(row)
        if opening[0]["role"] != "system":  # the row's text as the conversation's context
            opening = [{"role": "system", "content": opening[0]["content"]}, *opening[1:]]
        if opening[-1]["role"] != "user":
            opening.append({"role": "user", "content": "What is this about?"})
        if i >= len(rows):  # a cycled row: a different conversation all the same
            opening[0]["content"] = f"(conversation {i}) " + opening[0]["content"]
        follow_ups = [rng.choice(FOLLOW_UPS) for _ in range(turns - 1)]
        sessions.append(Session(f"conv{i}", opening, follow_ups, max_tokens))
    return sessions


def single_requests(
    rows: list[dict[str, Any]], count: int, max_tokens: int | None
) -> list[Session]:
    """`count` one-turn sessions from the rows, cycled; each keeps its own max_tokens unless
    one is given."""
    sessions = []
    for i in range(count):
        row = rows[i % len(rows)]
        tokens = max_tokens if max_tokens is not None else int(row.get("max_tokens", 32))
        sessions.append(Session(f"req{i}", as_messages(row), [], tokens))
    return sessions
