"""Tool definitions and the tool choice, as OpenAI's API takes them, checked by one rule.

    tools        [{"type": "function", "function": {"name", "description", "parameters"}}]:
                 names unique, 1-64 of [a-zA-Z0-9_-]; parameters (optional: no arguments)
                 a JSON Schema of an object that compiles (tandem.engine.grammar)
    tool_choice  "none" (tools dropped from the prompt), "auto" (the model chooses; parsed
                 after), "required" (at least one call, enforced by the grammar) or
                 {"type": "function", "function": {"name"}} (that call, enforced)
    parallel     parallel_tool_calls: more than one call per answer (default true)

A refusal is a `ToolError` naming the field as OpenAI's API does (`tools[1].function.name`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tandem.chat import kind

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = '{"additionalProperties":false,"properties":{},"type":"object"}'


class ToolError(ValueError):
    """A tool or tool choice breaks the rule: `field` names it; str() is `field: reason`."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call. `parameters`: its arguments' JSON Schema as JSON text
    (sorted keys, no spaces: one text per schema)."""

    name: str
    description: str = ""
    parameters: str = NO_PARAMETERS

    @property
    def schema(self) -> dict[str, Any]:
        value = json.loads(self.parameters)
        assert isinstance(value, dict)
        return value

    def to_template(self) -> dict[str, Any]:
        """transformers' shape, as chat templates read `tools`."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


class ChoiceMode(StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    FUNCTION = "function"  # the named function


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ChoiceMode = ChoiceMode.AUTO
    name: str = ""  # FUNCTION: the function's name

    @property
    def forced(self) -> bool:
        """The grammar makes the answer a call."""
        return self.mode in (ChoiceMode.REQUIRED, ChoiceMode.FUNCTION)


def dump_schema(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"), sort_keys=True)


def check_tools(tools: Sequence[Tool], choice: ToolChoice, compile_schemas: bool = True) -> None:
    """Refuse tools or a choice that break the rule (module docstring), naming the field.
    `compile_schemas`: compile each parameters schema (milliseconds each; off the event
    loop at a service).

    Raises:
        ToolError: `field: reason`.
    """
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"{len(tools)} tools; at most {MAX_TOOLS}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}].function"
        if not _NAME.fullmatch(tool.name):
            raise ToolError(
                f"{where}.name", f"must be 1-64 of a-z, A-Z, 0-9, _ and -; got {tool.name!r}"
            )
        if tool.name in seen:
            raise ToolError(f"{where}.name", f"{tool.name!r} is already the name of a tool")
        seen.add(tool.name)
        try:
            schema = json.loads(tool.parameters)
        except json.JSONDecodeError as exc:
            raise ToolError(f"{where}.parameters", f"not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ToolError(
                f"{where}.parameters", f"must be a JSON Schema object, got {kind(schema)}"
            )
        if schema.get("type", "object") != "object":
            raise ToolError(
                f"{where}.parameters",
                f'must describe an object (type "object"), got type {schema.get("type")!r}',
            )
        if compile_schemas:
            # Here, not at the top: tandem.client reads tools without the engine (torch).
            from tandem.engine.grammar import Constraint

            try:
                Constraint.json_schema(tool.parameters)
            except ValueError as exc:
                reason = str(exc).removeprefix("json_schema: ")
                raise ToolError(f"{where}.parameters", reason) from None
    if choice.mode == ChoiceMode.FUNCTION and choice.name not in seen:
        known = ", ".join(repr(t.name) for t in tools) or "none"
        raise ToolError(
            "tool_choice.function.name", f"{choice.name!r} is not a tool; the tools: {known}"
        )
    if choice.mode == ChoiceMode.REQUIRED and not tools:
        raise ToolError("tool_choice", '"required" needs at least one tool in tools')


# -- OpenAI's JSON -----------------------------------------------------------------------------


def tools_from_json(value: Any, where: str = "tools", flat: bool = False) -> tuple[Tool, ...]:
    """OpenAI's `tools` (`flat`: the Responses API's function tools, {"type": "function",
    "name", ...}) -> Tools; shapes only (`check_tools` holds the rule). Raises ToolError."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ToolError(where, f"must be a list of tools, got {kind(value)}")
    out = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        obj = _object(item, at)
        if obj.get("type") != "function":
            raise ToolError(
                f"{at}.type", f"only function tools are supported, got {obj.get('type')!r}"
            )
        out.append(_function(obj, at) if flat else _function(obj.get("function"), f"{at}.function"))
    return tuple(out)


def _function(value: Any, where: str) -> Tool:
    obj = _object(value, where)
    name = obj.get("name")
    if not isinstance(name, str):
        raise ToolError(f"{where}.name", f"must be a string, got {kind(name)}")
    description = obj.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.description", f"must be a string, got {kind(description)}")
    strict = obj.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.strict", f"must be a boolean, got {kind(strict)}")
    parameters = obj.get("parameters")
    if parameters is None:
        return Tool(name, description or "")
    if not isinstance(parameters, dict):
        raise ToolError(
            f"{where}.parameters", f"must be a JSON Schema object, got {kind(parameters)}"
        )
    return Tool(name, description or "", dump_schema(parameters))


def tool_choice_from_json(value: Any, has_tools: bool, where: str = "tool_choice") -> ToolChoice:
    """OpenAI's `tool_choice`: unset means auto with tools and none without (OpenAI's
    default). The Responses API names a function flat ({"type": "function", "name"})."""
    if value is None:
        return ToolChoice(ChoiceMode.AUTO if has_tools else ChoiceMode.NONE)
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ToolError(
                where, f'must be "none", "auto", "required" or a function, got {value!r}'
            )
        return ToolChoice(ChoiceMode(value))
    obj = _object(value, where)
    if obj.get("type") != "function":
        raise ToolError(f"{where}.type", f"must be 'function', got {obj.get('type')!r}")
    if "function" in obj:
        function = _object(obj["function"], f"{where}.function")
        name, at = function.get("name"), f"{where}.function.name"
    else:
        name, at = obj.get("name"), f"{where}.name"
    if not isinstance(name, str) or not name:
        raise ToolError(at, f"must be a non-empty string, got {kind(name)}")
    return ToolChoice(ChoiceMode.FUNCTION, name)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ToolError(where, f"must be a JSON object, got {kind(value)}")
    return value
