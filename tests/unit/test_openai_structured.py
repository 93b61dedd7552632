"""Structured outputs in OpenAI bodies: response_format and vLLM's guided_* fields -> the
gRPC Constraint, on chat and completions; bad shapes and bad schemas/regexes name the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.engine.grammar import Constraint
from tandem.services.router.openai import protocol as oai
from tandem.services.router.openai import structured as structured
from tandem.v1 import router_pb2 as rpb

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
COMPACT = json.dumps(SCHEMA, separators=(",", ":"), sort_keys=True)


def parse(chat: bool, **body: Any) -> oai.ParsedRequest:
    if chat:
        full = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
        return oai.parse_chat(full, MODEL, 100)
    return oai.parse_completion({"model": MODEL, "prompt": "p", **body}, MODEL, 100)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize(
    ("body", "want"),
    [
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
            rpb.Constraint(json_schema=COMPACT),
        ),
        ({"response_format": {"type": "json_object"}}, rpb.Constraint(json_object=True)),
        ({"guided_json": SCHEMA}, rpb.Constraint(json_schema=COMPACT)),
        ({"guided_json": json.dumps(SCHEMA)}, rpb.Constraint(json_schema=COMPACT)),
        ({"guided_regex": "[0-9]+"}, rpb.Constraint(regex="[0-9]+")),
        ({"guided_choice": ["a", "b"]}, rpb.Constraint(choice=rpb.Choices(choices=["a", "b"]))),
        ({"guided_grammar": 'root ::= "x"'}, rpb.Constraint(grammar='root ::= "x"')),
    ],
)  # fmt: skip
def test_fields_map_to_the_constraint(chat: bool, body: dict[str, Any], want: Any) -> None:
    sampling = parse(chat, **body).request.sampling
    assert sampling.HasField("constraint") and sampling.constraint == want


def test_text_format_and_no_field_mean_free_text() -> None:
    for body in ({}, {"response_format": {"type": "text"}}):
        assert not parse(True, **body).request.sampling.HasField("constraint")


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"response_format": "json"}, "response_format", "must be an object, got string"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
         "must be an object with the schema, got null"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "JSON Schema object, got null"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"schema": {}, "strict": "yes"}}},
         "response_format.json_schema.strict", "boolean, got string"),
        ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
        ({"guided_json": [1]}, "guided_json", "JSON Schema object, got array"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        ({"guided_choice": ["a", 3]}, "guided_choice", "non-empty strings only"),
        ({"guided_regex": 5}, "guided_regex", "non-empty string, got integer"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice",
         "one constraint at a time, got guided_regex, guided_choice"),
    ],
)  # fmt: skip
def test_bad_shapes_are_400s_naming_the_field(body: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(oai.ApiError) as info:
        parse(True, **body)
    err = info.value
    assert (err.status, err.param) == (400, param)
    assert err.message.startswith(f"{param}: ") and says in err.message


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_json": {"type": "frob"}}, "guided_json", "Invalid type: frob"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"schema": {"$ref": "#/defs/x"}}}},
         "response_format.json_schema.schema", "does not exist"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar", "Rule 'missing' not found"),
    ],
)  # fmt: skip
def test_a_schema_regex_or_grammar_that_does_not_compile_names_the_field(
    body: dict[str, Any], param: str, says: str
) -> None:
    parse(False, **body)  # the shape is fine: the parser leaves compiling to the HTTP edge
    found = structured.read(body)
    assert found is not None and found[1] == param
    error = structured.compile_constraint(*found)
    assert isinstance(error, structured.FieldError)
    assert error.param == param and says in error.reason
    compiled = structured.compile_constraint(rpb.Constraint(regex="[0-9]+"), "guided_regex")
    assert isinstance(compiled, Constraint) and compiled.spec == "[0-9]+"
