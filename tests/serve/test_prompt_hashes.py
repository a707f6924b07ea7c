"""The router's reading of a request body's prompt (runner/router/prompt_hashes.py): token ids
where it can read them, None (routed by load alone, the replica answering the body) for every
body it cannot, whatever JSON value stands where a field should be."""

from __future__ import annotations

import pytest

from runner.router.prompt_hashes import PromptHasher
from runner.serve.json_types import JSONObject
from tests.conftest import tiny_tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]


def test_prompts_it_can_read() -> None:
    hasher = PromptHasher(tiny_tokenizer())
    text = hasher.token_ids(COMPLETIONS, {"prompt": "Hi"})
    assert text is not None and len(text) >= 2
    assert hasher.token_ids(COMPLETIONS, {"prompt": ["Hi", "there"]}) == text  # the first
    assert hasher.token_ids(COMPLETIONS, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert hasher.token_ids(COMPLETIONS, {"prompt": [[5, 6], [7]]}) == [5, 6]
    assert hasher.token_ids(COMPLETIONS, {"prompt": []}) == []
    chat = hasher.token_ids(CHAT, {"messages": HELLO})
    assert chat is not None and len(chat) > len(text)
    assert hasher.token_ids(CHAT, {"messages": HELLO, "chat_template_kwargs": {}}) == chat


@pytest.mark.parametrize(
    "path, body",
    [
        (COMPLETIONS, {}),
        (COMPLETIONS, {"prompt": None}),
        (COMPLETIONS, {"prompt": 5}),
        (COMPLETIONS, {"prompt": [5, "x"]}),
        (COMPLETIONS, {"prompt": [5, 6.5]}),
        (COMPLETIONS, {"prompt": {"text": "Hi"}}),
        (CHAT, {}),
        (CHAT, {"messages": None}),
        (CHAT, {"messages": "Hello"}),
        (CHAT, {"messages": ""}),
        (CHAT, {"messages": {"role": "user"}}),
        (CHAT, {"messages": []}),
        (CHAT, {"messages": [{"role": "user"}]}),
        (CHAT, {"messages": HELLO, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
        (CHAT, {"messages": HELLO, "chat_template_kwargs": "chat_template"}),
        (CHAT, {"messages": HELLO, "chat_template_kwargs": ["chat_template"]}),
        (CHAT, {"messages": HELLO, "chat_template_kwargs": "other"}),
        (CHAT, {"messages": HELLO, "chat_template_kwargs": 0}),
        (CHAT, {"messages": HELLO, "chat_template_kwargs": 7}),
        (CHAT, {"messages": HELLO, "chat_template_kwargs": []}),
        (CHAT, {"messages": HELLO, "chat_template_kwargs": {"tokenize": True}}),
    ],
)
def test_bodies_it_cannot_read_give_none(path: str, body: JSONObject) -> None:
    assert PromptHasher(tiny_tokenizer()).token_ids(path, body) is None


def test_without_a_tokenizer_only_token_ids_are_read() -> None:
    hasher = PromptHasher(None)
    assert hasher.token_ids(COMPLETIONS, {"prompt": [5, 6]}) == [5, 6]
    assert hasher.token_ids(COMPLETIONS, {"prompt": "Hi"}) is None
    assert hasher.token_ids(CHAT, {"messages": HELLO}) is None
