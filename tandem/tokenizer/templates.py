"""Chat templates: a model's Jinja template compiled in a sandbox and rendered over checked
messages, and the helpers that `Tokenizer.encode_chat` uses to mark the strings of a chat before
rendering it. Nothing here knows the vocabulary; tandem.tokenizer.tokenizer does the encoding."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# `encode_chat` marks control tokens in messages with two characters from the supplementary
# private use planes (U+F0000..U+10FFFD) that the request, template and vocabulary do not use.
_MARK_CHARS = range(0xF0000, 0x10FFFE)


class ChatTemplate:
    """A chat template compiled in jinja2's immutable sandbox, as transformers compiles it."""

    def __init__(self, source: str) -> None:
        """Raises ValueError when `source` is not valid Jinja."""
        self.source = source
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template is not valid Jinja: {exc}") from None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        bos_token: str,
        eos_token: str,
    ) -> str:
        """The template's text for `messages` (see `check_messages`). `tools`: the template's
        `tools` variable; None leaves it undefined. Raises ValueError when rendering fails."""
        extra = {} if tools is None else {"tools": list(tools)}  # unset: `tools is defined` false
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **extra,
                bos_token=bos_token,
                eos_token=eos_token,
                raise_exception=_raise_exception,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed to render: {exc}") from None

    def literal_text(self) -> str:
        """The text the template itself writes (its literal text and string constants), joined
        with "\\0" so that no token matches across two literals."""
        ast = self._template.environment.parse(self.source)
        literals = [node.data for node in ast.find_all(jinja2.nodes.TemplateData)]
        literals += [
            node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)
        ]
        return "\0".join(literals)


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages`, each a mapping with a string role and content.

    Raises:
        ValueError: naming the first message that is not."""
    checked: list[dict[str, Any]] = []
    for idx, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {idx} must be a mapping, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(
                    f"message {idx} must have a string {key!r}, got {message.get(key)!r}"
                )
        checked.append(dict(message))
    return checked


def iter_strings(value: Any) -> Iterator[str]:
    """Every string in a message's JSON-like value (mapping keys excluded)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from iter_strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from iter_strings(item)


def map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """A copy of a JSON-like value with `fn` applied to every string in it."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {key: map_strings(item, fn) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [map_strings(item, fn) for item in value]
    return value


def free_chars(num: int, texts: Sequence[str], avoid: frozenset[str]) -> list[str]:
    """`num` private use characters that occur in none of `texts` and are not in `avoid`."""
    used = set(avoid).union(*texts)
    free = list(itertools.islice((c for c in map(chr, _MARK_CHARS) if c not in used), num))
    if len(free) < num:
        raise ValueError("chat messages use every private use character")
    return free


def _raise_exception(message: str) -> NoReturn:
    raise ValueError(f"chat template error: {message}")
