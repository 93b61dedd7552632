"""The one chat-message rule (tandem/chat.py) that the HTTP API and gRPC Chat both apply:
exact refusals, the JSON shapes, the template's view, and the proto round trip."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.chat import ChatError, Message, ToolCall, check_messages, messages_from_json
from tandem.services.common.rpc import convert
from tandem.v1 import router_pb2 as rpb

CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
TOOL_TURN = (
    Message("user", "Weather in Paris?"),
    Message("assistant", "", tool_calls=(CALL,)),
    Message("tool", "sunny, 21 C", tool_call_id="call_1"),
)


def refusal(messages: tuple[Message, ...]) -> str:
    with pytest.raises(ChatError) as err:
        check_messages(messages)
    return str(err.value)


def test_a_tool_round_trip_history_passes() -> None:
    check_messages(TOOL_TURN)
    check_messages((Message("developer", "be brief"), Message("user", "hi"), Message("assistant")))


def test_an_unknown_role_is_named() -> None:
    assert refusal((Message("user", "hi"), Message("wizard", "x"))) == (
        "messages[1].role: must be one of system, developer, user, assistant, tool; got 'wizard'"
    )


def test_an_empty_chat_is_refused() -> None:
    assert refusal(()) == "messages: must hold at least one message"


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ((Message("user", "q"), Message("tool", "r")),
         "messages[1].tool_call_id: a tool message needs the id of the call it answers"),
        ((Message("user", "q"), Message("tool", "r", tool_call_id="call_9")),
         "messages[1].tool_call_id: 'call_9' answers no tool call of an earlier assistant "
         "message"),
        # The answer must come after the call, not before.
        ((Message("tool", "r", tool_call_id="call_1"), Message("assistant", tool_calls=(CALL,))),
         "messages[0].tool_call_id: 'call_1' answers no tool call of an earlier assistant "
         "message"),
        ((Message("user", "q", tool_calls=(CALL,)),),
         "messages[0].tool_calls: only assistant messages make tool calls, not user"),
        ((Message("user", "q", tool_call_id="call_1"),),
         "messages[0].tool_call_id: only tool messages answer a call, not user"),
        ((Message("assistant", tool_calls=(ToolCall("", "f"),)),),
         "messages[0].tool_calls[0].id: must be a non-empty string"),
        ((Message("assistant", tool_calls=(ToolCall("a" * 257, "f"),)),),
         "messages[0].tool_calls[0].id: 257 characters; at most 256"),
        ((Message("assistant", tool_calls=(ToolCall("c", ""),)),),
         "messages[0].tool_calls[0].function.name: must be a non-empty string"),
        ((Message("assistant", tool_calls=(CALL,)), Message("assistant", tool_calls=(CALL,))),
         "messages[1].tool_calls[0].id: 'call_1' is already the id of an earlier call"),
    ],
)  # fmt: skip
def test_tool_messages_and_calls(messages: tuple[Message, ...], says: str) -> None:
    assert refusal(messages) == says


def test_the_error_names_its_field_apart_from_the_reason() -> None:
    with pytest.raises(ChatError) as err:
        check_messages((Message("robot", "x"),))
    assert err.value.field == "messages[0].role"
    assert err.value.reason.startswith("must be one of")


def test_json_messages_with_parts_null_content_and_tool_calls() -> None:
    messages = messages_from_json(
        [
            {"role": "user", "content": [{"type": "text", "text": t} for t in ("a", "b")]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
        ]
    )
    assert messages == (
        Message("user", "ab"),
        Message("assistant", "", tool_calls=(CALL,)),
        Message("tool", "sunny", name="get_weather", tool_call_id="call_1"),
    )


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ([], "messages: must be a non-empty list of {role, content} objects"),
        ("hi", "messages: must be a non-empty list of {role, content} objects"),
        (["hi"], "messages[0]: must be a JSON object, got string"),
        ([{"content": "x"}], "messages[0].role: must be one of system, developer, user, "
         "assistant, tool; got None"),
        ([{"role": "user"}], "messages[0].content: must be a string or a list of text parts, "
         "got null"),
        ([{"role": "user", "content": 3}], "messages[0].content: must be a string or a list "
         "of text parts, got integer"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
         "messages[0].content[0]: only text parts are supported, got type 'image_url'"),
        ([{"role": "tool", "content": "r", "tool_call_id": 7}],
         "messages[0].tool_call_id: must be a string, got integer"),
        ([{"role": "assistant", "tool_calls": {"id": "c"}}],
         "messages[0].tool_calls: must be a list of tool calls, got object"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "code", "function": {}}]}],
         "messages[0].tool_calls[0].type: must be 'function', got 'code'"),
        ([{"role": "assistant", "tool_calls": [{"id": "c"}]}],
         "messages[0].tool_calls[0].function: must be a JSON object, got null"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f",
           "arguments": {"a": 1}}}]}],
         "messages[0].tool_calls[0].function.arguments: must be a string, got object"),
        # The JSON is well-formed: the rule itself refuses.
        ([{"role": "wizard", "content": "x"}], "messages[0].role: must be one of system, "
         "developer, user, assistant, tool; got 'wizard'"),
    ],
)  # fmt: skip
def test_json_refusals(value: Any, says: str) -> None:
    with pytest.raises(ChatError) as err:
        messages_from_json(value)
    assert str(err.value) == says


def test_the_template_sees_openai_fields_and_developer_as_system() -> None:
    assert Message("developer", "be brief").to_template() == {
        "role": "system",
        "content": "be brief",
    }
    assert [m.to_template() for m in TOOL_TURN[1:]] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
    ]


def test_num_chars_counts_every_string_the_template_may_copy() -> None:
    message = Message("tool", "abc", name="n", tool_call_id="id", tool_calls=(CALL,))
    assert message.num_chars() == 4 + 3 + 1 + 2 + len("call_1get_weather") + 17


def test_proto_round_trip() -> None:
    messages = (*TOOL_TURN, Message("user", "thanks", name="ann"))
    proto = rpb.ChatMessages(messages=[convert.chat_message_to_proto(m) for m in messages])
    wire = rpb.ChatMessages.FromString(proto.SerializeToString())
    assert convert.chat_from_proto(wire) == messages
