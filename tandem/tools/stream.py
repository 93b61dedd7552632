"""Reading tool calls while the answer streams: text in, OpenAI-shaped events out.

    feed("Sure.\\n<tool_")      -> [Content("Sure.")]         "\\n<tool_" may open a call: held
    feed('call>\\n{"name": "f", "arguments": {"a"')
                                -> []                          the call is not whole yet
    feed(': 1}}\\n</tool_call>') -> [CallStart(0, "f"), Arguments(0, '{"a": 1}')]
    feed("\\nDone.")            -> [Content("\\nDone.")]       not a call: content after them
    finish()                    -> []                          has_calls: True

Each feed sends what `ToolFormat.read` of the text so far settles, and `finish` the rest of
`ToolFormat.parse` of the whole text: one rule, so the events join to the whole answer's
parse however the answer ends -- the same content, the same calls (names, and arguments to
the character). A call is sent once its object closes, whole: a call cut short (max_tokens, a
stop string) is never sent, as the whole parse drops it. Text that turns out not to be calls
is content: all of it when no call was whole before it, as soon as that is certain; after a
call it cannot take back (only possible when the grammar does not force the calls), it is
content after the call, in the stream as in the whole answer (`Parsed.after`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tandem.tools.formats import Parsed, ToolFormat


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
    num_content_chars: int = 0  # content sent: the first chars of the answer's content
    num_calls: int = 0  # calls sent (each whole)

    @property
    def has_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, delta: str) -> list[Event]:
        self.text += delta
        return self._send(self.format.read(self.text, self.names, final=False))

    def finish(self) -> list[Event]:
        """The rest, once the answer is complete (however it ended)."""
        return self._send(self.format.parse(self.text, self.names))

    def _send(self, read: Parsed) -> list[Event]:
        """What `read` settles beyond what was sent, in the answer's order: content before
        the calls, the calls, content after them."""
        events: list[Event] = []
        events += self._content(read.content, len(read.before))
        for call in read.calls[self.num_calls :]:
            index = self.num_calls
            self.num_calls += 1
            events += [CallStart(index, call.name), Arguments(index, call.arguments)]
        events += self._content(read.content, len(read.content))
        return events

    def _content(self, content: str, end: int) -> list[Event]:
        if end <= self.num_content_chars:
            return []
        text = content[self.num_content_chars : end]
        self.num_content_chars = end
        return [Content(text)]
