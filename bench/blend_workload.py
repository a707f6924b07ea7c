"""The blend bench's workload: retrieval-augmented prompts whose documents come back again and
again, in other orders, after other questions.

Documents: Python's own help topics (`pydoc_data.topics`, shipped with every CPython), their
paragraphs packed into passages of 200 to 400 tokens: about 250 of them. A query is a system
prompt, 6 passages drawn by a Zipf law over a shuffled ranking (no two alike), in a shuffled
order, and a question, in the model's chat template, as segments: the system prompt's opening
(the prefix every query shares), the passages, and the question with the answer's opening.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

DOCS_PER_QUERY = 6
MIN_TOKENS, MAX_TOKENS = 200, 400
ZIPF_S = 1.1  # the law's exponent: the hottest passage comes ~1/s of the time more than the next
SYSTEM = "You answer questions about Python from the passages the user gives. Be brief."


@dataclass(frozen=True)
class Passage:
    topic: str
    token_ids: list[int]


@dataclass(frozen=True)
class Query:
    """One prompt as segments (token ids), and the passages it holds (by index)."""

    segments: list[list[int]]
    passages: list[int]


def passages(tokenizer: PreTrainedTokenizerBase) -> list[Passage]:
    """Python's help topics packed into passages of MIN_TOKENS to MAX_TOKENS tokens, each
    opening with a line break and a header so that it reads alone and after another."""
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", topics[topic])]
        current: list[int] = []
        for paragraph in (p for p in paragraphs if len(p) > 40):
            ids = tokenizer(paragraph + "\n", add_special_tokens=False).input_ids
            if current and len(current) + len(ids) > MAX_TOKENS:
                if len(current) >= MIN_TOKENS:
                    out.append(Passage(topic, header(tokenizer, topic) + current))
                current = []
            current.extend(ids[:MAX_TOKENS])
        if len(current) >= MIN_TOKENS:
            out.append(Passage(topic, header(tokenizer, topic) + current))
    return out


def header(tokenizer: PreTrainedTokenizerBase, topic: str) -> list[int]:
    ids: list[int] = tokenizer(f"\n\nPassage ({topic}):\n", add_special_tokens=False).input_ids
    return ids


def queries(
    tokenizer: PreTrainedTokenizerBase, docs: list[Passage], count: int, seed: int
) -> list[Query]:
    """`count` queries: Zipf-drawn passages, shuffled, and a question about one of them."""
    rng = random.Random(seed)
    ranking = list(range(len(docs)))
    rng.shuffle(ranking)  # which passage is hottest has nothing to do with its topic's name
    weights = [1.0 / (rank + 1) ** ZIPF_S for rank in range(len(docs))]
    opening = chat_opening(tokenizer)
    out = []
    for _ in range(count):
        chosen: list[int] = []
        while len(chosen) < DOCS_PER_QUERY:
            pick = ranking[rng.choices(range(len(docs)), weights)[0]]
            if pick not in chosen:
                chosen.append(pick)
        asked = docs[rng.choice(chosen)].topic
        question = rng.choice(
            [
                f"What does the passage about {asked} explain?",
                f"Summarize the passage on {asked} in one sentence.",
                f"Which rule does the {asked} passage state first?",
            ]
        )
        closing = chat_closing(tokenizer, question)
        segments = [opening] + [docs[i].token_ids for i in chosen] + [closing]
        out.append(Query(segments, chosen))
    return out


def chat_opening(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The chat template's text up to the user's message: the prefix all queries share."""
    text = render(tokenizer, "\x00")
    ids: list[int] = tokenizer(text[: text.index("\x00")], add_special_tokens=True).input_ids
    return ids


def chat_closing(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """The question, then the template's text from the end of the user's message on."""
    text = render(tokenizer, "\x00")
    tail = text[text.index("\x00") + 1 :]
    ids: list[int] = tokenizer(
        f"\n\nQuestion: {question}" + tail, add_special_tokens=False
    ).input_ids
    return ids


def render(tokenizer: PreTrainedTokenizerBase, user: str) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    if getattr(tokenizer, "chat_template", None):
        return str(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
    return f"{SYSTEM}\n{user}\nAnswer:"
