"""Structured outputs in OpenAI request bodies, as pure rules: `response_format` (json_schema
with `strict`, json_object, text) and vLLM's `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` -> the gRPC `Constraint` (tandem.engine.grammar checks it).

Reading a body only checks shapes (microseconds); `compile_constraint` compiles the schema,
regex or grammar without a vocabulary (milliseconds when large), once, which the HTTP API
runs off the event loop so that a bad one is a 400 naming the body's field before any
compute, and hands the core the compiled constraint.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.engine.grammar import Constraint
from tandem.services.common.rpc import convert
from tandem.v1 import router_pb2 as rpb

# Every field that sets a constraint; at most one may.
FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class FieldError(ValueError):
    """A body field that cannot be a constraint: `param` names it, `reason` says why."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason


def read(body: dict[str, Any]) -> tuple[rpb.Constraint, str] | None:
    """The constraint a body asks for and the field that asked (for error messages), or None
    for free text. Raises FieldError on a bad shape or two constraints at once."""
    found: list[tuple[rpb.Constraint, str]] = []
    for name in FIELDS:
        value = body.get(name)
        if value is None:
            continue
        read_one = _response_format if name == "response_format" else _guided
        got = read_one(name, value)
        if got is not None:
            found.append(got)
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise FieldError(found[1][1], f"set one constraint at a time, got {names}")
    return found[0] if found else None


def compile_constraint(constraint: rpb.Constraint, param: str) -> Constraint | FieldError:
    """The constraint a body asked for, compiled (tandem.engine.grammar.Constraint's
    validation: milliseconds for a large schema, so off the event loop), or the error naming
    `param`, the body's field."""
    try:
        compiled = convert.constraint_from_proto(constraint)
    except ValueError as exc:
        message = str(exc).removeprefix("constraint.")
        kind = constraint.WhichOneof("kind") or ""
        return FieldError(param, message.removeprefix(f"{kind}: "))
    assert compiled is not None  # `read` returns only constraints of a kind
    return compiled


def _response_format(name: str, value: Any) -> tuple[rpb.Constraint, str] | None:
    if not isinstance(value, dict):
        raise FieldError(name, f"must be an object, got {_kind(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return rpb.Constraint(json_object=True), name
    if kind != "json_schema":
        raise FieldError(
            f"{name}.type", f'must be "text", "json_object" or "json_schema", got {kind!r}'
        )
    spec = value.get("json_schema")
    where = f"{name}.json_schema"
    if not isinstance(spec, dict):
        raise FieldError(where, f"must be an object with the schema, got {_kind(spec)}")
    label = spec.get("name")
    if label is not None and not isinstance(label, str):
        raise FieldError(f"{where}.name", f"must be a string, got {_kind(label)}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FieldError(f"{where}.strict", f"must be a boolean, got {_kind(strict)}")
    # strict or not, the output always follows the schema: sampling cannot leave it.
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise FieldError(f"{where}.schema", f"must be a JSON Schema object, got {_kind(schema)}")
    return rpb.Constraint(json_schema=_dump(schema)), f"{where}.schema"


def _guided(name: str, value: Any) -> tuple[rpb.Constraint, str]:
    if name == "guided_json":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise FieldError(name, f"not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise FieldError(name, f"must be a JSON Schema object, got {_kind(value)}")
        return rpb.Constraint(json_schema=_dump(value)), name
    if name == "guided_choice":
        if not isinstance(value, list) or not value:
            raise FieldError(name, f"must be a non-empty list of strings, got {_kind(value)}")
        if not all(isinstance(c, str) and c for c in value):
            raise FieldError(name, "must hold non-empty strings only")
        return rpb.Constraint(choice=rpb.Choices(choices=value)), name
    if not isinstance(value, str) or not value:
        raise FieldError(name, f"must be a non-empty string, got {_kind(value)}")
    if name == "guided_regex":
        return rpb.Constraint(regex=value), name
    return rpb.Constraint(grammar=value), name


def _dump(schema: dict[str, Any]) -> str:
    # One text per schema content (key order aside): one compiled grammar in every cache.
    return json.dumps(schema, separators=(",", ":"), sort_keys=True)


def _kind(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return "null" if value is None else names.get(type(value), "object")
