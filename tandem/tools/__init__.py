"""Tools and tool calling: definitions and the tool choice (spec), the models' call formats
and the grammars that force them (formats), reading calls from a whole or streaming answer
(formats, stream), and the prompt a chat template receives (prompt)."""

from tandem.tools.formats import (
    DEFAULT_FORMAT,
    FORMATS,
    MAX_FORCED_CALLS,
    Parsed,
    ParsedCall,
    ToolFormat,
    detect_format,
    get_format,
    template_takes_tools,
)
from tandem.tools.prompt import ToolPrompt, forced_constraint, tool_prompt
from tandem.tools.spec import (
    ChoiceMode,
    Tool,
    ToolChoice,
    ToolError,
    check_tools,
    tool_choice_from_json,
    tools_from_json,
)
from tandem.tools.stream import Arguments, CallStart, Content, Event, ToolCallStream

__all__ = [
    "DEFAULT_FORMAT",
    "FORMATS",
    "MAX_FORCED_CALLS",
    "Arguments",
    "CallStart",
    "ChoiceMode",
    "Content",
    "Event",
    "Parsed",
    "ParsedCall",
    "Tool",
    "ToolCallStream",
    "ToolChoice",
    "ToolError",
    "ToolFormat",
    "ToolPrompt",
    "check_tools",
    "detect_format",
    "forced_constraint",
    "get_format",
    "template_takes_tools",
    "tool_choice_from_json",
    "tool_prompt",
    "tools_from_json",
]
