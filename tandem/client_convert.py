"""The Python client's conversions: keyword arguments to a GenerateRequest, responses and
failed calls to `Chunk`, `Result` and `TandemError`. Pure: no channel, no clock, shared by
both clients in tandem.client."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.client_retry import TandemError
from tandem.tools import ChoiceMode, tool_choice_from_json, tools_from_json
from tandem.v1 import router_pb2 as rpb
from tandem.wire import finish_reason_from_proto

# Trailing metadata key of the server's pushback hint in milliseconds (the services send it
# through tandem.services.common.rpc.errors, which takes it from here).
RETRY_AFTER_KEY = "tandem-retry-after-ms"


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: list[int]
    text: str


@dataclass(slots=True)
class Result:
    """A finished generation (also filled in by `stream` as it goes)."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    first_token_ms: float = 0.0
    total_ms: float = 0.0
    disaggregated: bool = False
    prefill_worker: str = ""
    decode_worker: str = ""
    route_reason: str = ""
    route_cached_tokens: int = 0
    index_degraded: bool = False
    migrations: int = 0  # moved to another decode worker mid-stream
    reprefills: int = 0  # prompt prefilled again after a failed hand-off
    recoveries: list[str] = field(default_factory=list)  # one line per recovery step
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    # A chat with tools: the calls the answer made, as {"id", "name", "arguments"}.
    tool_calls: list[dict[str, str]] = field(default_factory=list)


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    model: str = "",
    request_id: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    **sampling: Any,
) -> rpb.GenerateRequest:
    """A GenerateRequest from a text, token ids or chat messages plus sampling fields. A chat
    may carry `tools`, `tool_choice` and `parallel_tool_calls` in OpenAI's JSON shapes."""
    req = rpb.GenerateRequest(request_id=request_id, model=model)
    if messages is not None:
        req.chat.messages.extend(chat_message(m) for m in messages)
        _set_tools(req.chat, tools, tool_choice, parallel_tool_calls)
    elif tools is not None or tool_choice is not None:
        raise ValueError("tools need messages (a chat)")
    elif isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(prompt)
    else:
        raise ValueError("give a prompt (text or token ids) or messages")
    for name, value in sampling.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            getattr(req.sampling, name).extend([value] if isinstance(value, str) else value)
        elif name == "logit_bias":  # {token id: bias}
            req.sampling.logit_bias.update(value)
        elif name in CONSTRAINT_KINDS:  # structured output: one of them
            _set_constraint(req.sampling.constraint, name, value)
        elif name in rpb.SamplingParams.DESCRIPTOR.fields_by_name:
            setattr(req.sampling, name, value)
        else:
            raise ValueError(f"unknown sampling parameter {name!r}")
    return req


# Structured output keywords: json_schema (a dict or JSON text), json_object=True, regex (a
# str), choice (strings), grammar (GBNF or Lark text). The router checks them.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def _set_constraint(msg: rpb.Constraint, kind: str, value: Any) -> None:
    if msg.WhichOneof("kind") is not None:
        raise ValueError(f"{kind}: set one constraint at a time, got {msg.WhichOneof('kind')} too")
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value, separators=(",", ":"), sort_keys=True)
    if kind == "choice":
        msg.choice.choices.extend(value)
    else:
        setattr(msg, kind, value)


_TOOL_CHOICE_MODES = {
    ChoiceMode.NONE: rpb.TOOL_CHOICE_MODE_NONE,
    ChoiceMode.AUTO: rpb.TOOL_CHOICE_MODE_AUTO,
    ChoiceMode.REQUIRED: rpb.TOOL_CHOICE_MODE_REQUIRED,
}


def _set_tools(
    chat: rpb.ChatMessages,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel: bool | None,
) -> None:
    """OpenAI's tools JSON on the wire (the router checks the rule). Raises ToolError."""
    for tool in tools_from_json(list(tools) if tools is not None else None):
        function = rpb.FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters
        )
        chat.tools.append(rpb.Tool(function=function))
    if tool_choice is not None:
        choice = tool_choice_from_json(tool_choice, bool(tools))
        if choice.mode == ChoiceMode.FUNCTION:
            chat.tool_choice.function = choice.name
        else:
            chat.tool_choice.mode = _TOOL_CHOICE_MODES[choice.mode]
    if parallel is not None:
        chat.parallel_tool_calls = parallel


def chat_message(message: Mapping[str, Any]) -> rpb.ChatMessage:
    """A message in OpenAI's shape (role, content, and optionally name, tool_call_id and
    tool_calls [{"id", "function": {"name", "arguments"}}]) as the wire carries it; the
    router checks it."""
    calls = [
        rpb.ToolCall(
            id=call["id"],
            function=rpb.FunctionCall(
                name=call["function"]["name"], arguments=call["function"].get("arguments", "")
            ),
        )
        for call in message.get("tool_calls") or ()
    ]
    return rpb.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        name=message.get("name") or "",
        tool_call_id=message.get("tool_call_id") or "",
        tool_calls=calls,
    )


def apply_response(result: Result, msg: rpb.GenerateResponse) -> Chunk | None:
    """Fold one response into `result`; return the chunk, if it is one. Raises TandemError
    for an in-stream error (with its `retry_after_ms` as `retry_after_s`)."""
    result.request_id = msg.request_id
    kind = msg.WhichOneof("kind")
    if kind == "chunk":
        c = msg.chunk
        result.token_ids.extend(c.token_ids)
        result.text += c.text
        for lp in c.logprobs:
            result.logprobs.append(
                (lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
            )
        return Chunk(list(c.token_ids), c.text)
    if kind == "complete":
        d = msg.complete
        result.finish_reason = finish_reason_from_proto(d.finish_reason)
        result.stop_reason = d.stop_reason
        result.prompt_tokens = d.usage.prompt_tokens
        result.completion_tokens = d.usage.completion_tokens
        result.cached_prompt_tokens = d.usage.cached_prompt_tokens
        result.first_token_ms = d.timings.first_token_ms
        result.total_ms = d.timings.total_ms
        result.disaggregated = d.timings.disaggregated
        result.prefill_worker = d.timings.prefill_worker
        result.decode_worker = d.timings.decode_worker
        result.route_reason = d.timings.route_reason
        result.route_cached_tokens = d.timings.route_cached_tokens
        result.index_degraded = d.timings.index_degraded
        result.migrations = d.timings.migrations
        result.reprefills = d.timings.reprefills
        result.recoveries = list(d.timings.recoveries)
        result.tool_calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in d.tool_calls
        ]
        return None
    if kind == "error":
        e = msg.error
        raise TandemError(
            _STATUS_BY_VALUE.get(e.code, grpc.StatusCode.UNKNOWN),
            e.message,
            e.retry_after_ms / 1e3 if e.retry_after_ms else None,
        )
    return None


# An in-stream error carries the numeric gRPC status the call ends with.
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def status_error(exc: grpc.RpcError) -> TandemError:
    """A failed call's status, details and pushback hint as the error the client raises."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else ""
    return TandemError(code, details or "", retry_after(exc))


def retry_after(exc: grpc.RpcError) -> float | None:
    """The pushback hint (seconds) in a failed call's trailers, if any."""
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1e3)
            except (TypeError, ValueError):
                return None
    return None
