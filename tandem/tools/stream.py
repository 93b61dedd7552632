"""Reading tool calls while the answer streams: text in, OpenAI-shaped events out.

    feed("Sure.\\n<tool_")      -> [Content("Sure.")]         "\\n<tool_" may open a call: held
    feed('call>\\n{"name": "f", "arguments": {"a"')
                                -> [CallStart(0, "f"), Arguments(0, '{"a"')]
    feed(': 1}}\\n</tool_call>') -> [Arguments(0, ": 1}")]
    finish()                    -> []                          has_calls: True

The events join to `ToolFormat.parse` of the whole text: the same content, the same calls
(names, and arguments to the character). Text that turns out not to be calls is released as
content at `finish`, as long as no call has been announced; a call announced and then broken
(only possible when the grammar does not force the calls) keeps what was sent.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from tandem.tools.formats import ToolFormat
from tandem.tools.scan import Malformed


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments


@dataclass(slots=True)
class ToolCallStream:
    """One answer's text, read for calls in `format` to the functions in `names`."""

    format: ToolFormat
    names: Collection[str]
    text: str = ""
    num_content_chars: int = 0  # content sent: text[:num_content_chars]
    num_argument_chars: list[int] = field(default_factory=list)  # per announced call
    broken: bool = False  # the calls cannot parse: nothing more until finish

    @property
    def has_calls(self) -> bool:
        return bool(self.num_argument_chars)

    def feed(self, delta: str) -> list[Event]:
        self.text += delta
        if self.broken:
            return []
        text = self.text
        start = self.format.start(text)
        if start is None:
            return self._content(self.format.hold(text))
        events = self._content(len(text[:start].rstrip()))
        try:
            scans, _ = self.format.scan(text, start)
        except Malformed:
            self.broken = True
            return events
        for index, scan in enumerate(scans):
            if scan.name is None:
                break
            if scan.name not in self.names:
                self.broken = True
                break
            if index == len(self.num_argument_chars):
                events.append(CallStart(index, scan.name))
                self.num_argument_chars.append(0)
            events += self._arguments(index, scan.arguments)
        return events

    def finish(self) -> list[Event]:
        """The rest, once the answer is complete."""
        parsed = self.format.parse(self.text, self.names)
        if not parsed.calls:
            if self.has_calls:
                return []
            return self._content(len(self.text))
        events: list[Event] = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.num_argument_chars):
                events.append(CallStart(index, call.name))
                self.num_argument_chars.append(0)
            events += self._arguments(index, call.arguments)
        return events

    def _content(self, end: int) -> list[Event]:
        if end <= self.num_content_chars or self.has_calls:
            return []
        text = self.text[self.num_content_chars : end]
        self.num_content_chars = end
        return [Content(text)]

    def _arguments(self, index: int, arguments: str) -> list[Event]:
        sent = self.num_argument_chars[index]
        if len(arguments) <= sent:
            return []
        self.num_argument_chars[index] = len(arguments)
        return [Arguments(index, arguments[sent:])]
