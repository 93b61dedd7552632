"""One chat-message rule on both APIs (tandem/chat.py): the same refusals over real gRPC and
through the `openai` client over HTTP, and a tool-call history accepted by both, rendered by
the chat template and answered identically."""

from __future__ import annotations

from typing import Any

import grpc
import openai
import pytest

from tandem.client import TandemClient, TandemError, chat_message
from tandem.services.up import Cluster
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc

CALL = {
    "id": "call_7",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL_HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_7"},
]


BAD_CHATS = [
    ([{"role": "wizard", "content": "x"}], "messages[0].role", "got 'wizard'"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}],
     "messages[1].tool_call_id", "needs the id of the call it answers"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r", "tool_call_id": "x"}],
     "messages[1].tool_call_id", "'x' answers no tool call"),
    ([{"role": "user", "content": "q", "tool_calls": [CALL]}],
     "messages[0].tool_calls", "only assistant messages make tool calls"),
    ([{"role": "assistant", "tool_calls": [CALL, CALL]}],
     "messages[0].tool_calls[1].id", "already the id of an earlier call"),
]  # fmt: skip


@pytest.mark.parametrize(("messages", "field", "says"), BAD_CHATS)
def test_grpc_chat_refuses_what_http_refuses(
    grpc_client: TandemClient, messages: list[dict[str, Any]], field: str, says: str
) -> None:
    with pytest.raises(TandemError) as err:
        grpc_client.generate(messages=messages, max_tokens=2, temperature=0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith(f"chat.{field}: ")
    assert says in err.value.message


@pytest.mark.parametrize(("messages", "field", "says"), BAD_CHATS)
def test_http_chat_refuses_with_the_same_words(
    client: openai.OpenAI, messages: list[dict[str, Any]], field: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="",
            messages=messages,
            max_tokens=2,
            temperature=0,  # type: ignore[arg-type]
        )
    assert err.value.param == field
    body = err.value.body
    assert isinstance(body, dict) and body["message"].startswith(f"{field}: ")
    assert says in body["message"]


def test_grpc_tokenize_refuses_a_bad_chat_too(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = rgrpc.RouterStub(channel)
        chat = rpb.ChatMessages(messages=[rpb.ChatMessage(role="wizard", content="x")])
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(rpb.TokenizeRequest(chat=chat), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[0].role" in (err.value.details() or "")


def test_a_tool_history_is_rendered_and_answered_alike_on_both_apis(
    cluster: Cluster, grpc_client: TandemClient, client: openai.OpenAI
) -> None:
    with grpc.insecure_channel(cluster.router_address) as channel:
        chat = rpb.ChatMessages(messages=[chat_message(m) for m in TOOL_HISTORY])
        rendered = rgrpc.RouterStub(channel).Tokenize(rpb.TokenizeRequest(chat=chat), timeout=30)
    # The tiny model's template renders each turn under its role: the tool's answer is there.
    assert "<|start_header_id|>tool<|end_header_id|>\n\nsunny, 21 C<|eot_id|>" in rendered.prompt
    ref = grpc_client.generate(messages=TOOL_HISTORY, max_tokens=8, temperature=0)
    assert ref.prompt_tokens == len(rendered.token_ids)
    out = client.chat.completions.create(
        model="",
        messages=TOOL_HISTORY,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert out.choices[0].message.content == ref.text
    assert out.usage is not None and out.usage.prompt_tokens == ref.prompt_tokens
