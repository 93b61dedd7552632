"""The Responses API's rules (services/router/openai/responses.py): bodies -> the chat request,
refusals naming the field, and the response object and events. Exact, no I/O."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.services.router.openai import protocol as oai
from tandem.services.router.openai import responses as responses
from tandem.v1 import router_pb2 as rpb

MODEL = "m"
DEFAULT_MAX = 100


def parse(**body: Any) -> responses.ResponsesRequest:
    return responses.parse({"model": MODEL, "input": "hi", **body}, MODEL, DEFAULT_MAX)


def refusal(**body: Any) -> oai.ApiError:
    with pytest.raises(oai.ApiError) as err:
        parse(**body)
    assert err.value.status == 400
    return err.value


def wire(parsed: responses.ResponsesRequest) -> list[tuple[str, str, str, list[str]]]:
    return [
        (m.role, m.content, m.tool_call_id, [f"{c.id}:{c.function.name}" for c in m.tool_calls])
        for m in parsed.request.chat.messages
    ]


def test_a_string_input_with_instructions_and_sampling() -> None:
    parsed = parse(instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9,
                   metadata={"k": "v"}, user="u")  # fmt: skip
    assert wire(parsed) == [("system", "Be brief.", "", []), ("user", "hi", "", [])]
    s = parsed.request.sampling
    assert (s.max_tokens, s.temperature, s.top_p) == (7, 0.5, pytest.approx(0.9))
    assert (parsed.stream, parsed.max_output_tokens, parsed.metadata) == (False, 7, {"k": "v"})
    assert not s.HasField("constraint") and parsed.text_format == {"type": "text"}


def test_the_chat_api_s_sampling_extensions() -> None:
    s = parse(seed=4, stop=["END"], top_k=3, min_p=0.1, ignore_eos=True,
              logit_bias={"7": -100}, frequency_penalty=0.5).request.sampling  # fmt: skip
    assert (s.seed, list(s.stop), s.top_k, s.ignore_eos, dict(s.logit_bias)) == (
        4, ["END"], 3, True, {7: -100.0},
    )  # fmt: skip
    assert (s.min_p, s.frequency_penalty) == (pytest.approx(0.1), 0.5)


def test_defaults_leave_the_engine_defaults() -> None:
    parsed = responses.parse({"input": "hi"}, MODEL, DEFAULT_MAX)
    s = parsed.request.sampling
    assert s.max_tokens == DEFAULT_MAX
    assert not s.HasField("temperature") and not s.HasField("top_p")
    assert parsed.request.model == "" and parsed.instructions is None


def test_input_items_with_a_function_call_round_trip() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Sunny at noon."}]},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    assert wire(parse(input=items)) == [
        ("user", "Weather in Paris?", "", []),
        ("assistant", "", "", ["c1:weather", "c2:time"]),  # consecutive calls: one turn
        ("tool", "sunny", "c1", []),
        ("tool", "noon", "c2", []),
        ("assistant", "Sunny at noon.", "", []),
        ("user", "Thanks", "", []),
    ]


def test_text_format_json_schema_is_a_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    parsed = parse(text={"format": fmt})
    assert parsed.constraint is not None
    constraint, param = parsed.constraint
    assert json.loads(constraint.json_schema) == schema and param == "text.format.schema"
    assert parsed.request.sampling.constraint == constraint
    assert parsed.text_format == fmt
    assert parse(text={"format": {"type": "json_object"}}).request.sampling.constraint.json_object


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "non-empty list of input items"),
        ({"input": 5}, "input", "non-empty list of input items"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "got 'wizard'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0]", "only text parts"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type", "got 'reasoning'"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
         "input[0].call_id", "'c9' answers no tool call"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": 3}]},
         "input[0].output", "must be a string, got integer"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
         "input[0].arguments", "must be a string, got null"),
        ({"instructions": 3}, "instructions", "must be a string"),
        ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"temperature": 3}, "temperature", "at most 2"),
        ({"tools": [{"type": "function", "name": "f f"}]}, "tools[0].name", "1-64 of"),
        ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function",
          "name": "g"}}, "tool_choice.name", "'g' is not a tool"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
        ({"background": True}, "background", "not supported"),
        ({"truncation": "auto"}, "truncation", "disabled"),
        ({"top_logprobs": 2}, "top_logprobs", "not supported"),
        ({"metadata": {"k": 1}}, "metadata", "strings to strings"),
        ({"text": {"format": {"type": "json_schema", "schema": 5}}}, "text.format.schema",
         "must be a JSON Schema object"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "got 'xml'"),
        ({"response_format": {"type": "json_object"}}, "response_format", "unknown parameter"),
        ({"guided_regex": "a+"}, "guided_regex", "unknown parameter"),
        ({"n": 2}, "n", "unknown parameter"),
        ({"seed": "x"}, "seed", "must be an integer"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(body: dict[str, Any], param: str, says: str) -> None:
    err = refusal(**body)
    assert err.param == param and says in err.message, err.message


def test_the_whole_response() -> None:
    reply = responses.Reply(parse(max_output_tokens=3), MODEL, id="resp_1", message_id="msg_1",
                            created_at=9)  # fmt: skip
    usage = rpb.Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=4)
    complete = rpb.Complete(finish_reason=rpb.FINISH_REASON_LENGTH, usage=usage)
    out = reply.whole([rpb.Chunk(text="Pa"), rpb.Chunk(text="ris")], complete)
    assert (out["id"], out["object"], out["created_at"], out["model"]) == (
        "resp_1", "response", 9, MODEL,
    )  # fmt: skip
    assert (out["status"], out["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"},
    )  # fmt: skip
    assert out["output"] == [{
        "type": "message", "id": "msg_1", "status": "incomplete", "role": "assistant",
        "content": [{"type": "output_text", "text": "Paris", "annotations": []}],
    }]  # fmt: skip
    assert out["usage"] == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8,
    }  # fmt: skip
    assert (out["max_output_tokens"], out["temperature"], out["top_p"]) == (3, 1.0, 1.0)


def test_the_event_stream_in_order() -> None:
    reply = responses.Reply(parse(), MODEL, id="resp_1", message_id="msg_1")
    events = reply.opening()
    events += [reply.delta(rpb.Chunk(text=t)) for t in ("Pa", "ris")]
    events += reply.closing(rpb.Complete(finish_reason=rpb.FINISH_REASON_STOP))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(10))
    assert events[0]["response"]["status"] == "in_progress" and not events[0]["response"]["output"]
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    assert events[4] == {"type": "response.output_text.delta", "sequence_number": 4, **at,
                         "delta": "Pa", "logprobs": []}  # fmt: skip
    assert events[6]["text"] == "Paris"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Paris"


def test_an_error_after_the_start_is_an_error_event() -> None:
    reply = responses.Reply(parse(), MODEL)
    event = reply.error(oai.ApiError(503, "no worker", "service_unavailable", code="unavailable"))
    assert event == {"type": "error", "sequence_number": 0, "code": "unavailable",
                     "message": "no worker", "param": None}  # fmt: skip
