"""tool_choice "required" holds the answer to an array of calls; each tool's parameters keep
their meaning inside it: `$defs` and `$ref`s (what pydantic emits) resolve as at the tool's
own root, and a recursive `{"$ref": "#"}` means the tool's arguments, not the array. Before,
the first was a 400 ("Cannot find field '$defs'") and the second refused good arguments and
took badly shaped ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import xgrammar as xgr

from runner.model.loader import load_tokenizer, read_config
from runner.sampling.structured_outputs import GrammarBook, StructuredOutputsParams
from runner.serve.structured import compact_json_grammar
from runner.serve.tool_calls import forced_schema
from tests.serve.conftest import ServeFactory

ITEM = {
    "type": "object",
    "properties": {"sku": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["sku", "count"],
}
ORDER = {  # pydantic's shape: the nested model under $defs, referred to from the root
    "type": "function",
    "function": {
        "name": "order",
        "parameters": {
            "$defs": {"Item": ITEM},
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
            "required": ["items"],
        },
    },
}
TREE = {  # recursive: a node's children are nodes, the whole parameters schema again
    "type": "function",
    "function": {
        "name": "tree",
        "parameters": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#"}},
            },
            "required": ["v"],
        },
    },
}


@pytest.fixture(scope="module")
def book(tiny_llama_tok_dir: Path) -> GrammarBook:
    tokenizer = load_tokenizer(tiny_llama_tok_dir, read_config(tiny_llama_tok_dir))
    return GrammarBook(tokenizer, 320, {2})


def accepts(book: GrammarBook, grammar: str, value: Any) -> bool:
    """Whether the grammar takes `value`'s compact JSON whole (then the end of the answer)."""
    text = json.dumps(value, separators=(", ", ": "))
    matcher = xgr.GrammarMatcher(book.compile(StructuredOutputsParams(grammar=grammar)))
    ids = book.tokenizer(text, add_special_tokens=False).input_ids
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(2)


def required_grammar(tools: list[dict[str, Any]]) -> str:
    return compact_json_grammar(forced_schema(tools, "required") or {}, "tools")


def test_defs_and_refs_of_each_tool_stay_valid(book: GrammarBook) -> None:
    grammar = required_grammar([ORDER, TREE])
    good = [{"name": "order", "parameters": {"items": [{"sku": "a1", "count": 2}]}}]
    assert accepts(book, grammar, good)
    assert not accepts(book, grammar, [{"name": "order", "parameters": {"items": [{"sku": 1}]}}])


def test_a_recursive_ref_means_the_tools_arguments(book: GrammarBook) -> None:
    grammar = required_grammar([TREE])
    nested = {"v": 1, "children": [{"v": 2, "children": [{"v": 3}]}]}
    assert accepts(book, grammar, [{"name": "tree", "parameters": nested}])
    as_array = {"v": 1, "children": [[{"name": "tree", "parameters": {"v": 2}}]]}
    assert not accepts(book, grammar, [{"name": "tree", "parameters": as_array}])


def test_a_required_choice_of_a_pydantic_tool_is_served(serve: ServeFactory) -> None:
    # A template that shows the tools in one character: the tiny model's context is short.
    template = "{{ messages[0]['content'] }}{% if tools %}T{% endif %}"
    small = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "$defs": {"N": {"type": "integer"}},
                "properties": {"n": {"$ref": "#/$defs/N"}},
            },
        },
    }
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [small],
        "tool_choice": "required",
        "max_tokens": 8,
    }
    with serve(chat_template=template) as server:
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
