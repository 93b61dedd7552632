"""OpenAI's answer objects, as pure code: the router's GenerateResponse messages -> chat
completions and text completions, whole or as chunks, with logprobs, usage and tool calls;
the model list. Requests are parsed by tandem.services.router.openai.protocol."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tandem import wire
from tandem.services.router.openai import tools as tools
from tandem.services.router.openai.protocol import JSON, ParsedRequest
from tandem.types import FinishReason
from tandem.v1 import router_pb2 as rpb

# The one core -> OpenAI finish-reason table (proto -> core is
# tandem.services.common.rpc.convert's).
_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


def usage(u: rpb.Usage) -> JSON:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def finish_reason(reason: int) -> str:
    """OpenAI's finish_reason for a proto FinishReason (unspecified: "stop")."""
    core = wire.finish_reason_from_proto(reason)
    return _FINISH[core] if core is not None else "stop"


@dataclass(slots=True)
class Answer:
    """Builds one request's OpenAI objects from the router's messages, in either shape.

    `token_text(id)` is the text of one token (for logprobs). `chat` selects
    chat.completion[.chunk] objects, else text_completion.
    """

    id: str
    model: str
    chat: bool
    parsed: ParsedRequest
    token_text: Callable[[int], str]
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    logprobs: list[rpb.TokenLogprob] = field(default_factory=list)
    chars: int = 0  # text so far (completions' text_offset)
    index: int = 0  # the choice's index (n > 1, several prompts)
    echo: str = ""  # completions' echo: the prompt's text, before the choice's
    tools: tools.AnswerTools | None = None  # a chat with tools: its calls, read from the text

    def __post_init__(self) -> None:
        parsed = self.parsed
        if self.chat and parsed.tool_names and parsed.tool_format is not None:
            self.tools = tools.AnswerTools(parsed.tool_format, parsed.tool_names)

    def chunks(self, chunk: rpb.Chunk) -> list[JSON]:
        """A streamed chunk as OpenAI's chunks: one, or with tools one per content piece,
        call announced or a call's arguments (none while the text may open a call or a
        call is not whole yet)."""
        if self.tools is None:
            return [self.chunk(chunk)]
        self.text.append(chunk.text)
        self.logprobs.extend(chunk.logprobs)
        return [self._delta_chunk(delta) for delta in self.tools.feed(chunk.text)]

    def _delta_chunk(self, delta: JSON) -> JSON:
        choice = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._envelope([choice])

    def chunk(self, chunk: rpb.Chunk) -> JSON:
        """A streamed chunk (and the text and logprobs kept for a whole answer)."""
        if self.tools is not None:  # one chunk, every delta of the text merged
            self.text.append(chunk.text)
            self.logprobs.extend(chunk.logprobs)
            return self._delta_chunk(tools.merge(self.tools.feed(chunk.text)))
        self.text.append(chunk.text)
        self.logprobs.extend(chunk.logprobs)
        logprobs = self._logprobs(chunk.logprobs, chunk.text) if self.parsed.logprobs else None
        if self.chat:
            choice = {"index": self.index, "delta": {"content": chunk.text}}
            return self._envelope([{**choice, "logprobs": logprobs, "finish_reason": None}])
        choice = {"index": self.index, "text": chunk.text}
        return self._envelope([{**choice, "logprobs": logprobs, "finish_reason": None}])

    def echo_chunk(self) -> JSON:
        """Completions' echo: the prompt's text as the choice's first streamed chunk."""
        choice = {"index": self.index, "text": self.echo, "logprobs": None}
        return self._envelope([{**choice, "finish_reason": None}])

    def first(self) -> JSON:
        """Chat streams open with the assistant role (OpenAI's first chunk)."""
        choice = {"index": self.index, "delta": {"role": "assistant", "content": ""}}
        return self._envelope([{**choice, "logprobs": None, "finish_reason": None}])

    def finish_chunks(self) -> list[JSON]:
        """With tools: what the end of the text releases (held content, the calls' last
        fragments), before the closing chunk."""
        if self.tools is None:
            return []
        return [self._delta_chunk(delta) for delta in self.tools.finish()]

    def last(self, complete: rpb.Complete) -> JSON:
        """The stream's closing chunk: no content, the finish reason."""
        reason = finish_reason(complete.finish_reason)
        key, empty = ("delta", {}) if self.chat else ("text", "")
        if self.tools is not None:  # what finish_chunks did not release, in this chunk
            rest = self.tools.finish()
            empty = tools.merge(rest) if rest else {}
            if self.tools.has_calls and reason == "stop":
                reason = "tool_calls"
        choice = {"index": self.index, key: empty, "logprobs": None, "finish_reason": reason}
        return self._envelope([choice])

    def usage_chunk(self, complete: rpb.Complete) -> JSON:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return {**self._envelope([]), "usage": usage(complete.usage)}

    def whole(self, complete: rpb.Complete) -> JSON:
        """The non-streaming answer, from every chunk seen."""
        text = "".join(self.text)
        logprobs = self._logprobs(self.logprobs, text, 0) if self.parsed.logprobs else None
        reason = finish_reason(complete.finish_reason)
        if self.chat:
            message: JSON = {"role": "assistant", "content": text}
            if self.tools is not None:
                parsed, calls = self.tools.whole(text)
                if calls:  # cut by max_tokens: the whole calls, finish_reason length
                    message = {"role": "assistant", "content": parsed.content or None}
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": self.index, "message": message, "logprobs": logprobs}
        else:
            choice = {"index": self.index, "text": self.echo + text, "logprobs": logprobs}
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [{**choice, "finish_reason": reason}],
            "usage": usage(complete.usage),
        }

    def _envelope(self, choices: list[JSON]) -> JSON:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        env: JSON = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.parsed.include_usage:
            env["usage"] = None
        return env

    def _logprobs(
        self, entries: Sequence[rpb.TokenLogprob], text: str, offset: int | None = None
    ) -> JSON:
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries]}
        if offset is None:
            offset = self.chars
            self.chars += len(text)
        return self._completion_logprobs(entries, offset)

    def _chat_logprob(self, entry: rpb.TokenLogprob) -> JSON:
        top = [_token_entry(self.token_text(t.token_id), t.logprob) for t in entry.top]
        return {**_token_entry(self.token_text(entry.token_id), entry.logprob), "top_logprobs": top}

    def _completion_logprobs(self, entries: Sequence[rpb.TokenLogprob], offset: int) -> JSON:
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        tops: list[Mapping[str, float] | None] = [
            {self.token_text(t.token_id): t.logprob for t in e.top} if e.top else None
            for e in entries
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def _token_entry(text: str, logprob: float) -> JSON:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def models(model_id: str, max_model_len: int, created: int) -> JSON:
    """GET /v1/models."""
    model = {"id": model_id, "object": "model", "created": created, "owned_by": "tandem"}
    return {"object": "list", "data": [{**model, "max_model_len": max_model_len}]}
