"""Function tools on the Responses API (POST /v1/responses), as pure rules (the body's
`tools`, flat function tools, are read by tandem.services.router.openai.tools): an answer with
calls -> its output items (text first, as a `message`, then one `function_call` per call)
and, streamed, OpenAI's events for them:

    response.output_item.added             {"type": "function_call", "id": "fc_...",
                                            "call_id": "call_...", "name", "arguments": ""}
    response.function_call_arguments.delta {"item_id", "output_index", "delta"}
    response.function_call_arguments.done  {"item_id", "output_index", "name", "arguments"}
    response.output_item.done              the item, arguments whole, status completed

A message item is opened only when text comes (tandem.tools.stream holds back text that may
open a call); an answer with neither text nor calls still has its (empty) message. A call is
added once its object closes, its arguments in one delta: a call cut short by
max_output_tokens is in neither the stream nor the whole response (status incomplete). Text
after the calls that is not a call (tandem.tools.formats: `Parsed.after`) is a second message
item after them, streamed and whole alike.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.services.router.openai import responses as responses
from tandem.services.router.openai.tools import new_call_id
from tandem.tools import Arguments, CallStart, Content, Event, ToolCallStream, ToolFormat
from tandem.v1 import router_pb2 as rpb

JSON = dict[str, Any]


@dataclass(slots=True)
class ToolReply(responses.Reply):
    """A response whose answer may be tool calls (the request has tools and a choice other
    than none): its output items, whole or streamed (module docstring)."""

    format: ToolFormat | None = None
    items: list[JSON] = field(default_factory=list)  # the output so far, in order
    reader: ToolCallStream | None = None

    def __post_init__(self) -> None:
        assert self.format is not None
        self.reader = ToolCallStream(self.format, self.parsed.tool_names)

    def response(self, complete: rpb.Complete | None = None) -> JSON:
        out = responses.Reply.response(self, complete)
        if complete is not None:
            out["output"] = [dict(item) for item in self.items]
        return out

    def whole(self, chunks: Sequence[rpb.Chunk], complete: rpb.Complete) -> JSON:
        text = "".join(c.text for c in chunks)
        self.text.append(text)
        assert self.format is not None
        status, _ = responses._status(complete.finish_reason)
        parsed = self.format.parse(text, self.parsed.tool_names)
        if parsed.calls:  # cut by max_output_tokens: the whole calls, status incomplete
            if parsed.before:  # closed by the first call, as streamed
                self.items.append(self._message("completed", parsed.before))
            for call in parsed.calls:
                self.items.append(_call_item(call.name, call.arguments, "completed"))
            if parsed.after:  # the last item, as streamed: closed with the response
                self.message_id = _message_id()
                self.items.append(self._message(status, parsed.after))
        else:
            self.items.append(self._message(status, text))
        return self.response(complete)

    # -- streaming ------------------------------------------------------------------------

    def opening(self) -> list[JSON]:
        """created and in_progress: what the output is, the text will tell."""
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def deltas(self, chunk: rpb.Chunk) -> list[JSON]:
        assert self.reader is not None
        self.text.append(chunk.text)
        return [e for event in self.reader.feed(chunk.text) for e in self._events(event)]

    def closing(self, complete: rpb.Complete) -> list[JSON]:
        assert self.reader is not None
        events = [e for event in self.reader.finish() for e in self._events(event)]
        status, _ = responses._status(complete.finish_reason)
        if not self.items:  # no text and no call: an empty message, as without tools
            events += self._open_message()
        events += self._close_last(status)
        final = self.response(complete)
        kind = "response.completed" if status == "completed" else f"response.{status}"
        return [*events, self._event(kind, response=final)]

    def _events(self, event: Event) -> list[JSON]:
        events: list[JSON] = []
        if isinstance(event, Content):
            if not self.items or self.items[-1]["type"] != "message":
                events += self._close_last("completed")  # text after the calls
                events += self._open_message()
            message = self.items[-1]
            message["content"][0]["text"] += event.text
            events.append(
                self._event(
                    "response.output_text.delta", **self._at(), delta=event.text, logprobs=[]
                )
            )
        elif isinstance(event, CallStart):
            events += self._close_last("completed")
            item = _call_item(event.name, "", "in_progress")
            self.items.append(item)
            events.append(
                self._event(
                    "response.output_item.added", output_index=len(self.items) - 1, item=dict(item)
                )
            )
        else:
            assert isinstance(event, Arguments)
            item = self.items[-1]
            item["arguments"] += event.text
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    delta=event.text,
                )
            )
        return events

    def _open_message(self) -> list[JSON]:
        if self.items:  # after the calls: a message of its own
            self.message_id = _message_id()
        message = self._message("in_progress", "")
        self.items.append(message)
        empty = {**message, "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.output_item.added", output_index=len(self.items) - 1, item=empty),
            self._event("response.content_part.added", **self._at(), part=part),
        ]

    def _at(self) -> JSON:
        """The open message (the last item; the first before there is any)."""
        index = max(len(self.items) - 1, 0)
        return {"item_id": self.message_id, "output_index": index, "content_index": 0}

    def _close_last(self, status: str) -> list[JSON]:
        """The done events of the open item (the last one, unless closed)."""
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        item = self.items[-1]
        index = len(self.items) - 1
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": text, "annotations": []}
            self.items[-1] = item = self._message(status, text)
            return [
                self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
                self._event("response.content_part.done", **self._at(), part=part),
                self._event("response.output_item.done", output_index=index, item=dict(item)),
            ]
        item["status"] = "completed"
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _call_item(name: str, arguments: str, status: str) -> JSON:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": new_call_id(),
        "name": name,
        "arguments": arguments,
        "status": status,
    }
