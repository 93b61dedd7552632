"""What a chat with tools becomes before generation: the template's inputs and the grammar.

choice none                   the tools are dropped (the prompt as without them)
template reads `tools`        tools=[{"type": "function", "function": {...}}] (transformers)
template does not             the format's preamble opens the system message (or is one)
template never names          an assistant message's calls are written into its content in
  `tool_calls`                the format, so the model sees what it called before the results
choice required / a function  the output is forced by `forced_constraint`'s grammar
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.tools.formats import ToolFormat
from tandem.tools.spec import ChoiceMode, Tool, ToolChoice

if TYPE_CHECKING:
    from tandem.engine.grammar import Constraint


@dataclass(frozen=True, slots=True)
class ToolPrompt:
    """The template's messages and its `tools` variable (None: not passed)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def tool_prompt(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[Tool],
    choice: ToolChoice,
    format: ToolFormat,
    template_takes_tools: bool,
    template_renders_calls: bool = True,
) -> ToolPrompt:
    """The template's inputs for a chat with `tools` (module docstring). `messages` are in
    transformers' shape (tandem.chat.Message.to_template)."""
    messages = list(messages)
    if not template_renders_calls:
        messages = [_calls_as_text(m, format) for m in messages]
    if not tools or choice.mode == ChoiceMode.NONE:
        return ToolPrompt(messages, None)
    if template_takes_tools:
        return ToolPrompt(messages, [t.to_template() for t in tools])
    preamble = format.preamble(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{preamble}\n\n{first['content']}" if first["content"] else preamble
        return ToolPrompt([first, *messages[1:]], None)
    return ToolPrompt([{"role": "system", "content": preamble}, *messages], None)


def _calls_as_text(message: dict[str, Any], format: ToolFormat) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = format.write_calls(
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    )
    content = message["content"]
    return {**message, "content": f"{content}\n{written}" if content else written}


def forced_constraint(
    tools: Sequence[Tool], choice: ToolChoice, parallel: bool, format: ToolFormat
) -> Constraint | None:
    """The grammar that makes the answer calls in `format` (required: one or more, one with
    `parallel` false; a named function: exactly that one), or None when the model chooses."""
    # Here, not at the top: tandem.client reads tools without the engine (torch).
    from tandem.engine.grammar import Constraint, ConstraintKind

    if not choice.forced:
        return None
    return Constraint(ConstraintKind.GRAMMAR, format.grammar(tools, choice, parallel))
