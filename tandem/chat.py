"""The one chat-message rule, for every API that takes a chat: roles, content, tool calls.

The OpenAI HTTP API (JSON) and the gRPC `Chat` input (protos) both turn their messages into
`Message`s and call `check_messages`; the HTTP API reads its JSON with `message_from_json`
first (content given as a list of text parts is JSON's alone). A refusal is a `ChatError`
naming the field as OpenAI's API does (`messages[2].tool_call_id`), so each edge prefixes it
with its own name for the list (gRPC: `chat.`).

Rules (OpenAI's):
    role           system, developer (the same instruction slot: rendered as system), user,
                   assistant, tool
    content        text (JSON: a string or a list of text parts; null only on an assistant
                   message, which may consist of its tool calls alone)
    tool           needs `tool_call_id`, the id of a call an earlier assistant message made
    assistant      may carry `tool_calls`: each with an id unique in the chat, a function
                   name, and its arguments (a string, as the model wrote it: not checked)
    name           optional participant name, on any message
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
# Templates know system; OpenAI's newer "developer" role is the same instruction slot.
_TEMPLATE_ROLE = {"developer": "system"}
MAX_ID_CHARS = 256  # tool-call ids are labels a client echoes back


class ChatError(ValueError):
    """A message breaks the rule. `field` names it (`messages[0].role`); str() is
    `field: reason`."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call an assistant message made: OpenAI's
    `{"id", "type": "function", "function": {"name", "arguments"}}`."""

    id: str
    name: str
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message as any API delivers it (checked by `check_messages`, not here:
    the role is whatever the client sent)."""

    role: str
    content: str = ""
    name: str = ""
    tool_call_id: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def to_template(self) -> dict[str, Any]:
        """The mapping a chat template reads (transformers' shape: OpenAI's fields, unset
        ones left out, so `message.tool_calls is defined` means there are some)."""
        out: dict[str, Any] = {"role": _TEMPLATE_ROLE.get(self.role, self.role)}
        out["content"] = self.content
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        return out

    def num_chars(self) -> int:
        """Every character the template may copy (the router's early size check)."""
        calls = sum(len(c.id) + len(c.name) + len(c.arguments) for c in self.tool_calls)
        return len(self.role) + len(self.content) + len(self.name) + len(self.tool_call_id) + calls


def check_messages(messages: Sequence[Message]) -> None:
    """Refuse a chat that breaks the rule (module docstring), naming the first bad field.

    Raises:
        ChatError: `field: reason`, the field as `messages[i].<name>`.
    """
    if not messages:
        raise ChatError("messages", "must hold at least one message")
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role not in ROLES:
            raise ChatError(
                f"{where}.role", f"must be one of {', '.join(ROLES)}; got {message.role!r}"
            )
        if message.tool_calls and message.role != "assistant":
            raise ChatError(
                f"{where}.tool_calls",
                f"only assistant messages make tool calls, not {message.role}",
            )
        if message.tool_call_id and message.role != "tool":
            raise ChatError(
                f"{where}.tool_call_id", f"only tool messages answer a call, not {message.role}"
            )
        for j, call in enumerate(message.tool_calls):
            _check_call(call, f"{where}.tool_calls[{j}]", call_ids)
            call_ids.add(call.id)
        if message.role == "tool":
            if not message.tool_call_id:
                raise ChatError(
                    f"{where}.tool_call_id", "a tool message needs the id of the call it answers"
                )
            if message.tool_call_id not in call_ids:
                raise ChatError(
                    f"{where}.tool_call_id",
                    f"{message.tool_call_id!r} answers no tool call of an earlier assistant "
                    "message",
                )


def _check_call(call: ToolCall, where: str, seen: set[str]) -> None:
    if not call.id:
        raise ChatError(f"{where}.id", "must be a non-empty string")
    if len(call.id) > MAX_ID_CHARS:
        raise ChatError(f"{where}.id", f"{len(call.id)} characters; at most {MAX_ID_CHARS}")
    if call.id in seen:
        raise ChatError(f"{where}.id", f"{call.id!r} is already the id of an earlier call")
    if not call.name:
        raise ChatError(f"{where}.function.name", "must be a non-empty string")


# -- OpenAI's JSON -----------------------------------------------------------------------------


def messages_from_json(value: Any) -> tuple[Message, ...]:
    """OpenAI's `messages` JSON -> checked `Message`s. Raises ChatError."""
    if not isinstance(value, list) or not value:
        raise ChatError("messages", "must be a non-empty list of {role, content} objects")
    messages = tuple(message_from_json(m, f"messages[{i}]") for i, m in enumerate(value))
    check_messages(messages)
    return messages


def message_from_json(value: Any, where: str) -> Message:
    """One message's JSON shapes (types only; `check_messages` holds the rule): content a
    string, a list of text parts or null; tool_calls a list of function calls.

    Raises:
        ChatError: naming the field.
    """
    obj = _object(value, where)
    role = obj.get("role")
    if not isinstance(role, str):
        raise ChatError(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {role!r}")
    content = obj.get("content")
    if content is None and role != "assistant":
        raise ChatError(f"{where}.content", "must be a string or a list of text parts, got null")
    return Message(
        role=role,
        content=_content(content, f"{where}.content"),
        name=_string(obj, "name", where),
        tool_call_id=_string(obj, "tool_call_id", where),
        tool_calls=_tool_calls(obj.get("tool_calls"), f"{where}.tool_calls"),
    )


def _content(value: Any, where: str) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise ChatError(where, f"must be a string or a list of text parts, got {kind(value)}")
    texts = []
    for j, part in enumerate(value):
        part = _object(part, f"{where}[{j}]")
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ChatError(
                f"{where}[{j}]", f"only text parts are supported, got type {part.get('type')!r}"
            )
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ChatError(where, f"must be a list of tool calls, got {kind(value)}")
    calls = []
    for j, item in enumerate(value):
        at = f"{where}[{j}]"
        obj = _object(item, at)
        if obj.get("type", "function") != "function":
            raise ChatError(f"{at}.type", f"must be 'function', got {obj.get('type')!r}")
        function = _object(obj.get("function"), f"{at}.function")
        calls.append(
            ToolCall(
                id=_string(obj, "id", at),
                name=_string(function, "name", f"{at}.function"),
                arguments=_string(function, "arguments", f"{at}.function"),
            )
        )
    return tuple(calls)


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ChatError(where, f"must be a JSON object, got {kind(value)}")
    return value


def _string(obj: Mapping[str, Any], name: str, where: str) -> str:
    value = obj.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ChatError(f"{where}.{name}", f"must be a string, got {kind(value)}")
    return value


def kind(value: Any) -> str:
    """A JSON value's type as a client would name it."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return "null" if value is None else names.get(type(value), "object")
