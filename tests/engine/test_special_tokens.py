"""skip_special_tokens (vLLM's): False keeps special tokens in the text, and in what stop
strings and streams see; True (the default) leaves them out."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvcache import LLM, SamplingParams
from runner.cli.batch.file import parse_line

# Only "</s>" (id 2, the tiny tokenizer's EOS) and "C" (byte 0x43, id 3 + 0x43) can come,
# and EOS does not end the request: the answer mixes text and specials.
MIXED = SamplingParams(
    max_tokens=10, temperature=1.0, seed=7, ignore_eos=True, allowed_token_ids=[2, 3 + 0x43]
)


def test_special_tokens_stay_in_the_text_when_asked(tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir))
    kept = dataclasses.replace(MIXED, skip_special_tokens=False)
    skipped, shown = llm.generate(["ab", "ab"], [MIXED, kept])
    assert skipped.token_ids == shown.token_ids and 2 in shown.token_ids
    assert shown.text == llm.tokenizer.decode(shown.token_ids, skip_special_tokens=False)
    assert "</s>" in shown.text and "</s>" not in skipped.text
    assert skipped.text == shown.text.replace("</s>", "")
    streamed = "".join(d.text for d in llm.stream(["ab"], kept))
    assert streamed == shown.text


def test_a_stop_string_can_be_a_special_token(tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir))
    kept = dataclasses.replace(MIXED, skip_special_tokens=False)
    free = llm.generate(["ab"], kept)[0]
    first = free.token_ids.index(2)
    out = llm.generate(["ab"], dataclasses.replace(kept, stop=["</s>"]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    assert out.text == llm.tokenizer.decode(free.token_ids[:first])
    ignored = llm.generate(["ab"], dataclasses.replace(MIXED, stop=["</s>"]))[0]
    assert ignored.finish_reason == "length"  # skipped, the special is not in the text


def test_the_flag_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="skip_special_tokens must be a bool"):
        SamplingParams(skip_special_tokens="no")  # type: ignore[arg-type]
    line = json.dumps({"prompt": "hi", "skip_special_tokens": False})
    parsed = parse_line(1, line, {}, is_text_file=False)
    assert parsed.params is not None and parsed.params.skip_special_tokens is False
