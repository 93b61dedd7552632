"""The router's checks before any work: a client's request id (a bounded printable label:
it appears in logs) and a prompt's size against the model's context (before tokenizing; the
same rule for both APIs' inputs, tandem.services.router.inputs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from tandem.services.common.rpc import convert
from tandem.services.common.rpc.errors import ServiceError
from tandem.services.router.inputs import ChatPrompt
from tandem.services.router.prompts import (
    MAX_REQUEST_ID_CHARS,
    Prompts,
    check_request_id,
    check_size,
)
from tandem.v1 import router_pb2 as rpb


def refused(call, *args) -> ServiceError:  # type: ignore[no-untyped-def]
    with pytest.raises(ServiceError) as info:
        call(*args)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    return info.value


@pytest.mark.parametrize("label", ["", "r1", "a" * 256, "réponse 1/ü~x", "x" * 255 + "é"])
def test_request_ids_up_to_256_printable_characters_pass(label: str) -> None:
    assert MAX_REQUEST_ID_CHARS == 256
    check_request_id(label)


def test_a_request_id_of_257_characters_is_refused_with_its_length() -> None:
    error = refused(check_request_id, "a" * 257)
    assert error.message == "request_id: 257 characters; at most 256"


@pytest.mark.parametrize(
    "label", ["a\nb", "tab\tbed", "nul\x00", "esc\x1b[31m", "del\x7f", "zw\u200b"]
)
def test_request_ids_with_control_characters_are_refused(label: str) -> None:
    error = refused(check_request_id, label)
    assert error.message == "request_id: must be printable (no control characters)"


def test_the_length_is_checked_before_the_characters() -> None:
    error = refused(check_request_id, "\n" * 300)
    assert error.message == "request_id: 300 characters; at most 256"


def text(n: int) -> str:
    return "x" * n


def chat(*messages: rpb.ChatMessage) -> ChatPrompt:
    return ChatPrompt(convert.chat_from_proto(rpb.ChatMessages(messages=messages)))


def test_text_up_to_max_prompt_chars_passes_and_one_more_is_refused() -> None:
    check_size(text(40), max_model_len=8, max_prompt_chars=40)
    error = refused(check_size, text(41), 8, 40)
    assert error.message == (
        "text: 41 characters cannot fit the model's context of 8 tokens (at most 40 characters)"
    )


def test_chat_counts_every_message_s_content_and_role() -> None:
    prompt = chat(rpb.ChatMessage(role="user", content="x" * 10),
                  rpb.ChatMessage(role="assistant", content="y" * 17))  # fmt: skip
    check_size(prompt, 8, 4 + 10 + 9 + 17)
    error = refused(check_size, prompt, 8, 39)
    assert error.message.startswith("chat: 40 characters cannot fit")


def test_chat_counts_tool_call_fields_too() -> None:
    call = rpb.ToolCall(id="c" * 3, function=rpb.FunctionCall(name="f" * 4, arguments="a" * 50))
    prompt = chat(
        rpb.ChatMessage(role="assistant", tool_calls=[call]),
        rpb.ChatMessage(role="tool", content="r", tool_call_id="c" * 3, name="nm"),
    )
    total = 9 + 3 + 4 + 50 + 4 + 1 + 3 + 2
    check_size(prompt, 8, total)
    error = refused(check_size, prompt, 8, total - 1)
    assert error.message.startswith(f"chat: {total} characters cannot fit")


def test_token_ids_must_leave_room_in_the_context() -> None:
    check_size((1,) * 7, 8, 0)
    error = refused(check_size, (1,) * 8, 8, 0)
    assert error.message == "token_ids: 8 tokens; the model's context is 8"


def test_tokenize_requests_are_held_to_the_same_limit_and_an_input_is_required(
    tiny_model_dir: Path,
) -> None:
    """The gRPC reader (Generate and Tokenize): the same size rule before tokenizing, and a
    request without any input refused by name."""
    prompts = Prompts(str(tiny_model_dir), "tiny")
    try:
        limit = prompts.max_prompt_chars
        too_long = rpb.TokenizeRequest(text="x" * (limit + 1))
        fit = "characters cannot fit"
        with pytest.raises(ServiceError, match=f"^INVALID_ARGUMENT: text: {limit + 1} {fit}"):
            asyncio.run(prompts.tokenize(too_long))
        long_chat = rpb.TokenizeRequest(
            chat=rpb.ChatMessages(messages=[rpb.ChatMessage(role="user", content="x" * limit)])
        )
        with pytest.raises(ServiceError, match=f"^INVALID_ARGUMENT: chat: {limit + 4} {fit}"):
            asyncio.run(prompts.tokenize(long_chat))
        ids, text = asyncio.run(prompts.tokenize(rpb.TokenizeRequest(text="hello")))
        assert text == "hello" and ids == prompts.tokenizer.encode("hello")
        no_input = "^INVALID_ARGUMENT: input: set text, chat or token_ids$"
        with pytest.raises(ServiceError, match=no_input):
            asyncio.run(prompts.read(rpb.GenerateRequest()))
    finally:
        prompts.close()
