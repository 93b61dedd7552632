"""Tool calls on the gRPC API: a chat with tools (and a choice other than none) gets the
calls its answer made in `Complete.tool_calls`, read from the streamed text in the router's
tool-call format (tandem.tools), as the HTTP API reads them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from tandem.services.router.inputs import ChatPrompt, GenerateInput
from tandem.tools import ChoiceMode, ToolFormat
from tandem.v1 import router_pb2 as rpb


@dataclass(slots=True)
class CompleteCalls:
    """Follows one request's responses; `see` fills the Complete's tool_calls in place."""

    format: ToolFormat
    names: frozenset[str]
    text: list[str] = field(default_factory=list)

    def see(self, response: rpb.GenerateResponse) -> None:
        kind = response.WhichOneof("kind")
        if kind == "chunk":
            self.text.append(response.chunk.text)
        elif kind == "complete":
            parsed = self.format.parse("".join(self.text), self.names)
            response.complete.tool_calls.extend(
                rpb.ToolCall(
                    id=f"call_{uuid.uuid4().hex[:24]}",
                    function=rpb.FunctionCall(name=call.name, arguments=call.arguments),
                )
                for call in parsed.calls
            )


def complete_calls(inp: GenerateInput, format: ToolFormat) -> CompleteCalls | None:
    """None unless the request is a chat whose answer may be calls."""
    prompt = inp.prompt
    if not isinstance(prompt, ChatPrompt) or not prompt.tools.tools:
        return None
    if prompt.tools.choice.mode == ChoiceMode.NONE:
        return None
    return CompleteCalls(format, frozenset(t.name for t in prompt.tools.tools))
