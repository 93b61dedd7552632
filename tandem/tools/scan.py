"""A JSON scanner for model output that may still be arriving: where a value ends (or that it
has not ended yet), and one tool-call object's name and raw arguments text.

Raw text, never re-serialized: the arguments a client receives are the characters the model
wrote, so a streamed call's arguments are exactly the whole answer's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")
WHITESPACE = " \t\r\n"


class Malformed(Exception):
    """The text cannot be what the format says (not merely unfinished)."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at text[i] == '"'; None: not closed yet."""
    assert text[i] == '"'
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        if c == "\n":
            raise Malformed("a newline inside a JSON string")
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i]; None: it may still go on.
    Raises Malformed on a character no JSON value starts with or an unbalanced bracket."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        stack = [c]
        j = i + 1
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                stack.append(c)
            elif c in "}]":
                if "{["["}]".index(c)] != stack.pop():
                    raise Malformed(f"unbalanced {c!r} at {j}")
                if not stack:
                    return j + 1
            j += 1
        return None
    match = _SCALAR.match(text, i)
    if match is None:
        raise Malformed(f"no JSON value starts with {c!r}")
    return None if match.end() == len(text) else match.end()


@dataclass(frozen=True, slots=True)
class CallScan:
    """One call object as far as the text goes.

    name: the function's name once its string is complete (None before).
    arguments: the arguments value's raw text so far ("" before it starts).
    arguments_done: the arguments value is complete.
    end: the object's end (exclusive) once it is closed, else None.
    """

    name: str | None
    arguments: str
    arguments_done: bool
    end: int | None


def scan_call(text: str, i: int, argument_keys: Sequence[str]) -> CallScan:
    """The call object `{"name": ..., "<argument key>": {...}}` opening at text[i] == '{'.
    Other keys are skipped (Mistral's "id"). Raises Malformed."""
    if text[i] != "{":
        raise Malformed(f"a call is a JSON object, found {text[i]!r}")
    name: str | None = None
    arguments, done = "", False
    j = i + 1
    first = True
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return CallScan(name, arguments, done, None)
        if text[j] == "}":
            return CallScan(name, arguments, done, j + 1)
        if not first:
            if text[j] != ",":
                raise Malformed(f"expected ',' or '}}' at {j}, found {text[j]!r}")
            j = skip_ws(text, j + 1)
            if j >= len(text):
                return CallScan(name, arguments, done, None)
        first = False
        if text[j] != '"':
            raise Malformed(f"expected a key at {j}, found {text[j]!r}")
        key_end = string_end(text, j)
        if key_end is None:
            return CallScan(name, arguments, done, None)
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return CallScan(name, arguments, done, None)
        if text[j] != ":":
            raise Malformed(f"expected ':' at {j}, found {text[j]!r}")
        start = skip_ws(text, j + 1)
        end = value_end(text, start)
        if key == "name":
            if start < len(text) and text[start] != '"':
                raise Malformed("a call's name is a string")
            if end is None:
                return CallScan(name, arguments, done, None)
            name = json.loads(text[start:end])
        elif key in argument_keys:
            if start < len(text) and text[start] != "{":
                raise Malformed("a call's arguments are a JSON object")
            arguments = text[start : end if end is not None else len(text)]
            done = end is not None
        if end is None:
            return CallScan(name, arguments, done, None)
        j = end
