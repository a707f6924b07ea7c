"""Structured outputs: greedy output under a JSON schema, any JSON object, a regex, a choice or
an EBNF grammar equals transformers' greedy `generate` with xgrammar's own logits processor
for the same grammar, token for token, with the cache on and off; answers hold to their
structure when sampled, preempted or streamed; bad structures are refused by name."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from xgrammar.contrib.hf import LogitsProcessor as XGrammarProcessor

from kvcache import LLM, SamplingParams, StructuredOutputsParams
from runner.cli.batch.file import parse_line

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"
YES_NO = 'root ::= answer "."\nanswer ::= "Yes" | "No"'
CASES: list[tuple[str, StructuredOutputsParams]] = [
    ("Describe Ann, aged 31, who has a cat, as JSON.", StructuredOutputsParams(json=PERSON)),
    ("List three colours as a JSON object.", StructuredOutputsParams(json_object=True)),
    ("When did the Berlin Wall fall?", StructuredOutputsParams(regex=DATE)),
    ("Is the sea salty?", StructuredOutputsParams(choice=["yes", "no", "it depends"])),
    ("Is fire cold?", StructuredOutputsParams(grammar=YES_NO)),
]


def holds(text: str, structure: StructuredOutputsParams) -> bool:
    """Whether a finished answer is a sentence of its structure."""
    if structure.json is not None:
        value = json.loads(text)
        return (
            set(value) == {"name", "age", "pets"}
            and isinstance(value["name"], str)
            and len(value["name"]) <= 12
            and isinstance(value["age"], int)
            and set(value["pets"]) <= {"cat", "dog"}
        )
    if structure.json_object:
        return isinstance(json.loads(text), dict)
    if structure.regex is not None:
        return re.fullmatch(structure.regex, text) is not None
    if structure.choice is not None:
        return text in structure.choice
    return text in ("Yes.", "No.")


@pytest.fixture(scope="module")
def default_llm(default_model_dir: Path) -> LLM:
    return LLM(str(default_model_dir))


@pytest.fixture(scope="module")
def reference(default_model_dir: Path, default_llm: LLM) -> list[list[int]]:
    """transformers' unbatched greedy generate, masked by xgrammar's processor for each case's
    grammar (compiled by the engine's own compiler, so against the same vocabulary)."""
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    eos = sorted(default_llm.eos_ids)
    outputs = []
    for question, structure in CASES:
        prompt = default_llm.apply_chat_template([{"role": "user", "content": question}])
        ids = default_llm.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        processor = XGrammarProcessor(default_llm.grammars.compile(structure))
        out = hf.generate(
            **ids,
            max_new_tokens=48,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            logits_processor=[processor],
        )
        outputs.append(out[0, ids.input_ids.shape[1] :].tolist())
    return outputs


@pytest.mark.parametrize("cache", [True, False])
def test_structured_greedy_equals_transformers_with_xgrammar(
    default_model_dir: Path, default_llm: LLM, reference: list[list[int]], cache: bool
) -> None:
    llm = default_llm if cache else LLM(str(default_model_dir), enable_prefix_caching=False)
    conversations = [[{"role": "user", "content": q}] for q, _ in CASES]
    params = [SamplingParams(max_tokens=48, temperature=0, structured_outputs=s) for _, s in CASES]
    outs = llm.chat(conversations, params)
    for out, ref, (_, structure) in zip(outs, reference, CASES, strict=True):
        assert out.token_ids[: len(ref)] == ref  # transformers keeps EOS: ours drops it too
        assert out.finish_reason == "stop" and holds(out.text, structure), out.text


def test_sampled_answers_hold_their_structure(default_llm: LLM) -> None:
    """Several samples each, at a high temperature, all inside their grammars."""
    conversations = [[{"role": "user", "content": q}] for q, _ in CASES]
    params = [
        SamplingParams(max_tokens=64, temperature=1.2, seed=i, n=3, structured_outputs=s)
        for i, (_, s) in enumerate(CASES)
    ]
    stopped = 0
    for out, (_, structure) in zip(default_llm.chat(conversations, params), CASES, strict=True):
        for sample in out.outputs:
            if sample.finish_reason == "stop":  # "length" may cut a rambling JSON object short
                assert holds(sample.text, structure), sample.text
                stopped += 1
    assert stopped >= 10


def test_structure_survives_preemption_and_streams(tiny_llama_tok_dir: Path) -> None:
    """A tiny random model on a pool so small that requests are preempted: the grammar state
    is the output's, so recomputing the prompt changes nothing; a stream adds up."""
    llm = LLM(str(tiny_llama_tok_dir), num_kv_blocks=14, block_size=4)
    structure = StructuredOutputsParams(regex=r"(ab|c[de])+!")
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=4, structured_outputs=structure)
    prompts = [[5 + i] * (6 + i) for i in range(6)]
    outs = llm.generate(prompts, params)
    assert llm.scheduler.num_preemptions > 0
    for out in outs:
        if out.finish_reason == "stop":
            assert re.fullmatch(r"(ab|c[de])+!", out.text), out.text
        else:  # cut by max_tokens, but inside the grammar all the way
            assert re.fullmatch(r"(ab|c[de])*[ac]?", out.text), out.text
    alone = LLM(str(tiny_llama_tok_dir)).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    streamed = "".join(d.text for d in llm.stream(prompts[:1], params))
    assert streamed == alone[0].text


def test_ignore_eos_still_ends_at_the_end_of_the_grammar(tiny_llama_tok_dir: Path) -> None:
    llm = LLM(str(tiny_llama_tok_dir))
    structure = StructuredOutputsParams(choice=["alpha", "beta"])
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], dataclasses.replace(params, structured_outputs=structure))[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"


@pytest.mark.parametrize(
    ("structure", "message"),
    [
        ({"json": {"type": "object", "properties": 5}}, "the json does not compile"),
        ({"regex": "(ab"}, "the regex does not compile"),
        ({"grammar": "root ::= "}, "the grammar does not compile"),
        ({"grammar": 'root ::= root "a"'}, "the structure admits no answer at all"),
    ],
)
def test_a_structure_that_does_not_compile_fails_alone(
    default_llm: LLM, structure: dict[str, Any], message: str
) -> None:
    good = SamplingParams(max_tokens=4, temperature=0)
    bad = dataclasses.replace(good, structured_outputs=StructuredOutputsParams(**structure))
    with pytest.raises(ValueError, match=message):
        default_llm.generate(["a", "b"], [good, bad])
    assert not default_llm.has_unfinished()
    assert len(default_llm.generate(["a"], good)[0].token_ids) == 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "choice must be a non-empty list"),
        ({"json": 5}, "json must be a JSON schema"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json": {"default": {1, 2}}}, "json schema is not JSON"),
    ],
)
def test_bad_structures_are_refused_by_name(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**fields)


def test_structure_with_rules_that_could_ban_its_every_token_is_refused() -> None:
    structure = StructuredOutputsParams(regex="a+")
    for fields in ({"min_tokens": 2}, {"allowed_token_ids": [5]}):
        with pytest.raises(ValueError, match="cannot be combined with min_tokens"):
            SamplingParams(structured_outputs=structure, **fields)
    with pytest.raises(ValueError, match="must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a+"})  # type: ignore[arg-type]


def test_a_model_without_tokenizer_refuses_structures(tiny_llama_dir: Path) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="need a tokenizer"):
        LLM(str(tiny_llama_dir)).generate([[5, 6]], params)


def test_batch_file_lines_take_a_structure() -> None:
    def parsed(structure: Any) -> Any:
        return parse_line(
            1, json.dumps({"prompt": "hi", "structured_outputs": structure}), {}, False
        )

    assert parsed({"json": PERSON}).params.structured_outputs == StructuredOutputsParams(
        json=PERSON
    )
    assert parsed({"regx": "a"}).error == "line 1: structured_outputs has no field 'regx'"
    assert "exactly one of" in parsed({"regex": "a", "choice": ["b"]}).error
    assert "must be StructuredOutputsParams" in parsed("a+").error


def test_an_engine_without_structured_requests_never_imports_xgrammar(
    tiny_llama_tok_dir: Path,
) -> None:
    """xgrammar takes ~1.7 s to import: only a structured request may pay for it. An engine
    that is built and runs plain requests (greedy and sampled) never imports it."""
    import subprocess
    import sys

    code = (
        "import sys; from kvcache import LLM, SamplingParams; "
        f"llm = LLM({str(tiny_llama_tok_dir)!r}); "
        "llm.generate(['hi', 'yo'], [SamplingParams(max_tokens=3, temperature=0), "
        "SamplingParams(max_tokens=3, temperature=0.8)]); "
        "print('xgrammar' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip().splitlines()[-1] == "False", result.stderr


def test_an_answer_keeps_the_schemas_property_order(default_llm: LLM) -> None:
    """Properties come out in the schema's order, as vLLM's do (before: alphabetical, the
    schema having been serialised with sorted keys); the same properties in another order are
    another grammar."""
    llm = default_llm
    orders = (["zeta", "alpha", "mid"], ["alpha", "mid", "zeta"])
    for order in orders:
        schema = {
            "type": "object",
            "properties": {name: {"type": "integer"} for name in order},
            "required": order,
            "additionalProperties": False,
        }
        spec = StructuredOutputsParams(json=schema)
        params = SamplingParams(max_tokens=200, temperature=0, structured_outputs=spec)
        out = llm.generate(["Three numbers as a JSON object: "], params)[0]
        keys = re.findall(r'"(\w+)"\s*:', out.text)  # in the order written (a cut answer too)
        assert keys and keys == order[: len(keys)], out.text
