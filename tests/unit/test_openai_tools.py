"""The OpenAI API's tool rules (tandem.services.router.openai.tools, openai_protocol.Answer with
tools): a body's tools on the wire, and the exact chunks and whole answers an answer with
calls makes."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from tandem.services.common.rpc.convert_tools import ChatTools, tools_from_proto, tools_to_proto
from tandem.services.router.grpc_tools import CompleteCalls
from tandem.services.router.openai import answers
from tandem.services.router.openai import protocol as oai
from tandem.services.router.openai import responses as openai_responses
from tandem.services.router.openai.responses_tools import ToolReply
from tandem.tools import FORMATS, ChoiceMode, Tool, ToolChoice
from tandem.v1 import router_pb2 as rpb

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
USER = [{"role": "user", "content": "weather?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def answer(**body: Any) -> answers.Answer:
    parsed = oai.parse_chat({"messages": USER, "tools": TOOLS, **body}, "m", 64)
    parsed = replace(parsed, tool_format=FORMATS["hermes"])
    return answers.Answer("chatcmpl-1", "m", True, parsed, lambda token_id: "")


def complete(reason: rpb.FinishReason = rpb.FINISH_REASON_STOP) -> rpb.Complete:
    return rpb.Complete(finish_reason=reason)


def test_a_body_s_tools_go_on_the_wire() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    parsed = oai.parse_chat(
        {"messages": USER, "tools": TOOLS, "tool_choice": named, "parallel_tool_calls": False},
        "m",
        64,
    )
    assert tools_from_proto(parsed.request.chat) == ChatTools(
        (Tool("get_weather", "", json.dumps(SCHEMA, separators=(",", ":"), sort_keys=True)),),
        ToolChoice(ChoiceMode.FUNCTION, "get_weather"),
        parallel=False,
    )
    assert parsed.tool_names == {"get_weather"}
    none = oai.parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "none"}, "m", 64)
    assert none.tool_names == frozenset()  # the answer is text
    plain = oai.parse_chat({"messages": USER}, "m", 64)
    assert not plain.request.chat.tools and not plain.request.chat.HasField("tool_choice")


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
        ({"tool_choice": "any"}, "tool_choice", "got 'any'"),
        ({"tool_choice": "required", "guided_regex": "a+"}, "tool_choice", "guided_regex"),
        ({"function_call": "auto"}, "function_call", "legacy"),
    ],
)
def test_bad_tool_fields_name_the_field(body: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(oai.ApiError) as err:
        oai.parse_chat({"messages": USER, "tools": TOOLS, **body}, "m", 64)
    assert (err.value.status, err.value.param) == (400, param)
    assert says in err.value.message


def deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in chunks]


def test_streamed_chunks_of_a_call_are_openai_s() -> None:
    a = answer(stream=True)
    pieces = ["Let me look.\n<tool", "_call>\n{\"name\": \"get_weather\", ", '"arguments": {"ci',
              'ty": "Oslo"}}\n</tool_call>']  # fmt: skip
    got = [d for piece in pieces for d in deltas(a.chunks(rpb.Chunk(text=piece)))]
    call_id = got[1]["tool_calls"][0]["id"]
    assert call_id.startswith("call_")
    # The call goes out once whole (its object closed, in the last piece): never a part of one
    # that max_tokens may yet cut.
    assert got == [
        {"content": "Let me look."},
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]},
    ]  # fmt: skip
    assert a.finish_chunks() == []
    last = a.last(complete())["choices"][0]
    assert (last["delta"], last["finish_reason"]) == ({}, "tool_calls")


def test_text_that_is_not_a_call_is_released_and_finishes_with_stop() -> None:
    a = answer(stream=True)
    assert deltas(a.chunks(rpb.Chunk(text="Sunny <tool"))) == [{"content": "Sunny"}]
    assert a.chunks(rpb.Chunk(text="_call")) == []  # may still open a call
    assert deltas(a.finish_chunks()) == [{"content": " <tool_call"}]
    assert a.last(complete())["choices"][0]["finish_reason"] == "stop"


def test_the_several_choices_stream_merges_a_chunk_s_deltas_and_the_rest_at_the_end() -> None:
    a = answer(stream=True)
    assert a.chunk(rpb.Chunk(text=CALL[:40]))["choices"][0]["delta"] == {"content": ""}
    merged = a.chunk(rpb.Chunk(text=CALL[40:]))["choices"][0]["delta"]
    announced, arguments = merged["tool_calls"]
    assert announced["function"] == {"name": "get_weather", "arguments": ""}
    assert arguments == {"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}
    assert "content" not in merged
    b = answer(stream=True)
    assert b.chunk(rpb.Chunk(text="Hmm <tool"))["choices"][0]["delta"] == {"content": "Hmm"}
    closing = b.last(complete())["choices"][0]  # no finish_chunks on that path
    assert (closing["delta"], closing["finish_reason"]) == ({"content": " <tool"}, "stop")


def test_whole_answers() -> None:
    a = answer()
    a.chunk(rpb.Chunk(text="Checking.\n" + CALL))
    choice = a.whole(complete())["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    broken = answer()
    broken.chunk(rpb.Chunk(text=CALL[:50]))
    choice = broken.whole(complete(rpb.FINISH_REASON_LENGTH))["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": CALL[:50]}


SECOND = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>'


@pytest.mark.parametrize("cut", [len(CALL) - 4, len(CALL) + 1, len(CALL) + 30])
def test_an_answer_cut_by_max_tokens_keeps_its_whole_calls_streamed_and_whole(cut: int) -> None:
    """max_tokens cuts the second call (or the first's closing tag): both shapes answer the
    whole calls and finish_reason length, and the stream reassembles to the whole answer."""
    text = (CALL + "\n" + SECOND)[:cut]
    whole = answer()
    whole.chunk(rpb.Chunk(text=text))
    choice = whole.whole(complete(rpb.FINISH_REASON_LENGTH))["choices"][0]
    assert choice["finish_reason"] == "length"
    message = choice["message"]
    assert message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    ]
    streamed = answer(stream=True)
    got = [
        d
        for i in range(0, len(text), 7)
        for d in deltas(streamed.chunks(rpb.Chunk(text=text[i : i + 7])))
    ]
    got += deltas(streamed.finish_chunks())
    last = streamed.last(complete(rpb.FINISH_REASON_LENGTH))["choices"][0]
    assert (last["delta"], last["finish_reason"]) == ({}, "length")
    joined: dict[int, dict[str, str]] = {}
    for delta in got:
        assert "content" not in delta
        for call in delta["tool_calls"]:
            entry = joined.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"]["arguments"]
    assert list(joined.values()) == [c["function"] for c in message["tool_calls"]]


@pytest.mark.parametrize(
    "choice",
    [ToolChoice(mode) for mode in (ChoiceMode.NONE, ChoiceMode.AUTO, ChoiceMode.REQUIRED)]
    + [ToolChoice(ChoiceMode.FUNCTION, "ping")],
)
@pytest.mark.parametrize("parallel", [True, False])
def test_tools_round_trip_the_wire(choice: ToolChoice, parallel: bool) -> None:
    tools = (Tool("ping", "no arguments"), Tool("get_weather", "", '{"type":"object"}'))
    chat = rpb.ChatMessages()
    tools_to_proto(chat, tools, choice, parallel)
    back = rpb.ChatMessages.FromString(chat.SerializeToString())
    assert tools_from_proto(back) == ChatTools(tools, choice, parallel)
    # Unset: OpenAI's defaults (auto with tools, none without; parallel calls allowed).
    assert tools_from_proto(rpb.ChatMessages()) == ChatTools((), ToolChoice(ChoiceMode.NONE))
    bare = rpb.ChatMessages(tools=[rpb.Tool(function=rpb.FunctionDefinition(name="ping"))])
    assert tools_from_proto(bare) == ChatTools((Tool("ping"),), ToolChoice(ChoiceMode.AUTO))


def test_grpc_completes_carry_the_whole_calls_of_a_cut_answer() -> None:
    calls = CompleteCalls(FORMATS["hermes"], frozenset({"get_weather"}))
    text = CALL + "\n" + SECOND[:40]
    for i in range(0, len(text), 9):
        calls.see(rpb.GenerateResponse(chunk=rpb.Chunk(text=text[i : i + 9])))
    done = rpb.GenerateResponse(complete=complete(rpb.FINISH_REASON_LENGTH))
    calls.see(done)
    [call] = done.complete.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')


# -- the Responses API --------------------------------------------------------------------------


def tool_reply() -> ToolReply:
    body = {"input": "weather?", "tools": [{"type": "function", "name": "get_weather",
                                           "parameters": SCHEMA}], "stream": True}  # fmt: skip
    return ToolReply(openai_responses.parse(body, "m", 64), "m", format=FORMATS["hermes"])


def reply(
    text: list[str], reason: rpb.FinishReason = rpb.FINISH_REASON_STOP
) -> tuple[list[str], list[dict[str, Any]], dict[str, Any]]:
    r = tool_reply()
    events = r.opening() + [e for t in text for e in r.deltas(rpb.Chunk(text=t))]
    events += r.closing(complete(reason))
    return [e["type"] for e in events], events, events[-1]["response"]


def test_responses_stream_a_text_answer_as_without_tools() -> None:
    kinds, events, response = reply(["Sunny", " <tool", "box> today"])
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["delta"] for e in events if "delta" in e] == ["Sunny", " <toolbox> today"]
    assert response["output"][0]["content"][0]["text"] == "Sunny <toolbox> today"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_responses_stream_text_then_a_call() -> None:
    kinds, events, response = reply(["Checking.\n", CALL[:30], CALL[30:]])
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    message, call = response["output"]
    assert message["content"][0]["text"] == "Checking." and message["status"] == "completed"
    assert (call["type"], call["name"], call["arguments"], call["status"]) == (
        "function_call", "get_weather", '{"city": "Oslo"}', "completed",
    )  # fmt: skip
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    added = events[8]
    assert (added["output_index"], added["item"]["arguments"]) == (1, "")
    assert response["tools"][0]["name"] == "get_weather" and response["tool_choice"] == "auto"


def test_responses_cut_by_max_output_tokens_keep_their_whole_calls() -> None:
    text = CALL + "\n" + SECOND[:40]
    kinds, events, streamed = reply([text[:30], text[30:]], rpb.FINISH_REASON_LENGTH)
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    whole = tool_reply().whole([rpb.Chunk(text=text)], complete(rpb.FINISH_REASON_LENGTH))
    for response in (streamed, whole):
        assert response["status"] == "incomplete"
        assert [(o["type"], o["name"], o["arguments"]) for o in response["output"]] == [
            ("function_call", "get_weather", '{"city": "Oslo"}')
        ]


# -- a call, then text that is not one (tool_choice auto) ------------------------------------------

AFTER = "Checking.\n" + CALL + "\nDone: it is sunny."


def test_a_call_then_text_is_the_call_and_the_text_streamed_and_whole() -> None:
    """The stream sent the call before the text came; the whole answer keeps it too, and
    both have the text outside the call as content (finish_reason tool_calls)."""
    whole = answer()
    whole.chunk(rpb.Chunk(text=AFTER))
    choice = whole.whole(complete())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking.\nDone: it is sunny."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    ]
    for size in (1, 5, 13):
        streamed = answer(stream=True)
        got = [
            d
            for i in range(0, len(AFTER), size)
            for d in deltas(streamed.chunks(rpb.Chunk(text=AFTER[i : i + size])))
        ]
        got += deltas(streamed.finish_chunks())
        last = streamed.last(complete())["choices"][0]
        assert (last["delta"], last["finish_reason"]) == ({}, "tool_calls")
        content = "".join(d.get("content", "") for d in got)
        assert content == message["content"]
        calls = [c["function"] for d in got for c in d.get("tool_calls", []) if "id" in c]
        arguments = [c["function"]["arguments"] for d in got for c in d.get("tool_calls", [])]
        assert [c["name"] for c in calls] == ["get_weather"]
        assert "".join(arguments) == '{"city": "Oslo"}'
    grpc = CompleteCalls(FORMATS["hermes"], frozenset({"get_weather"}))
    grpc.see(rpb.GenerateResponse(chunk=rpb.Chunk(text=AFTER)))
    done = rpb.GenerateResponse(complete=complete())
    grpc.see(done)
    assert [c.function.name for c in done.complete.tool_calls] == ["get_weather"]


def test_responses_a_call_then_text_is_a_message_after_the_call_streamed_and_whole() -> None:
    kinds, events, streamed = reply([AFTER[:30], AFTER[30:-6], AFTER[-6:]])
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["output_index"] for e in events[12:19]] == [2] * 7
    first, second = events[2]["item"]["id"], events[12]["item"]["id"]
    assert first != second and events[14]["item_id"] == second
    whole = tool_reply().whole([rpb.Chunk(text=AFTER)], complete())
    for response in (streamed, whole):
        assert response["status"] == "completed"
        message, call, after = response["output"]
        assert message["content"][0]["text"] == "Checking."
        assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Oslo"}')
        assert after["type"] == "message" and after["status"] == "completed"
        assert after["content"][0]["text"] == "\nDone: it is sunny."
        assert message["id"] != after["id"]
