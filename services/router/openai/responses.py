"""OpenAI's Responses API (POST /v1/responses) as pure rules: a request body -> the chat
GenerateRequest the router serves, and the router's messages -> the `response` object or
its stream of events.

Input is a string (one user message) or a list of input items: messages (roles user,
system, developer, assistant; content as a string or input_text/output_text parts), and a
tool round trip as `function_call` and `function_call_output` items, which become an
assistant message's tool calls and the tool messages answering them: the chat rule
(tandem.chat) then holds for them as for the other APIs. `instructions` is a system message
before them. `text.format` json_schema / json_object is structured output (the chat API's
`response_format`, flattened). The chat API's sampling extensions (seed, stop, top_k, min_p,
penalties, ignore_eos, stop_token_ids, logit_bias) are taken too. Function `tools`,
`tool_choice` and `parallel_tool_calls` as on chat (tandem.services.router.openai.tools; the
answer's
function_call items: tandem.services.router.openai.responses_tools). Responses are not stored:
`previous_response_id` and `background` are refused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem import chat, wire
from tandem.services.common.rpc import convert
from tandem.services.common.rpc.convert_tools import ChatTools
from tandem.services.router.inputs import NO_TOOLS
from tandem.services.router.openai import protocol as oai
from tandem.services.router.openai import structured as structured
from tandem.services.router.openai import tools as tools
from tandem.tools import ToolError
from tandem.types import FinishReason
from tandem.v1 import router_pb2 as rpb

JSON = dict[str, Any]
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# Accepted and answered as given: not stored, no effect on the output.
_ACCEPTED = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
             "stream", "text", "metadata", "store", "user", "safety_identifier",
             "prompt_cache_key", "parallel_tool_calls", "tools", "tool_choice", "truncation",
             "service_tier", "reasoning", "include", "background", "previous_response_id",
             "top_logprobs", "stream_options")  # fmt: skip
# The chat API's sampling fields beyond the Responses API's, as there (vLLM's extensions).
_EXTENSIONS = ("seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "ignore_eos", "stop_token_ids", "logit_bias")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A Responses API body as the router takes it, and what its answer repeats.

    constraint: text.format's, and its field (the HTTP edge compile-checks it off the loop).
    """

    request: rpb.GenerateRequest
    stream: bool = False
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    text_format: JSON = field(default_factory=lambda: {"type": "text"})
    constraint: tuple[rpb.Constraint, str] | None = None
    user: str | None = None
    # Function tools as given (the response repeats them) and the names an answer may call.
    tools: tuple[JSON, ...] = ()
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    tool_names: frozenset[str] = frozenset()
    # The core's input is read from these (tandem.services.router.inputs.http_input): the checked
    # messages and the tools (shapes checked; http.py compiles their schemas).
    messages: tuple[chat.Message, ...] = ()
    chat_tools: ChatTools = NO_TOOLS


def parse(body: Any, model_id: str, default_max_tokens: int) -> ResponsesRequest:
    """POST /v1/responses. Raises oai.ApiError naming the field."""
    body = oai._object(body)
    unknown = sorted(set(body) - set(_ACCEPTED) - set(_EXTENSIONS))
    if unknown:
        raise oai.invalid(unknown[0], "unknown parameter for /v1/responses")
    _refuse_unsupported(body)
    request = rpb.GenerateRequest(model=oai._model(body, model_id))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise oai.invalid("instructions", f"must be a string, got {oai._kind(instructions)}")
    messages, where = _messages(body.get("input"), instructions)
    try:
        chat.check_messages(messages)
    except chat.ChatError as error:  # messages[i].x -> input[k].x, in the API's names
        index, _, rest = error.field.removeprefix("messages[").partition("]")
        rest = "" if rest.startswith(".tool_calls[") else rest.replace("tool_call_id", "call_id")
        param = where[int(index)] + rest if index.isdigit() else "input"
        raise oai.invalid(param, error.reason) from None
    request.chat.messages.extend(convert.chat_message_to_proto(m) for m in messages)
    max_output_tokens = oai._int(body, "max_output_tokens", None, 1)
    oai._sampling(request.sampling, body, max_output_tokens or default_max_tokens)
    text_format, constraint = _text_format(body.get("text"))
    if constraint is not None:
        request.sampling.constraint.CopyFrom(constraint[0])
    try:  # the HTTP edge compiles the parameters schemas off the event loop
        forced = constraint[1] if constraint is not None else None
        body_tools = tools.read(body, request.chat, forced, flat=True)
    except ToolError as error:
        raise oai.invalid(error.field, error.reason) from None
    return ResponsesRequest(
        request,
        stream=oai._bool(body, "stream", False),
        instructions=instructions,
        max_output_tokens=max_output_tokens,
        metadata=_metadata(body.get("metadata")),
        text_format=text_format,
        constraint=constraint,
        user=_optional_string(body, "user"),
        tools=tuple(body.get("tools") or ()),
        tool_choice=body.get("tool_choice") or ("auto" if body_tools.tools else "none"),
        parallel_tool_calls=body_tools.parallel,
        tool_names=body_tools.names,
        messages=tuple(messages),
        chat_tools=ChatTools(body_tools.tools, body_tools.choice, body_tools.parallel),
    )


def _refuse_unsupported(body: JSON) -> None:
    if body.get("previous_response_id") is not None:
        raise oai.invalid(
            "previous_response_id", "responses are not stored; send the history as input items"
        )
    if body.get("background"):
        raise oai.invalid("background", "background responses are not supported")
    if body.get("reasoning") not in (None, {}):
        raise oai.invalid("reasoning", "reasoning options are not supported by this model")
    if body.get("include"):
        raise oai.invalid("include", "no additional output data is available")
    if oai._int(body, "top_logprobs", 0, 0) != 0:
        raise oai.invalid("top_logprobs", "logprobs are not supported on /v1/responses")
    if body.get("truncation") not in (None, "disabled"):
        raise oai.invalid("truncation", 'only "disabled" is supported')
    for name in ("store", "parallel_tool_calls"):
        oai._bool(body, name, False)
    for name in ("safety_identifier", "prompt_cache_key", "service_tier"):
        _optional_string(body, name)


def _messages(value: Any, instructions: str | None) -> tuple[list[chat.Message], list[str]]:
    """The chat and, for each message, the body field it came from."""
    messages: list[chat.Message] = []
    where: list[str] = []
    if instructions:
        messages.append(chat.Message("system", instructions))
        where.append("instructions")
    if isinstance(value, str):
        if not value:
            raise oai.invalid("input", "must not be empty")
        return [*messages, chat.Message("user", value)], [*where, "input"]
    if not isinstance(value, list) or not value:
        raise oai.invalid("input", "must be a string or a non-empty list of input items")
    for k, item in enumerate(value):
        at = f"input[{k}]"
        item = oai._object(item, at)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, at))
            where.append(at)
        elif kind == "function_call":
            call = chat.ToolCall(
                _string(item, "call_id", at), _string(item, "name", at),
                _string(item, "arguments", at),
            )  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and where[-1].startswith("input"):
                # Consecutive calls (and the text before them) are one assistant turn.
                messages[-1] = chat.Message("assistant", last.content, last.name,
                                            tool_calls=(*last.tool_calls, call))  # fmt: skip
            else:
                messages.append(chat.Message("assistant", tool_calls=(call,)))
                where.append(at)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise oai.invalid(f"{at}.output", f"must be a string, got {oai._kind(output)}")
            call_id = _string(item, "call_id", at)
            messages.append(chat.Message("tool", output, tool_call_id=call_id))
            where.append(at)
        else:
            raise oai.invalid(
                f"{at}.type",
                f"must be message, function_call or function_call_output, got {kind!r}",
            )
    return messages, where


def _message(item: JSON, at: str) -> chat.Message:
    role = item.get("role")
    if role not in _ROLES:
        raise oai.invalid(f"{at}.role", f"must be one of {', '.join(_ROLES)}; got {role!r}")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            part = oai._object(part, f"{at}.content[{j}]")
            if part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise oai.invalid(
                    f"{at}.content[{j}]",
                    f"only text parts are supported, got type {part.get('type')!r}",
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise oai.invalid(
            f"{at}.content", f"must be a string or a list of text parts, got {oai._kind(content)}"
        )
    return chat.Message(role, content)


def _text_format(value: Any) -> tuple[JSON, tuple[rpb.Constraint, str] | None]:
    """`text: {"format": ...}` -> the format the answer repeats, and its constraint."""
    if value is None:
        return {"type": "text"}, None
    fmt = oai._object(value, "text").get("format")
    if fmt is None:
        return {"type": "text"}, None
    fmt = oai._object(fmt, "text.format")
    as_chat: JSON = dict(fmt)
    if fmt.get("type") == "json_schema":  # chat nests what Responses flattens
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        as_chat = {"type": "json_schema", "json_schema": spec}
    try:
        found = structured.read({"response_format": as_chat})
    except structured.FieldError as error:
        param = error.param.replace("response_format.json_schema", "text.format")
        raise oai.invalid(param.replace("response_format", "text.format"), error.reason) from None
    if found is not None:
        param = found[1].replace("response_format.json_schema", "text.format")
        found = (found[0], param.replace("response_format", "text.format"))
    return fmt, found


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    value = oai._object(value, "metadata")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise oai.invalid("metadata", "must map strings to strings")
    return dict(value)


def _string(obj: JSON, name: str, at: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise oai.invalid(f"{at}.{name}", f"must be a string, got {oai._kind(value)}")
    return value


def _optional_string(body: JSON, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise oai.invalid(name, f"must be a string, got {oai._kind(value)}")
    return value


# -- answers ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    """One response's objects and events from the router's messages. Events are numbered
    in order (`sequence_number`), as OpenAI numbers them."""

    parsed: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    sequence: int = 0

    def response(self, complete: rpb.Complete | None = None) -> JSON:
        """The `response` object: in progress (no output yet) until `complete`."""
        status, incomplete, output = "in_progress", None, []
        if complete is not None:
            status, incomplete = _status(complete.finish_reason)
            output = [self._message(status, "".join(self.text))]
        p = self.parsed
        sampling = p.request.sampling
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": p.instructions,
            "max_output_tokens": p.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": p.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": sampling.temperature if sampling.HasField("temperature") else 1.0,
            "text": {"format": p.text_format},
            "tool_choice": p.tool_choice,
            "tools": list(p.tools),
            "top_p": sampling.top_p if sampling.HasField("top_p") else 1.0,
            "truncation": "disabled",
            "usage": _usage(complete.usage) if complete is not None else None,
            "user": p.user,
            "metadata": p.metadata,
        }

    def whole(self, chunks: Sequence[rpb.Chunk], complete: rpb.Complete) -> JSON:
        self.text.extend(c.text for c in chunks)
        return self.response(complete)

    def opening(self) -> list[JSON]:
        """created, in_progress, the message item and its text part, before any text."""
        item = {**self._message("in_progress", ""), "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._at(), part=part),
        ]

    def deltas(self, chunk: rpb.Chunk) -> list[JSON]:
        """The events of one chunk (with tools, openai_responses_tools: none or several)."""
        return [self.delta(chunk)]

    def delta(self, chunk: rpb.Chunk) -> JSON:
        self.text.append(chunk.text)
        return self._event("response.output_text.delta", **self._at(), delta=chunk.text,
                           logprobs=[])  # fmt: skip

    def closing(self, complete: rpb.Complete) -> list[JSON]:
        """The text's and the item's done events, then completed (or incomplete)."""
        text = "".join(self.text)
        status, _ = _status(complete.finish_reason)
        part = {"type": "output_text", "text": text, "annotations": []}
        final = self.response(complete)
        kind = "response.completed" if status == "completed" else f"response.{status}"
        return [
            self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
            self._event("response.content_part.done", **self._at(), part=part),
            self._event(
                "response.output_item.done", output_index=0, item=self._message(status, text)
            ),  # fmt: skip
            self._event(kind, response=final),
        ]

    def error(self, error: oai.ApiError) -> JSON:
        """A failure after the stream started (the status line has gone)."""
        return self._event("error", code=error.code or error.type, message=error.message,
                           param=error.param)  # fmt: skip

    def _at(self) -> JSON:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> JSON:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _message(self, status: str, text: str) -> JSON:
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "type": "message",
            "id": self.message_id,
            "status": status if status in ("in_progress", "completed") else "incomplete",
            "role": "assistant",
            "content": [part],
        }


def _status(reason: int) -> tuple[str, JSON | None]:
    """A finish reason as the response's status and incomplete_details."""
    core = wire.finish_reason_from_proto(reason)
    if core == FinishReason.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}
    if core == FinishReason.ABORT:
        return "cancelled", None
    return "completed", None


def _usage(u: rpb.Usage) -> JSON:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
