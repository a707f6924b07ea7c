"""chat_template_kwargs: what the chat template sees beside the messages (Qwen3's
`enable_thinking`, `add_generation_prompt`), from the Python API and a batch-file line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcache import LLM, SamplingParams
from runner.cli.batch.beams import line_prompt
from runner.cli.batch.file import parse_line
from tests.conftest import CHAT_TEMPLATE

THINKING = (
    CHAT_TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}<n>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def llm(tiny_llama_tok_dir: Path) -> LLM:
    engine = LLM(str(tiny_llama_tok_dir))
    engine.tokenizer.chat_template = THINKING
    return engine


def test_the_template_sees_the_kwargs(llm: LLM) -> None:
    assert llm.apply_chat_template(MESSAGES) == "<|user|>hi</s><|assistant|>"
    off = llm.apply_chat_template(MESSAGES, {"enable_thinking": False})
    assert off == "<|user|>hi</s><|assistant|><n>"
    bare = llm.apply_chat_template(MESSAGES, {"add_generation_prompt": False})
    assert bare == "<|user|>hi</s>"
    params = SamplingParams(max_tokens=2, temperature=0)
    out = llm.chat([MESSAGES], params, chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt_token_ids == llm.tokenizer(off, add_special_tokens=False).input_ids
    streamed = list(
        llm.stream_chat([MESSAGES], params, chat_template_kwargs={"enable_thinking": False})
    )
    assert streamed[-1].output is not None
    assert streamed[-1].output.prompt_token_ids == out.prompt_token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (["enable_thinking"], "must be a dict of names to values"),
        ({"not a name": 1}, "must be a dict of names to values"),
        ({"tokenize": True}, "cannot set tokenize"),
    ],
)
def test_bad_kwargs_are_refused_by_name(llm: LLM, kwargs: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.chat([MESSAGES], chat_template_kwargs=kwargs)  # type: ignore[arg-type]


def test_a_batch_line_takes_them_with_its_messages(llm: LLM) -> None:
    line = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    parsed = parse_line(1, json.dumps(line), {"max_tokens": 4}, is_text_file=False)
    assert parsed.error is None
    assert line_prompt(llm, parsed) == ("<|user|>hi</s><|assistant|><n>", False)
    no_messages = {"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}
    bad = parse_line(2, json.dumps(no_messages), {}, is_text_file=False)
    assert bad.error == "line 2: chat_template_kwargs needs messages"
    line["chat_template_kwargs"] = {"tokenize": True}
    bad = parse_line(3, json.dumps(line), {}, is_text_file=False)
    assert bad.error is not None and "cannot set tokenize" in bad.error
