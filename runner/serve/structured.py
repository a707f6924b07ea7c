"""The request fields that hold an answer to a shape, as OpenAI's API and vLLM's server name
them, read into one StructuredOutputsParams: OpenAI's `response_format` (json_schema,
json_object), vLLM's `structured_outputs` object (json, json_object, regex, choice, grammar)
and its older `guided_json` / `guided_choice` / `guided_regex` / `guided_grammar`. A request
may give one of them; two that disagree are a 400 naming both."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from runner.sampling.structured_outputs import StructuredOutputsParams
from runner.serve.messages import Lenient

GUIDED = ("guided_json", "guided_choice", "guided_regex", "guided_grammar")


class JsonSchema(Lenient):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TagStructure(Lenient):
    """One structure of a structural tag: text between `begin` and `end` holds to `schema`."""

    begin: str
    schema_: dict[str, Any] = Field(alias="schema")
    end: str


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchema | None = None
    # structural_tag, as vLLM takes it: free text until a trigger opens one of the structures
    # (their `begin` starts with it), whose body holds to its schema, then free text again;
    # or xgrammar's newer form whole, under `format`.
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class StructuredOutputs(Lenient):
    """vLLM's `structured_outputs` request object (what the `openai` client sends in
    `extra_body`); its other keys (backend options) are ignored with a warning."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False  # JSON with no whitespace but one space per separator


class StructureFields(Lenient):
    """The structure fields a request may carry (both endpoints)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_choice: list[str] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # vLLM's; one backend here (xgrammar)
    guided_whitespace_pattern: str | None = None  # vLLM's; accepted, changes nothing

    def structure(self) -> StructuredOutputsParams | None:
        """The one structure the request asks for, None for none; ValueError naming the
        field when one is malformed or two are given."""
        given = {
            name: spec
            for name, spec in (
                ("response_format", self._response_format()),
                ("structured_outputs", self._structured_outputs()),
                *((name, self._guided(name)) for name in GUIDED),
            )
            if spec is not None
        }
        if len(given) > 1:
            names = " and ".join(given)
            raise ValueError(f"{next(iter(given))}: give one structure, not {names}")
        return next(iter(given.values()), None)

    def structure_field(self) -> str:
        """The field the request's structure is given in (for an error about it)."""
        names = ("response_format", "structured_outputs", *GUIDED)
        return next((n for n in names if getattr(self, n) is not None), "structured_outputs")

    def _response_format(self) -> StructuredOutputsParams | None:
        """json_schema holds the answer to the schema, json_object to any JSON object; "text"
        (or none) leaves it free."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.type == "structural_tag":
            return StructuredOutputsParams(grammar=structural_tag_grammar(fmt))
        if fmt.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        spec = self.structured_outputs
        if spec is None:
            return None
        if spec.disable_any_whitespace and (spec.json_ is not None or spec.json_object):
            schema = spec.json_ if spec.json_ is not None else {"type": "object"}
            grammar = compact_json_grammar(schema, "structured_outputs.json")
            return StructuredOutputsParams(grammar=grammar)
        try:
            return StructuredOutputsParams(
                json=spec.json_,
                json_object=bool(spec.json_object),
                regex=spec.regex,
                choice=spec.choice,
                grammar=spec.grammar,
            )
        except ValueError as err:
            raise ValueError(f"structured_outputs: {err}") from err

    def _guided(self, name: str) -> StructuredOutputsParams | None:
        value = getattr(self, name)
        if value is None:
            return None
        kind = name.removeprefix("guided_")
        try:
            return StructuredOutputsParams(**{kind: value})
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from err


def compact_json_grammar(schema: Mapping[str, object] | str, field: str) -> str:
    """An EBNF grammar (xgrammar's) of the JSON texts `schema` holds, written compactly: one
    space after each separator and no other whitespace. Tool calls are held to it rather than
    to the schema itself, whose grammar takes any whitespace anywhere: a model unsure of the
    next token (a small or untrained one) can pad an argument with tabs until max_tokens, and
    the call is then never complete; vLLM's `disable_any_whitespace` asks for the same.
    ValueError naming `field` for a schema xgrammar cannot read. (xgrammar is imported here,
    only when a request asks for this: it is slow to import.)"""
    import xgrammar

    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        grammar = xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as err:  # what xgrammar raises for a schema
        raise ValueError(f"{field}: no usable JSON schema: {err}") from err
    return str(grammar)


def structural_tag_grammar(fmt: ResponseFormat) -> str:
    """The EBNF grammar of a structural_tag response format (xgrammar builds it); ValueError
    naming response_format when the tag is malformed."""
    import xgrammar

    try:
        if fmt.format is not None:
            grammar = xgrammar.Grammar.from_structural_tag(
                {"type": "structural_tag", "format": fmt.format}
            )
        elif fmt.structures and fmt.triggers:
            tags = [
                xgrammar.StructuralTagItem(begin=s.begin, schema=json.dumps(s.schema_), end=s.end)
                for s in fmt.structures
            ]
            with warnings.catch_warnings():  # vLLM's form is xgrammar's older call, still kept
                warnings.simplefilter("ignore", DeprecationWarning)
                grammar = xgrammar.Grammar.from_structural_tag(tags, fmt.triggers)
        else:
            raise ValueError("type structural_tag needs structures and triggers, or a format")
    except (ValueError, RuntimeError, TypeError) as err:
        raise ValueError(f"response_format: {err}") from err
    return str(grammar)
