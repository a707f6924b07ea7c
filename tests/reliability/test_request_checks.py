"""Request fields that were let through or refused wrongly (issue 24, item 12): stop_token_ids
outside the vocabulary and an empty stop string are refused by name; numpy integer token ids
are token ids; a JSON schema or grammar with no finite answer is refused when the request is
added, as the README says, instead of running every answer to max_tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvcache import LLM, SamplingParams
from runner.sampling.structured_outputs import StructuredOutputsParams

ENDLESS_SCHEMA = {
    "type": "object",
    "properties": {"next": {"$ref": "#"}},
    "required": ["next"],
}
LIST_SCHEMA = {  # recursive too, but a null ends each chain: it has answers
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["v", "next"],
        }
    },
    "$ref": "#/$defs/node",
}


def test_stop_token_ids_outside_the_vocabulary(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    with pytest.raises(ValueError, match=r"stop_token_ids names token 320, outside .*\[0, 320\)"):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=2, stop_token_ids=[4, 320]))
    assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=2, stop_token_ids=[319]))) == 1


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="stop must not hold an empty string"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="stop must not hold an empty string"):
        SamplingParams(stop=["end", ""])
    assert SamplingParams(stop="").stop_strings == ()  # a plain "" is no stop string, as before


def test_numpy_token_ids_are_token_ids(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=3, temperature=0)
    plain = llm.generate([5, 6, 7], params)[0].token_ids
    ids = np.array([5, 6, 7], dtype=np.int64)
    assert llm.generate(list(ids), params)[0].token_ids == plain  # one prompt of np.int64
    assert llm.generate([list(ids.astype(np.int32))], params)[0].token_ids == plain
    with pytest.raises(ValueError, match="not an integer"):
        llm.generate([[5, np.float32(6.0), 7]], params)


def test_a_structure_with_no_finite_answer_is_refused(tiny_llama_tok_dir: Path) -> None:
    from runner.sampling.grammar_finite import has_finite_answer

    llm = LLM(str(tiny_llama_tok_dir))
    endless = [
        StructuredOutputsParams(json=ENDLESS_SCHEMA),
        StructuredOutputsParams(grammar='root ::= "a" root'),
    ]
    for structure in endless:
        with pytest.raises(ValueError, match="no finite answer"):
            llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=structure))
    finite = [
        StructuredOutputsParams(json=LIST_SCHEMA),
        StructuredOutputsParams(grammar='root ::= "a" | "(" root ")"'),
        StructuredOutputsParams(regex="a+b?[cd]{2,3}"),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(choice=["yes", "no"]),
    ]
    for structure in finite:  # read, not let through as unreadable
        assert has_finite_answer(str(llm.grammars.compile(structure).grammar)) is True
        out = llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=structure))
        assert len(out[0].token_ids) >= 1
