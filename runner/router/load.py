"""The work a replica has in flight from this router, in KV blocks: what the cache-aware
policy weighs against a prefix match.

A routed request adds its prompt blocks the replica is expected to compute (those it was not
already sent) and the blocks of its answer. The prompt part is released when the first token
comes back (the prefill is then done: it no longer delays anyone), the answer part when the
request ends. A decoding request costs a newcomer little (it adds one token a step to the
batch the newcomer's prefill shares), so an answer counts its blocks up to
MAX_ANSWER_BLOCKS only: one long answer is not a backlog of prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from runner.router.replicas import Replica

MAX_ANSWER_BLOCKS = 16
UNSPECIFIED_ANSWER_TOKENS = 256  # a request without max_tokens: the context's room, capped
DEFAULT_BLOCK_SIZE = 16  # a replica whose /kvcache/info is not known yet


def answer_blocks(body: object, replica: Replica) -> int:
    """The blocks of answer a request body asks for, capped at MAX_ANSWER_BLOCKS."""
    tokens: Any = None
    if isinstance(body, dict):
        tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(body.get("n"), int) and body["n"] > 1 and isinstance(tokens, int):
            tokens *= body["n"]
    if not isinstance(tokens, int) or tokens <= 0:
        tokens = UNSPECIFIED_ANSWER_TOKENS
    info = replica.info or {}
    block_size = info.get("block_size")
    size = block_size if isinstance(block_size, int) and block_size > 0 else DEFAULT_BLOCK_SIZE
    return min(MAX_ANSWER_BLOCKS, -(-tokens // size))


@dataclass
class Work:
    """One request's share of its replica's load, added at `start` and taken back (at most
    once each part) by `prefilled` and `finish`."""

    replica: Replica
    prefill_blocks: int
    answer_blocks: int
    _prefill_held: bool = False
    _held: bool = False

    def start(self) -> None:
        self.replica.in_flight += 1
        self.replica.sent += 1
        self.replica.load_blocks += self.prefill_blocks + self.answer_blocks
        self._prefill_held = self._held = True

    def prefilled(self) -> None:
        """The first token came back: the prompt is computed."""
        if self._prefill_held:
            self.replica.load_blocks -= self.prefill_blocks
            self._prefill_held = False

    def finish(self) -> None:
        if self._held:
            self.prefilled()
            self.replica.in_flight -= 1
            self.replica.load_blocks -= self.answer_blocks
            self._held = False


@dataclass
class RecentWork:
    """Conversations started on one replica lately, each weighing half as much every `half_life_s`
    seconds (0: nothing is remembered). An exponential decay needs only the sum and the time
    it was taken, so one replica's history is two numbers."""

    half_life_s: float
    _sum: float = 0.0
    _at: float = 0.0

    def value(self, now: float) -> float:
        if self.half_life_s <= 0 or self._sum == 0:
            return 0.0
        return self._sum * 0.5 ** (max(0.0, now - self._at) / self.half_life_s)

    def add(self, count: float, now: float) -> None:
        self._sum = self.value(now) + count
        self._at = now


class FirstToken:
    """Watches an OpenAI server-sent event stream, as raw bytes in whatever pieces they
    arrive, for the first event that carries generated output (a completion's text, a chat
    delta's content, a finish reason, or an error); a chat stream's opening role-only chunk
    does not count, since a server sends it before its prefill."""

    def __init__(self) -> None:
        self.seen = False
        self._buffer = b""

    def feed(self, chunk: bytes) -> bool:
        """True once the first output has been seen (then it stops parsing)."""
        if self.seen:
            return True
        self._buffer += chunk
        *events, self._buffer = self._buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        self.seen = any(_has_output(event) for event in events)
        if self.seen:
            self._buffer = b""
        return self.seen


def _has_output(event: bytes) -> bool:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        try:
            chunk = json.loads(data)
        except ValueError:
            continue
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            return True
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            content = delta.get("content") if isinstance(delta, dict) else None
            if choice.get("text") or content or choice.get("finish_reason"):
                return True
    return False
