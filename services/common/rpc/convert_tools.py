"""proto <-> core for tools (router.proto ChatMessages.tools / tool_choice /
parallel_tool_calls <-> tandem.tools), beside convert.py's chat messages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.tools import ChoiceMode, Tool, ToolChoice
from tandem.tools.spec import NO_PARAMETERS
from tandem.v1 import router_pb2 as rpb

_MODES = {
    rpb.TOOL_CHOICE_MODE_NONE: ChoiceMode.NONE,
    rpb.TOOL_CHOICE_MODE_AUTO: ChoiceMode.AUTO,
    rpb.TOOL_CHOICE_MODE_REQUIRED: ChoiceMode.REQUIRED,
}
_MODES_TO_PROTO = {mode: value for value, mode in _MODES.items()}


@dataclass(frozen=True, slots=True)
class ChatTools:
    """A chat's tools, its tool choice and whether calls may come several at once."""

    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = ToolChoice(ChoiceMode.NONE)
    parallel: bool = True


def tools_from_proto(chat: rpb.ChatMessages) -> ChatTools:
    """Unchecked (tandem.tools.check_tools holds the rule); an unset choice is OpenAI's
    default: auto with tools, none without."""
    tools = tuple(
        Tool(t.function.name, t.function.description, t.function.parameters or NO_PARAMETERS)
        for t in chat.tools
    )
    kind = chat.tool_choice.WhichOneof("kind")
    if kind == "function":
        choice = ToolChoice(ChoiceMode.FUNCTION, chat.tool_choice.function)
    elif kind == "mode" and chat.tool_choice.mode in _MODES:
        choice = ToolChoice(_MODES[chat.tool_choice.mode])
    else:
        choice = ToolChoice(ChoiceMode.AUTO if tools else ChoiceMode.NONE)
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    return ChatTools(tools, choice, parallel)


def tools_to_proto(
    chat: rpb.ChatMessages, tools: Sequence[Tool], choice: ToolChoice | None, parallel: bool | None
) -> None:
    """Set a chat's tool fields (None: left unset)."""
    chat.tools.extend(
        rpb.Tool(
            function=rpb.FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters
            )
        )
        for t in tools
    )
    if choice is not None:
        if choice.mode == ChoiceMode.FUNCTION:
            chat.tool_choice.function = choice.name
        else:
            chat.tool_choice.mode = _MODES_TO_PROTO[choice.mode]
    if parallel is not None:
        chat.parallel_tool_calls = parallel
