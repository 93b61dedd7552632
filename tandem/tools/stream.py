"""Reading tool calls while the answer streams: text in, OpenAI-shaped events out.

    feed("Sure.\\n<tool_")      -> [Content("Sure.")]         "\\n<tool_" may open a call: held
    feed('call>\\n{"name": "f", "arguments": {"a"')
                                -> []                          the call is not whole yet
    feed(': 1}}\\n</tool_call>') -> [CallStart(0, "f"), Arguments(0, '{"a": 1}')]
    finish()                    -> []                          has_calls: True

A call is sent once its object closes, whole: a call cut short (max_tokens, a stop string)
is never sent, as `ToolFormat.parse` drops it, so the events join to the whole text's parse
however the answer ends: the same content, the same calls (names, and arguments to the
character). Text that turns out not to be calls is released as content at `finish`, as long
as no call has been sent; a call sent and then followed by text that is not calls (only
possible when the grammar does not force the calls) keeps what was sent.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tandem.tools.formats import ParsedCall, ToolFormat, read_call
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
    num_calls: int = 0  # calls sent (each whole)
    broken: bool = False  # the calls cannot parse: nothing more until finish

    @property
    def has_calls(self) -> bool:
        return self.num_calls > 0

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
            scans = self.format.scan(text, start)
        except Malformed:
            self.broken = True
            return events
        for scan in scans[self.num_calls :]:
            if scan.end is None:
                break  # not whole yet
            call = read_call(scan, self.names)
            if call is None:
                self.broken = True
                break
            events += self._call(call)
        return events

    def finish(self) -> list[Event]:
        """The rest, once the answer is complete (however it ended)."""
        parsed = self.format.parse(self.text, self.names)
        if not parsed.calls:
            return [] if self.has_calls else self._content(len(self.text))
        events: list[Event] = []
        for call in parsed.calls[self.num_calls :]:
            events += self._call(call)
        return events

    def _content(self, end: int) -> list[Event]:
        if end <= self.num_content_chars or self.has_calls:
            return []
        text = self.text[self.num_content_chars : end]
        self.num_content_chars = end
        return [Content(text)]

    def _call(self, call: ParsedCall) -> list[Event]:
        index = self.num_calls
        self.num_calls += 1
        return [CallStart(index, call.name), Arguments(index, call.arguments)]
