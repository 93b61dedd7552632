"""POST /v1/responses against `tandem up` through the real `openai` client's
`responses.create`: the answer equals the gRPC chat answer, streamed events reassemble to
the whole response, a tool round trip in the input and a JSON-schema text.format, colocated
and disaggregated; refusals are 400s naming the field."""

from __future__ import annotations

import json
import uuid

import jsonschema
import openai
import pytest

from tandem.client import TandemClient
from tandem.services.up import Cluster
from tests.services.test_openai_api import Aborted

QUESTION = "What is the capital of France?"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lyon"]}, "sure": {"type": "boolean"}},
    "required": ["city", "sure"],
    "additionalProperties": False,
}


def long_question() -> str:
    """Over the router's 64 uncached tokens and new each time: disaggregated."""
    tag = uuid.uuid4().hex
    return f"{tag} " + " ".join(f"item {i} of the list {tag}, then" for i in range(30))


@pytest.mark.parametrize("question", [QUESTION, "long"], ids=["colocated", "disaggregated"])
def test_a_response_is_the_chat_answer_streamed_or_not(
    client: openai.OpenAI, grpc_client: TandemClient, question: str
) -> None:
    question = long_question() if question == "long" else question
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]
    ref = grpc_client.generate(messages=chat, max_tokens=8, temperature=0.0)
    kwargs = {"model": "", "input": question, "instructions": "Answer briefly.",
              "max_output_tokens": 8, "temperature": 0}  # fmt: skip
    whole = client.responses.create(**kwargs)  # type: ignore[call-overload]
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.output_text == ref.text
    assert whole.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    assert whole.usage is not None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        ref.prompt_tokens, ref.completion_tokens,
    )  # fmt: skip
    events = list(client.responses.create(stream=True, **kwargs))  # type: ignore[call-overload]
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]  # fmt: skip
    assert types[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == ref.text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == ref.text and final.usage is not None
    assert final.usage.output_tokens == ref.completion_tokens


def test_a_tool_round_trip_in_the_input(client: openai.OpenAI, grpc_client: TandemClient) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    ref = grpc_client.generate(messages=chat, max_tokens=6, temperature=0.0)
    out = client.responses.create(
        model="",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],  # fmt: skip
        max_output_tokens=6,
        temperature=0,
    )
    assert out.output_text == ref.text
    assert out.usage is not None and out.usage.input_tokens == ref.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_format_json_schema_holds(client: openai.OpenAI, stream: bool) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    kwargs = {"model": "", "input": long_question(), "max_output_tokens": 300,
              "temperature": 0.8, "text": {"format": fmt}}  # fmt: skip
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))  # type: ignore[call-overload]
        out = events[-1].response  # type: ignore[union-attr]
    else:
        out = client.responses.create(**kwargs)  # type: ignore[call-overload]
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    assert out.text is not None and out.text.format.type == "json_schema"


def test_refusals_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    cases = [
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "tools": [{"type": "function", "name": "f",
                                   "parameters": {"type": "array"}}]}, "tools[0].parameters"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                           "schema": {"type": "nope"}}}}, "text.format.schema"),
    ]  # fmt: skip
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="", **body)  # type: ignore[call-overload]
        assert err.value.param == param, err.value.message


def test_a_client_leaving_a_stream_aborts_the_response(
    cluster: Cluster, client: openai.OpenAI
) -> None:
    with Aborted(cluster):
        stream = client.responses.create(
            model="", input=long_question(), max_output_tokens=2000, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        deltas = 0
        for event in stream:
            deltas += event.type == "response.output_text.delta"
            if deltas == 5:
                break
        stream.close()
