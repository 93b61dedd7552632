"""Tools on the OpenAI HTTP API, as pure rules: `tools`, `tool_choice` and
`parallel_tool_calls` in a chat body -> the gRPC chat's tool fields, and the model's answer ->
OpenAI's `tool_calls` (whole, or streamed as OpenAI streams them).

Streamed, a call is one chunk announcing it, then its arguments:

    {"tool_calls": [{"index": 0, "id": "call_...", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": \\"Oslo\\"}"}}]}
    ...                                               finish_reason "tool_calls"

A call is announced when its object closes, and its arguments follow in one fragment: a call
cut short by max_tokens is never sent, as the whole answer drops it (tandem.tools.stream), so
the streamed calls are the whole answer's however it ends (finish_reason "tool_calls", or
"length" with the calls written whole). Content is withheld while the text may be opening a
call.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from tandem.services.common.rpc.convert_tools import tools_to_proto
from tandem.tools import (
    Arguments,
    CallStart,
    ChoiceMode,
    Content,
    Event,
    Parsed,
    Tool,
    ToolCallStream,
    ToolChoice,
    ToolError,
    ToolFormat,
    check_tools,
    tool_choice_from_json,
    tools_from_json,
)
from tandem.v1 import router_pb2 as rpb

JSON = dict[str, Any]


@dataclass(frozen=True, slots=True)
class BodyTools:
    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        """The functions an answer may call (none: the answer is text)."""
        if self.choice.mode == ChoiceMode.NONE:
            return frozenset()
        return frozenset(t.name for t in self.tools)


def read(
    body: JSON, chat: rpb.ChatMessages, forced_field: str | None, flat: bool = False
) -> BodyTools:
    """A chat body's tools into `chat` (shapes and names checked; schemas are `check`'s).
    `forced_field`: the body's field that already constrains the output, if any (a forced
    tool choice cannot share it). `flat`: the Responses API's shapes and field names
    (tools[i].name, not tools[i].function.name). Raises ToolError naming the field."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise ToolError(legacy, "the legacy function calling is not supported; use tools")
    try:
        tools = tools_from_json(body.get("tools"), flat=flat)
        choice = tool_choice_from_json(body.get("tool_choice"), bool(tools))
        check_tools(tools, choice, compile_schemas=False)
    except ToolError as error:
        raise ToolError(field_name(error.field, flat), error.reason) from None
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "must be a boolean")
    if choice.forced and forced_field is not None:
        raise ToolError(
            "tool_choice",
            f"a required or named tool choice constrains the output itself; {forced_field} "
            "cannot too",
        )
    if tools or body.get("tool_choice") is not None:
        tools_to_proto(chat, tools, choice, parallel)
    return BodyTools(tools, choice, True if parallel is None else parallel)


def field_name(name: str, flat: bool) -> str:
    """A tool rule's field in the body's names: the Responses API's are flat (tools[i].x,
    tool_choice.name), the chat API's nest a `function`."""
    return re.sub(r"^(tools\[\d+\]|tool_choice)\.function", r"\1", name) if flat else name


def check(tools: tuple[Tool, ...], choice: ToolChoice) -> ToolError | None:
    """Compile each parameters schema (milliseconds each: off the event loop)."""
    try:
        check_tools(tools, choice)
    except ToolError as error:
        return error
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call_id: str, name: str, arguments: str) -> JSON:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(slots=True)
class AnswerTools:
    """One answer's tool calls: read from its text as it streams, or whole."""

    format: ToolFormat
    names: Collection[str]
    stream: ToolCallStream = field(init=False)
    ids: list[str] = field(default_factory=list)
    finished: bool = False

    def __post_init__(self) -> None:
        self.stream = ToolCallStream(self.format, self.names)

    @property
    def has_calls(self) -> bool:
        return self.stream.has_calls

    def feed(self, text: str) -> list[JSON]:
        """The deltas a chunk of text makes (each its own streamed chunk); may be none."""
        return [self._delta(e) for e in self.stream.feed(text)]

    def finish(self) -> list[JSON]:
        """The deltas the end of the answer releases (once)."""
        if self.finished:
            return []
        self.finished = True
        return [self._delta(e) for e in self.stream.finish()]

    def _delta(self, event: Event) -> JSON:
        if isinstance(event, Content):
            return {"content": event.text}
        if isinstance(event, CallStart):
            self.ids.append(new_call_id())
            call = tool_call(self.ids[event.index], event.name, "")
            return {"tool_calls": [{"index": event.index, **call}]}
        assert isinstance(event, Arguments)
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

    def whole(self, text: str) -> tuple[Parsed, list[JSON]]:
        """A whole answer's content and calls (new ids)."""
        parsed = self.format.parse(text, self.names)
        return parsed, [tool_call(new_call_id(), c.name, c.arguments) for c in parsed.calls]


def merge(deltas: list[JSON]) -> JSON:
    """Several deltas as one (one chunk per piece of text: the several-choices stream)."""
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    merged: JSON = {"content": content} if content or not calls else {}
    if calls:
        merged["tool_calls"] = calls
    return merged
