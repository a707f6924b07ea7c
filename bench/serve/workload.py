"""What a benchmark sends: independent requests read from a JSONL file of data/, or
multi-turn chat sessions, each a conversation whose turn k repeats turns 1..k-1 with the
answers the server actually gave (so a turn's prompt extends the previous turn's prompt and
answer, as a chat client's does), all opening with one shared system prompt."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from bench.serve.system_prompt import SYSTEM_PROMPT

FOLLOW_UPS = (
    "Summarise that in one sentence.",
    "Give a short example.",
    "What is the most common mistake here?",
    "How would you explain it to a beginner?",
    "What should I read next?",
    "Can you say it another way?",
)
PASSAGE_QUESTIONS = (  # after a quoted passage
    "How does this passage change your earlier answer?",
    "Which part of the document does this relate to?",
    "Does this passage agree with the document?",
)


class WorkloadLine(TypedDict, total=False):
    """A line of a data/ workload file: `prompt` or `messages` (read_lines checks one is
    there), its own max_tokens perhaps; other fields are not read."""

    prompt: str
    messages: list[dict[str, str]]
    max_tokens: int


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


def read_lines(path: Path) -> list[WorkloadLine]:
    """A data/ workload file: one JSON object a line, with `prompt` or `messages`."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row: WorkloadLine = json.loads(line)  # checked next
        if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
            raise ValueError(f"{path}:{number}: needs a prompt or messages")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def as_messages(row: WorkloadLine) -> list[dict[str, str]]:
    if "messages" in row:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    return [{"role": "user", "content": str(row["prompt"])}]


def as_prompt(messages: list[dict[str, str]]) -> str:
    """A conversation as one completion prompt: a lone user message is its text as it is (a
    dataset line's prompt); more is a plain transcript, one "Role: text" paragraph a message,
    ending where the assistant's answer starts."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join([*lines, "Assistant:"])


def multi_turn_sessions(
    rows: list[WorkloadLine],
    conversations: int,
    turns: int,
    max_tokens: int,
    seed: int,
    system_prompt: str | None = SYSTEM_PROMPT,
    follow_up_chars: int = 480,
) -> list[Session]:
    """`conversations` sessions of `turns` turns each, shaped like vLLM's and SGLang's
    multi-turn benchmarks: every session opens with the one shared `system_prompt` (none:
    no system message), then a user message holding row i (cycled) and a question about it;
    each follow-up quotes `follow_up_chars` characters of another row (about 130 tokens at
    the default, vLLM's 120-160-token user turns) before its question, so the history grows
    by a passage and an answer a turn. Seeded: the same arguments give the same sessions."""
    rng = random.Random(seed)
    sessions = []
    for i in range(conversations):
        row = rows[i % len(rows)]
        opening = as_messages(row)
        if opening[-1]["role"] != "user":
            opening.append({"role": "user", "content": "What is this about?"})
        elif opening[0]["role"] != "system" and len(opening) == 1:  # a bare prompt: a document
            opening[0]["content"] += "\n\nWhat is this document about?"
        if i >= len(rows):  # a cycled row: a different conversation all the same
            opening[-1]["content"] = f"(conversation {i}) " + opening[-1]["content"]
        if system_prompt is not None and opening[0]["role"] != "system":
            opening = [{"role": "system", "content": system_prompt}, *opening]
        follow_ups = []
        for _ in range(turns - 1):
            question = rng.choice(FOLLOW_UPS)
            if follow_up_chars > 0 and len(rows) > 1:
                question = rng.choice(PASSAGE_QUESTIONS + FOLLOW_UPS)
                other = rows[(i + rng.randrange(1, len(rows))) % len(rows)]
                text = " ".join(m["content"] for m in as_messages(other))
                start = rng.randrange(max(1, len(text) - follow_up_chars))
                passage = text[start : start + follow_up_chars]
                question = f"Here is a related passage:\n\n{passage}\n\n{question}"
            follow_ups.append(question)
        sessions.append(Session(f"conv{i}", opening, follow_ups, max_tokens))
    return sessions


def single_requests(rows: list[WorkloadLine], count: int, max_tokens: int | None) -> list[Session]:
    """`count` one-turn sessions from the rows, cycled; each keeps its own max_tokens unless
    one is given."""
    sessions = []
    for i in range(count):
        row = rows[i % len(rows)]
        tokens = max_tokens if max_tokens is not None else int(row.get("max_tokens", 32))
        sessions.append(Session(f"req{i}", as_messages(row), [], tokens))
    return sessions
