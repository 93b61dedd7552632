"""Tool-call formats: how a model writes its calls, how to read them back (whole or while
streaming), the grammar that forces them, and the system preamble for a template that does
not render tools itself.

    hermes       Hermes / Qwen:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
                 (several: one block each, separated by a newline); text before is content
    llama3_json  Llama 3.x:      {"name": "f", "parameters": {...}}  (several: joined by "; ");
                 the whole answer
    mistral      Mistral:        [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...];
                 text before is content

One rule (`ToolFormat.read`) reads a whole answer and, for a stream, the text so far:

  - the calls are the run of whole calls from where the calls begin: each call object once it
    closes, to a function in the tools, with an object of arguments;
  - the content is the text outside them: before the calls (its trailing whitespace dropped),
    and, when something that is not a call follows the run (text, a JSON error, an unknown
    function, arguments that are not an object), everything from the end of the last call on
    (its closing tag or list bracket included in the call) -- "Let me check." + calls +
    "\nDone." Nothing after that is a call;
  - with no whole call, all of the text is content (the caller answers it as text with
    finish_reason "stop");
  - an answer cut short (max_tokens, a stop string) keeps the calls written whole and drops
    the call being written when the text ended.

A stream sends each call once its object closes (tandem.tools.stream), and cannot take it
back: so a call followed by text stays a call in the whole answer too, and the text after it
is content in both. The stream sends what `read` of the text so far settles, and the whole
answer is `read` of the whole text, so the two always agree.

The grammar that forces calls (a required or named tool choice) lets the answer end after
each whole call, and writes at most MAX_FORCED_CALLS of them: a model that would go on
calling (a small one repeats itself) ends there instead of at max_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from tandem.tools.scan import WHITESPACE, CallScan, Malformed, scan_call, skip_ws
from tandem.tools.spec import ChoiceMode, Tool, ToolChoice

# Calls one forced answer may make with parallel_tool_calls (OpenAI sets no number; a model
# looping on calls otherwise runs to max_tokens, by default the whole context).
MAX_FORCED_CALLS = 16
_MORE = f"{{0,{MAX_FORCED_CALLS - 1}}}"  # Lark: the calls after the first
# The forced JSON is written as json.dumps writes it (tandem.engine.grammar's defaults).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text, as the model wrote it


@dataclass(frozen=True, slots=True)
class Parsed:
    """An answer read for calls: `content` (the text outside the calls; all of it when there
    are none), the calls, and `after`: the part of `content` that followed the calls (text
    that is not a call; module docstring)."""

    content: str
    calls: tuple[ParsedCall, ...] = ()
    after: str = ""

    @property
    def before(self) -> str:
        """The part of `content` before the calls."""
        return self.content[: len(self.content) - len(self.after)]


class ToolFormat:
    """One model family's tool-call syntax. Subclasses set the class attributes and `scan`."""

    name = ""
    argument_key = "arguments"  # the key the format writes (and the grammar forces)
    argument_keys: tuple[str, ...] = ("arguments", "parameters")  # keys read
    marker = ""  # what opens the calls ("" : a call is the whole answer)

    # -- reading ------------------------------------------------------------------------

    def start(self, text: str) -> int | None:
        """Where the calls begin in `text`, if they have begun."""
        i = text.find(self.marker)
        return None if i < 0 else i

    def hold(self, text: str) -> int:
        """With no call begun: text from this index on may still turn out to begin one (a
        partial marker, or whitespace that would precede it), so a stream withholds it."""
        held = len(text)
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if text.endswith(self.marker[:k]):
                held = len(text) - k
                break
        while held > 0 and text[held - 1] in WHITESPACE:
            held -= 1
        return held

    def scan(self, text: str, start: int, calls: list[CallScan]) -> None:
        """Appends to `calls` the call objects from `start` as far as the text goes (only
        the last may be open: `end` None). Raises Malformed where the text stops being calls
        in this format (`calls` keeps those before)."""
        raise NotImplementedError

    def after_call(self, text: str, end: int) -> int:
        """Where the text after a call object ending at `end` begins: past what closes the
        call (hermes's </tool_call>, mistral's list bracket), when it follows."""
        return end

    def parse(self, text: str, names: Collection[str]) -> Parsed:
        """A whole answer: its calls to functions in `names` and its content (module
        docstring)."""
        return self.read(text, names, final=True)

    def read(self, text: str, names: Collection[str], final: bool) -> Parsed:
        """The rule (module docstring). `final`: `text` is the whole answer. Otherwise it is
        an answer so far, and the result is what any answer that goes on from it has: its
        calls come first in that answer's calls, its content begins that answer's content
        and its `after` that answer's `after` (what a stream may send now)."""
        start = self.start(text)
        if start is None:
            return Parsed(text if final else text[: self.hold(text)])
        scans: list[CallScan] = []
        stopped = False  # something that is not a call ended the run
        try:
            self.scan(text, start, scans)
        except Malformed:
            stopped = True
        calls: list[ParsedCall] = []
        end = start
        for scan in scans:
            if scan.end is None:
                break  # open: cut short (final) or not whole yet
            call = read_call(scan, names)
            if call is None:
                stopped = True
                break
            calls.append(call)
            end = scan.end
        if not calls:
            # Nothing after a stop is a call: the text is all content from here on.
            return Parsed(text if final or stopped else text[:start].rstrip())
        before = text[:start].rstrip()
        if not stopped:
            return Parsed(before, tuple(calls))
        after = text[self.after_call(text, end) :]
        if not before:
            after = after.lstrip()
        return Parsed(before + after, tuple(calls), after)

    # -- forcing --------------------------------------------------------------------------

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> str:
        """A Lark grammar (llguidance's, with %json) whose every sentence is calls in this
        format to `tools` (the named one only, once, for a FUNCTION choice; with `parallel`,
        1 to MAX_FORCED_CALLS, the answer may end after each) with arguments that match each
        tool's parameters schema."""
        assert choice.forced
        if choice.mode == ChoiceMode.FUNCTION:
            tools = [t for t in tools if t.name == choice.name]
            parallel = False
        assert tools, "a forced choice needs a tool"
        rules = [f"call_{i}: %json {json.dumps(self._call_schema(t))}" for i, t in enumerate(tools)]
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        return "\n".join([self._start_rule(parallel), f"call: {alternatives}", *rules]) + "\n"

    def _start_rule(self, parallel: bool) -> str:
        raise NotImplementedError

    def _call_schema(self, tool: Tool) -> dict[str, Any]:
        parameters = tool.schema
        schema: dict[str, Any] = {
            "type": "object",
            "properties": {"name": {"const": tool.name}, self.argument_key: parameters},
            "required": ["name", self.argument_key],
            "additionalProperties": False,
            "x-guidance": _JSON_STYLE,
        }
        # References resolve from the document's root: move the tool's definitions there.
        for key in ("$defs", "definitions"):
            if key in parameters:
                parameters = {k: v for k, v in parameters.items() if k != key}
                schema["properties"][self.argument_key] = parameters
                schema[key] = tool.schema[key]
        return schema

    # -- templates without tools ------------------------------------------------------------

    def write_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """(name, arguments text) calls as the model would have written them (a template
        that does not render an assistant's tool_calls gets them in its content)."""
        raise NotImplementedError

    def _object(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name)}, "{self.argument_key}": {arguments or "{}"}}}'

    def preamble(self, tools: Sequence[Tool]) -> str:
        """A system text that describes the tools and this format, for a chat template that
        does not render `tools`."""
        raise NotImplementedError


def read_call(scan: CallScan, names: Collection[str]) -> ParsedCall | None:
    """A closed call object as a call, or None when it is not one: no name, a function not
    in `names`, arguments that are not a JSON object (absent arguments are {})."""
    assert scan.end is not None
    arguments = scan.arguments or "{}"
    if scan.name is None or scan.name not in names or not _is_object(arguments):
        return None
    return ParsedCall(scan.name, arguments)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _tool_lines(tools: Sequence[Tool]) -> str:
    return "\n".join(json.dumps(t.to_template()) for t in tools)


class Hermes(ToolFormat):
    name = "hermes"
    marker = "<tool_call>"
    close = "</tool_call>"

    def scan(self, text: str, start: int, calls: list[CallScan]) -> None:
        pos = start
        while True:
            pos = skip_ws(text, pos + len(self.marker))
            if pos >= len(text):
                return
            call = scan_call(text, pos, self.argument_keys)
            calls.append(call)
            if call.end is None:
                return
            pos = skip_ws(text, call.end)
            if pos >= len(text):
                return  # a last block the model did not close
            if text.startswith(self.close, pos):
                pos = skip_ws(text, pos + len(self.close))
            elif self.close.startswith(text[pos:]):
                return
            else:
                raise Malformed(f"expected {self.close} at {pos}")
            if pos >= len(text):
                return
            if not text.startswith(self.marker, pos):
                if self.marker.startswith(text[pos:]):
                    return
                raise Malformed(f"text after the calls at {pos}")

    def after_call(self, text: str, end: int) -> int:
        pos = skip_ws(text, end)
        return pos + len(self.close) if text.startswith(self.close, pos) else end

    def write_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return "\n".join(
            f"{self.marker}\n{self._object(name, args)}\n{self.close}" for name, args in calls
        )

    def _start_rule(self, parallel: bool) -> str:
        block = f"{json.dumps(self.marker + chr(10))} call {json.dumps(chr(10) + self.close)}"
        if not parallel:
            return f"start: {block}"
        # The newline after a block opens no further call by itself: the answer may end there
        # too (a model that writes it would otherwise be forced into one more call).
        return f'start: block ("\\n" block){_MORE} "\\n"?\nblock: {block}'

    def preamble(self, tools: Sequence[Tool]) -> str:
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{_tool_lines(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )


class Llama3Json(ToolFormat):
    name = "llama3_json"
    argument_key = "parameters"
    argument_keys = ("parameters", "arguments")

    def start(self, text: str) -> int | None:
        i = skip_ws(text, 0)
        return i if i < len(text) and text[i] == "{" else None

    def hold(self, text: str) -> int:
        # Only an answer that opens with "{" is a call: hold nothing once it cannot be.
        return 0 if not text.strip() else len(text)

    def scan(self, text: str, start: int, calls: list[CallScan]) -> None:
        pos = start
        while True:
            call = scan_call(text, pos, self.argument_keys)
            calls.append(call)
            if call.end is None:
                return
            pos = skip_ws(text, call.end)
            if pos >= len(text):
                return
            if text[pos] != ";":
                raise Malformed(f"text after the call at {pos}")
            pos = skip_ws(text, pos + 1)
            if pos >= len(text):
                return
            if text[pos] != "{":
                raise Malformed(f"expected a call after ';' at {pos}")

    def write_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return "; ".join(self._object(name, args) for name, args in calls)

    def _start_rule(self, parallel: bool) -> str:
        return f'start: call ("; " call){_MORE}' if parallel else "start: call"

    def preamble(self, tools: Sequence[Tool]) -> str:
        return (
            "You have access to the following functions. To call a function, respond with "
            'only JSON in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n"
            f"{_tool_lines(tools)}"
        )


class Mistral(ToolFormat):
    """`[TOOL_CALLS]` is a special token in Mistral's vocabularies, which decoding drops: an
    answer that is a bare list of call objects (`[{...`) is calls too."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    _BARE = re.compile(r"\s*\[\s*\{")
    _BARE_PREFIX = re.compile(r"\s*(\[\s*)?")

    def start(self, text: str) -> int | None:
        # A bare list first: an answer that opens with one is read from there, whatever
        # follows (a marker later in it must not move the start the stream has read from).
        if self._BARE.match(text):
            return skip_ws(text, 0)
        i = text.find(self.marker)
        return None if i < 0 else i

    def hold(self, text: str) -> int:
        return 0 if self._BARE_PREFIX.fullmatch(text) else ToolFormat.hold(self, text)

    def scan(self, text: str, start: int, calls: list[CallScan]) -> None:
        if text.startswith(self.marker, start):
            start += len(self.marker)
        pos = skip_ws(text, start)
        if pos >= len(text):
            return
        if text[pos] != "[":
            raise Malformed(f"expected '[' after {self.marker}")
        pos += 1
        while True:
            pos = skip_ws(text, pos)
            if pos >= len(text):
                return
            call = scan_call(text, pos, self.argument_keys)
            calls.append(call)
            if call.end is None:
                return
            pos = skip_ws(text, call.end)
            if pos >= len(text):
                return
            if text[pos] == ",":
                pos += 1
                continue
            if text[pos] != "]":
                raise Malformed(f"expected ',' or ']' at {pos}")
            if skip_ws(text, pos + 1) < len(text):
                raise Malformed("text after the calls")
            return

    def after_call(self, text: str, end: int) -> int:
        pos = skip_ws(text, end)
        return pos + 1 if text.startswith("]", pos) else end

    def write_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return f"{self.marker}[{', '.join(self._object(n, a) for n, a in calls)}]"

    def _start_rule(self, parallel: bool) -> str:
        calls = f'call (", " call){_MORE}' if parallel else "call"
        return f'start: "{self.marker}[" {calls} "]"'

    def preamble(self, tools: Sequence[Tool]) -> str:
        return (
            "You have access to the following functions:\n"
            f"{_tool_lines(tools)}\n\n"
            f"To call functions, answer with {self.marker} followed by a JSON list of calls: "
            f'{self.marker}[{{"name": <function-name>, "arguments": <args-json-object>}}]'
        )


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}
DEFAULT_FORMAT = "hermes"


def get_format(name: str) -> ToolFormat:
    """Raises ValueError naming the formats."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"tool-call parser must be one of {', '.join(FORMATS)} or auto, got {name!r}"
        ) from None


def detect_format(template: str | None) -> str | None:
    """The format a chat template's own text shows, or None when it shows none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters": dictionary' in template:
        return "llama3_json"
    return None


def template_takes_tools(template: str | None) -> bool:
    """The template reads a `tools` variable (transformers passes the definitions so)."""
    if not template:
        return False
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(ast)
