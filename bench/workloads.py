"""Bench workloads: data/<name>.jsonl turned into token ids with the model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DATA_DIR = Path(__file__).resolve().parents[1] / "data"


class BenchRequest(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # Engine steps to wait before submitting (a prompt that arrives among running decodes).
    arrive_after_steps: int = 0
    ignore_eos: bool = False


def workload_path(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".jsonl" and path.exists():
        return path
    path = DATA_DIR / f"{name}.jsonl"
    if not path.exists():
        known = sorted(p.stem for p in DATA_DIR.glob("*.jsonl"))
        raise ValueError(f"no workload {name!r}: looked for {path}; known: {', '.join(known)}")
    return path


def load_workload(
    name: str,
    tokenizer: PreTrainedTokenizerBase | None,
    max_tokens: int | None = None,
    limit: int | None = None,
) -> list[BenchRequest]:
    """Read a workload file; `messages` lines go through the chat template."""
    requests: list[BenchRequest] = []
    with workload_path(name).open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if "prompt_token_ids" in obj and "messages" not in obj:
                ids = list(obj["prompt_token_ids"])
            elif tokenizer is None:
                raise ValueError(f"{name} line {line_no}: a text prompt needs a tokenizer")
            elif "messages" in obj:
                text = tokenizer.apply_chat_template(
                    obj["messages"], tokenize=False, add_generation_prompt=True
                )
                ids = list(tokenizer(text, add_special_tokens=False).input_ids)
            else:
                ids = list(tokenizer(obj["prompt"]).input_ids)
            new_tokens = max_tokens or int(obj.get("max_tokens", 32))
            delay = int(obj.get("arrive_after_steps", 0))
            requests.append(
                BenchRequest(
                    str(obj.get("id", line_no)),
                    ids,
                    new_tokens,
                    delay,
                    bool(obj.get("ignore_eos", False)),
                )
            )
            if limit is not None and len(requests) >= limit:
                break
    return requests
