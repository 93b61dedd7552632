"""A generate request as the router's core serves it: read once from either API's wire format.

    gRPC   GenerateRequest --Prompts.read-->  GenerateInput  (in RouterServer.generate)
    HTTP   JSON body --openai.protocol--> checked pieces --openai.http--> GenerateInput
                                                 |
                     RouterServer.generate: Prompts.spec (tokenize, the engine's checks,
                     a forced tool_choice's grammar) -> RequestSpec -> the workers

Each API reads its `response_format` / `constraint`, its tools and its chat messages once,
checks them once (a schema compiled once, off the event loop) and hands the core typed
values; the core never reads the wire request again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tandem.chat import Message
from tandem.engine.grammar import Constraint
from tandem.engine.sampling import SamplingParams
from tandem.services.common.rpc import convert
from tandem.services.common.rpc.convert_tools import ChatTools
from tandem.services.common.rpc.errors import invalid_argument
from tandem.v1 import router_pb2 as rpb


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation, its messages checked by tandem.chat's rule and its tools by
    tandem.tools' (schemas compiled)."""

    messages: tuple[Message, ...]
    add_generation_prompt: bool = True
    tools: ChatTools = ChatTools()

    def num_chars(self) -> int:
        return sum(m.num_chars() for m in self.messages)


NO_TOOLS = ChatTools()

# What to generate from: text, token ids, or a conversation.
Prompt = str | tuple[int, ...] | ChatPrompt


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """One request, parsed and checked: its prompt, its sampling parameters (a constraint
    compiled, so known to be valid; a forced tool_choice's grammar is added by the core),
    the model it names ("" for the served one) and the client's label for it (its request
    id, "" for none)."""

    prompt: Prompt
    params: SamplingParams
    model: str = ""
    label: str = ""

    @property
    def kind(self) -> str:
        """The input's field name on the wire: "text", "token_ids" or "chat"."""
        if isinstance(self.prompt, ChatPrompt):
            return "chat"
        return "text" if isinstance(self.prompt, str) else "token_ids"


@dataclass(frozen=True, slots=True)
class Source:
    """Where the core gets a request's input: the client's label for it and the coroutine
    that reads it, awaited inside the core's scope (a refusal is counted and traced as the
    request's, as every other)."""

    label: str
    read: Callable[[], Awaitable[GenerateInput]]


def http_input(
    request: rpb.GenerateRequest,
    messages: tuple[Message, ...] = (),
    tools: ChatTools = NO_TOOLS,
    constraint: Constraint | None = None,
) -> GenerateInput:
    """The input of an HTTP request from what its parser built once: `request` (the prompt,
    or a chat's add_generation_prompt, and the sampling fields), a chat's checked
    `messages` and `tools`, and the body's `constraint`, compiled once by the HTTP edge
    (`request`'s copy of it is not read again). Raises ServiceError (INVALID_ARGUMENT
    naming the sampling field the engine refuses)."""
    sampling = rpb.SamplingParams()
    sampling.CopyFrom(request.sampling)
    sampling.ClearField("constraint")
    try:
        params = convert.sampling_from_proto(sampling)
    except ValueError as exc:
        raise invalid_argument(f"sampling.{exc}") from None
    if constraint is not None:
        params = dataclasses.replace(params, constraint=constraint)
    kind = request.WhichOneof("input")
    prompt: Prompt
    if kind == "chat":
        chat = request.chat
        add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        prompt = ChatPrompt(messages, add_gen, tools)
    elif kind == "token_ids":
        prompt = tuple(request.token_ids.ids)
    else:
        prompt = request.text
    return GenerateInput(prompt, params, request.model, request.request_id)
