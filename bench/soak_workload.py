"""What the soak (scripts/soak.py) feeds the engine: a tiny random Llama and a seeded, mixed
stream of requests (shared system prompts, unique prompts, repeats, multi-turn follow-ups,
canaries; salted or not; greedy or sampled, some penalized or under logit rules; some asking
for logprobs of their answers or prompts)."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.sampling.params import SamplingParams

VOCAB = 320
SALTS = [None] * 17 + ["tenant-a"] * 2 + ["tenant-b"]  # 15% of requests carry a salt


def build_tiny_llama(path: Path) -> Path:
    """A seeded random 2-layer Llama (hidden 64, vocab 320, context 512) saved as a HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@dataclass
class Request:
    kind: str
    prompt: list[int]
    params: SamplingParams
    salt: str | None


class Workload:
    """Deterministic stream of mixed requests; `feedback` turns answers into follow-ups."""

    def __init__(self, seed: int, max_prompt: int) -> None:
        self.rng = random.Random(seed)
        self.max_prompt = max_prompt
        self.systems = [self._tokens(n) for n in (8, 13, 16, 24, 31, 40)]
        self.recent: deque[tuple[list[int], str | None]] = deque(maxlen=200)
        self.turns: deque[tuple[list[int], str | None]] = deque(maxlen=50)
        self.canaries = [
            Request("canary", self._tokens(21), SamplingParams(max_tokens=8, temperature=0), None),
            Request(
                "canary",
                self._tokens(27),
                SamplingParams(max_tokens=8, temperature=0.9, top_k=40, top_p=0.9, seed=777),
                None,
            ),
        ]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(n)]

    def _params(self) -> SamplingParams:
        r = self.rng
        kwargs: dict[str, Any] = {"max_tokens": r.randint(1, 8)}
        if r.random() < 0.3:
            kwargs.update(temperature=r.choice([0.7, 1.0, 1.2]), top_k=r.choice([-1, 20]))
            kwargs["top_p"] = r.choice([1.0, 0.9])
            if r.random() < 0.5:
                kwargs["seed"] = r.randrange(1000)
            if r.random() < 0.3:  # sampled only: greedy answers are compared across requests
                kwargs.update(repetition_penalty=1.2, frequency_penalty=r.choice([0.0, 0.5]))
            if r.random() < 0.2:  # logit rules, sampled only for the same reason
                kwargs["min_tokens"] = r.randint(0, kwargs["max_tokens"])
                kwargs["logit_bias"] = {r.randrange(VOCAB): r.uniform(-5, 5)}
                if r.random() < 0.5:
                    kwargs["allowed_token_ids"] = self._tokens(30)
        else:
            kwargs["temperature"] = 0.0
        if r.random() < 0.1:
            kwargs["stop_token_ids"] = [r.randrange(3, VOCAB)]
        if r.random() < 0.1:
            kwargs["logprobs"] = r.choice([0, 3])
        if r.random() < 0.05:
            kwargs["prompt_logprobs"] = r.choice([0, 2])
        return SamplingParams(**kwargs)

    def next(self, index: int) -> Request:
        r = self.rng
        if index % 50 == 25:
            return self.canaries[(index // 50) % 2]
        roll = r.random()
        salt = r.choice(SALTS)
        if roll < 0.45:
            prompt = r.choice(self.systems) + self._tokens(r.randint(1, 12))
            kind = "shared"
        elif roll < 0.65:
            prompt, kind = self._tokens(r.randint(4, 40)), "unique"
        elif roll < 0.85 and self.recent:
            (prompt, salt), kind = r.choice(self.recent), "repeat"
        elif self.turns:
            prev, salt = self.turns[r.randrange(len(self.turns))]
            prompt, kind = prev + self._tokens(r.randint(2, 8)), "turn"
            if len(prompt) > self.max_prompt:
                prompt, kind = r.choice(self.systems) + self._tokens(3), "shared"
        else:
            prompt, kind = self._tokens(r.randint(4, 40)), "unique"
        self.recent.append((prompt, salt))
        return Request(kind, list(prompt), self._params(), salt)

    def feedback(self, prompt: list[int], answer: list[int], salt: str | None) -> None:
        if len(prompt) + len(answer) <= self.max_prompt - 8:
            self.turns.append((prompt + answer, salt))
