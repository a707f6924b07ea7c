"""`response_format` of type `structural_tag` (vLLM's structured_outputs example): free text
until a trigger, then the structure's schema between its begin and end; as vLLM takes it
(structures and triggers) and in xgrammar's newer form (format). A malformed one is a 400."""

from __future__ import annotations

import httpx
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from runner.serve.structured import ResponseFormat, structural_tag_grammar
from tests.serve.conftest import LiveServer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}],
    "triggers": ["<function="],
}


def accepts(fmt: dict, text: str) -> bool:
    grammar = xgrammar.Grammar.from_ebnf(structural_tag_grammar(ResponseFormat(**fmt)))
    return bool(_is_grammar_accept_string(grammar, text))


def test_the_grammar_holds_the_structure_and_frees_the_rest() -> None:
    good = 'Let me look. <function=get_weather>{"city": "Paris"}</function> Done.'
    assert accepts(TAG, good)
    assert accepts(TAG, "No call at all.")
    assert not accepts(TAG, '<function=get_weather>{"town": "Paris"}</function>')
    newer = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<function="],
            "tags": [
                {
                    "begin": "<function=get_weather>",
                    "content": {"type": "json_schema", "json_schema": WEATHER},
                    "end": "</function>",
                }
            ],
        },
    }
    assert accepts(newer, good)
    assert not accepts(newer, '<function=get_weather>{"city": 3}</function>')


def test_served(server: LiveServer) -> None:
    body = {"model": "tiny", "prompt": "Weather?", "max_tokens": 12, "temperature": 0}
    ok = httpx.post(f"{server.url}/v1/completions", json={**body, "response_format": TAG})
    assert ok.status_code == 200, ok.text
    bad = httpx.post(
        f"{server.url}/v1/completions",
        json={**body, "response_format": {"type": "structural_tag", "triggers": ["<f="]}},
    )
    assert bad.status_code == 400, bad.text
    assert "structures and triggers" in bad.json()["error"]["message"]
