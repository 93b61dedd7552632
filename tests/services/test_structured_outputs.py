"""Structured outputs end to end on `tandem up` (router, prefill and decode worker processes):
JSON schemas, regexes, choices and grammars hold over the real `openai` client and gRPC,
colocated and disaggregated, streamed and not; the prefill worker's token 1 obeys the grammar
and the decode worker continues it token-identically to the single-process engine; bad
constraints are refused before any work; a grammar that cannot finish ends with "length"."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from tandem.client import TandemClient, TandemError
from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.grammar import Constraint, ConstraintKind
from tandem.engine.sampling import SamplingParams
from tandem.services.up import Cluster
from tests.services.conftest import KV_BYTES
from tests.services.workers import assert_all_free

SCHEMAS: list[dict[str, Any]] = [
    {  # flat, required fields, an enum, a bounded integer
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    {  # nested object and an array with bounds
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -50, "maximum": 50},
                    "y": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["point", "tags"],
        "additionalProperties": False,
    },
    {  # booleans, a bounded number, a const and an array of enums
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "version": {"const": 2},
            "days": {
                "type": "array",
                "items": {"enum": ["mon", "tue", "wed"]},
                "maxItems": 2,
            },
        },
        "required": ["ok", "version", "days"],
        "additionalProperties": False,
    },
]


# Each prompt is new (never a prefix-cache hit) and the same in every run, so that a greedy
# answer, and whether it passes, depends on the code and not on the prompt drawn (a random
# uuid here once drew a "1.000..." whose digits ran to max_tokens: MAX_JSON_DIGIT_RUN now).
_TAGS = random.Random(27)


def _tag() -> str:
    return f"{_TAGS.getrandbits(128):032x}"


def long_prompt() -> str:
    """Over the router's 64 uncached tokens and new each time: disaggregated."""
    tag = _tag()
    return f"{tag} " + " ".join(f"record {i} of the table {tag}, then" for i in range(30))


def short_prompt() -> str:
    return f"Describe it ({_tag()[:6]}):"


PROMPTS = {"colocated": short_prompt, "disaggregated": long_prompt}


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> LLMEngine:
    """The single-process engine on the same weights and cache geometry."""
    return LLMEngine(
        EngineConfig(
            model_dir=cluster.config.model_dir,
            dtype="float32",
            cache=CacheConfig(kv_cache_bytes=KV_BYTES),
        )
    )


def chat(client: openai.OpenAI, prompt: str, stream: bool, **kwargs: Any) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion, streamed or not."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        answer = client.chat.completions.create(model="", messages=messages, **kwargs)
        choice = answer.choices[0]
        return choice.message.content or "", str(choice.finish_reason)
    text, reason = "", ""
    for chunk in client.chat.completions.create(model="", messages=messages, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", list(PROMPTS))
def test_json_schemas_hold_over_the_openai_client(
    client: openai.OpenAI, path: str, stream: bool
) -> None:
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        if i % 2:
            fmt["json_schema"]["strict"] = True
        text, reason = chat(
            client, PROMPTS[path](), stream, response_format=fmt, max_tokens=300,
            temperature=0.0 if i else 1.0, seed=i,
        )  # fmt: skip
        assert reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)
    text, reason = chat(
        client, PROMPTS[path](), stream, response_format={"type": "json_object"},
        max_tokens=300, temperature=0.0,
    )  # fmt: skip
    if reason == "stop":  # any object may be long; when it ended, it is one
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("path", list(PROMPTS))
def test_regex_choice_and_grammar_hold_on_completions(client: openai.OpenAI, path: str) -> None:
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}, r"[A-Z][a-z]{2,5} [0-9]{2}"),
        ({"guided_choice": ["north", "south", "east west"]}, ("north", "south", "east west")),
        ({"guided_grammar": 'root ::= "(" [0-9] ("," [0-9])* ")"'}, r"\([0-9](,[0-9])*\)"),
    ]
    for extra, want in cases:
        for temperature in (0.0, 1.0):
            out = client.completions.create(
                model="", prompt=PROMPTS[path](), max_tokens=60, temperature=temperature,
                seed=5, extra_body=extra,
            ).choices[0]  # fmt: skip
            if isinstance(want, tuple):
                assert out.text in want, (extra, out.text)
            elif extra.get("guided_grammar") and out.finish_reason == "length":
                assert re.fullmatch(r"\([0-9](,[0-9])*,?", out.text), out.text  # a prefix
            else:
                assert re.fullmatch(want, out.text), (extra, out.text)
                assert out.finish_reason == "stop"


def test_the_handoff_keeps_the_grammar_token_identical_to_one_engine(
    grpc_client: TandemClient, reference: LLMEngine
) -> None:
    """Token 1 is sampled by the prefill worker under the grammar (an unconstrained token 1
    is not a digit here, so a prefill worker that ignored the constraint fails this), and
    the decode worker resumes the grammar after it: the same tokens as the single engine."""
    pattern = "[0-9]{8}"
    cases = [
        ({"regex": pattern}, Constraint(ConstraintKind.REGEX, pattern), {"temperature": 0.0}),
        ({"regex": pattern}, Constraint(ConstraintKind.REGEX, pattern), {"seed": 11}),
        (
            {"json_schema": SCHEMAS[0]},
            Constraint.json_schema(SCHEMAS[0]),
            {"temperature": 0.8, "seed": 3},
        ),
    ]
    for i, (wire, constraint, sampling) in enumerate(cases):
        # Fixed (the check below is deterministic) and new to the cluster: disaggregated.
        prompt = f"hand-off case {i}: " + " ".join(f"row {j} of {i}, then" for j in range(30))
        free = reference.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
        got = grpc_client.generate(prompt, max_tokens=80, **wire, **sampling)
        assert got.disaggregated, got.route_reason
        params = SamplingParams(max_tokens=80, constraint=constraint, **sampling)
        [want] = reference.generate([prompt], params)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == "stop"
        assert got.token_ids[0] != free.token_ids[0], "the free token 1 would also have done"
        if "regex" in wire:
            assert re.fullmatch(pattern, got.text)
        else:
            jsonschema.validate(json.loads(got.text), SCHEMAS[0])


def test_bad_constraints_are_refused_before_any_work(
    cluster: Cluster, client: openai.OpenAI, grpc_client: TandemClient
) -> None:
    bad_http: list[tuple[dict[str, Any], str]] = [
        ({"extra_body": {"guided_regex": "[0-9"}}, "guided_regex: "),
        ({"extra_body": {"guided_json": {"type": "frob"}}}, "guided_json: Invalid type: frob"),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
            "response_format.json_schema.schema: ",
        ),
        ({"extra_body": {"guided_choice": []}}, "guided_choice: must be a non-empty list"),
    ]  # fmt: skip
    for kwargs, says in bad_http:
        with pytest.raises(openai.BadRequestError) as err:
            chat(client, long_prompt(), False, max_tokens=4, **kwargs)
        assert says in err.value.message, err.value.message
    for wire, says in (
        ({"regex": "a(b"}, "sampling.constraint.regex: "),
        ({"json_schema": "{"}, "sampling.constraint.json_schema: not valid JSON"),
        ({"grammar": "start: nowhere"}, "sampling.constraint.grammar: "),
    ):
        with pytest.raises(TandemError) as error:
            grpc_client.generate(long_prompt(), max_tokens=4, **wire)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.message.startswith(says), error.value.message
    assert_all_free(cluster)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_grammar_that_cannot_finish_ends_with_length(client: openai.OpenAI, stream: bool) -> None:
    for prompt in (short_prompt(), long_prompt()):
        text, reason = chat(
            client, prompt, stream, max_tokens=6, temperature=0.0,
            extra_body={"guided_regex": "[a-z]{200}"},
        )  # fmt: skip
        assert reason == "length"
        assert re.fullmatch("[a-z]+", text), text
